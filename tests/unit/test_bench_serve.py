"""bench/serve_vs_vllm.py's summaries of interleaved rounds (no servers: the result dicts only)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the script imports its siblings bare

serve_vs_vllm = pytest.importorskip("serve_vs_vllm")


def result(path, rate, rnd, ttft, tpot=50.0, **extra):
    return {"path": path, "rate": rate, "round": rnd, "p50_ttft_ms": ttft, "p99_ttft_ms": ttft * 2,
            "p50_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.5, "output_throughput": 100.0, "completed": 100,
            "failed": 0, "errors": [], **extra}


def test_each_figure_is_its_median_over_the_rounds_per_rate_and_system():
    rounds = [result("vllm", "1", 0, 100.0), result("cascade", "1", 0, 90.0),
              result("vllm", "1", 1, 300.0, errors=["boom"]), result("cascade", "1", 1, 80.0),
              result("vllm", "1", 2, 200.0), result("cascade", "1", 2, 1000.0),
              result("vllm", "inf", 0, 5.0)]
    by = {(r["rate"], r["path"]): r for r in serve_vs_vllm.medians(rounds)}
    assert by[("1", "vllm")]["p50_ttft_ms"] == 200.0 and by[("1", "vllm")]["p99_ttft_ms"] == 400.0
    assert by[("1", "cascade")]["p50_ttft_ms"] == 90.0
    assert by[("1", "vllm")]["errors"] == ["boom"]  # an error of any round is kept
    assert by[("inf", "vllm")] is rounds[-1]  # a single round is itself
    assert len(by) == 3


def test_a_figure_a_round_lacks_is_the_median_of_the_rounds_that_have_it():
    a, b = result("vllm", "4", 0, 10.0), result("vllm", "4", 1, 30.0)
    del b["p99_tpot_ms"]
    (m,) = serve_vs_vllm.medians([a, b])
    assert m["p50_ttft_ms"] == 20.0 and m["p99_tpot_ms"] == a["p99_tpot_ms"]


def test_the_process_tree_cpu_counts_this_process():
    import os

    assert serve_vs_vllm.tree_cpu_seconds(os.getpid()) > 0
    assert serve_vs_vllm.tree_cpu_seconds(2 ** 22 + 7) == 0.0  # no such process
