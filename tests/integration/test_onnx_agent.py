"""`cascade edge run --backend onnx` on SmolLM2's int4 ONNX export (onnxruntime-genai, CPU), through
the official openai client: chat streamed and not, logprobs, /v1/models naming the format; in auto
mode the confidence signal exists, is sane, and escalates on a forced-low threshold like the
llama.cpp agent does (the "cloud" here is a llama.cpp agent: any OpenAI-compatible upstream);
bad input exits 2 with one line before anything listens."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from cascade.processes import free_port
from tests import loopback
from tests.conftest import REPO, Agent

pytest.importorskip("onnxruntime_genai")

EASY = [{"role": "user", "content": "Which city is the capital of France?"}]
VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def export(onnx_export) -> Path:
    return onnx_export("int4")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """The cascade's upstream: a llama.cpp agent (SmolLM2 Q4_1), answering everything itself."""
    a = Agent(tmp_path_factory.mktemp("upstream"), "--no-config", "--n-ctx", "512", "--threads", "1").wait_healthy()
    yield a
    a.stop()


def onnx_agent(home: Path, export: Path, upstream, **cascade) -> Agent:
    env = {"CASCADE_EDGE_UPSTREAM_URL": upstream.url, "CASCADE_EDGE_CASCADE_HOLD_TOKENS": "4",
           **{f"CASCADE_EDGE_CASCADE_{k.upper()}": str(v) for k, v in cascade.items()}}
    return Agent(home, "--no-config", "--backend", "onnx", "--model", str(export), "--n-ctx", "512",
                 "--threads", "1", env=env).wait_healthy()


@pytest.fixture(scope="module")
def edge(tmp_path_factory, export, upstream):
    """Confidence checked (a threshold no real answer is under): every easy request stays local."""
    a = onnx_agent(tmp_path_factory.mktemp("onnx-edge"), export, upstream, min_mean_logprob="-50")
    yield a
    a.stop()


@functools.cache  # one per server: each client builds its own TLS context (~60 ms of CPU)
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def model_id(server) -> str:
    return client(server).models.list().data[0].id


def test_the_onnx_agent_lists_its_model_as_onnx(edge, export):
    card = loopback.get(f"{edge.url}/v1/models").json()["data"][0]
    assert card["meta"]["format"] == "onnx" and card["meta"]["quantization"] == "int4"
    assert card["meta"]["n_ctx"] == 512 and card["meta"]["chat_template"] is True
    assert client(edge).models.retrieve(export.name).id == card["id"]  # the directory's name answers too


def test_chat_is_served_streamed_and_not_with_logprobs(edge):
    c, model = client(edge), model_id(edge)
    whole = c.chat.completions.create(model=model, messages=EASY, max_tokens=12, temperature=0, logprobs=True,
                                      top_logprobs=3, extra_body={"cascade": {"mode": "local"}})
    text = whole.choices[0].message.content
    assert text.strip() and whole.usage.completion_tokens == len(whole.choices[0].logprobs.content)
    for t in whole.choices[0].logprobs.content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True) and math.isclose(t.logprob, alts[0], abs_tol=1e-4)  # greedy
    stream = c.chat.completions.create(model=model, messages=EASY, max_tokens=12, temperature=0, stream=True,
                                       logprobs=True, extra_body={"cascade": {"mode": "local"}})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    streamed = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in whole.choices[0].logprobs.content], abs=1e-4)
    assert next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason).choices[0].finish_reason in (
        "stop", "length")
    seeded = [c.chat.completions.create(model=model, messages=EASY, max_tokens=12, temperature=0.9, seed=7,
                                        extra_body={"cascade": {"mode": "local"}}).choices[0].message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]  # our sampler, seeded per request


def test_in_auto_mode_the_confidence_signal_is_measured_from_the_reported_logprobs(edge):
    r = client(edge).chat.completions.with_raw_response.create(model=model_id(edge), messages=EASY, max_tokens=12,
                                                               temperature=0, logprobs=True, top_logprobs=20)
    assert (r.headers["x-cascade-tier"], r.headers["x-cascade-reason"]) == ("edge", "easy")
    body = r.parse()
    conf = body.model_extra["cascade"]["confidence"]
    first = body.choices[0].logprobs.content[:4]
    assert conf["tokens"] == 4 == len(first)
    assert conf["mean_logprob"] == pytest.approx(sum(t.logprob for t in first) / 4, abs=1e-3)
    assert conf["min_logprob"] == pytest.approx(min(t.logprob for t in first), abs=1e-3)
    # the top 20 alternatives' share of the entropy bounds it from below; the vocabulary from above
    partial = sum(-math.exp(a.logprob) * a.logprob for t in first for a in t.top_logprobs) / 4
    assert partial - 1e-3 <= conf["mean_entropy"] <= math.log(VOCAB)


def test_a_forced_low_confidence_threshold_escalates_and_the_upstream_answers(tmp_path, export, upstream):
    """As on llama.cpp (test_cascade.py): the same policy on the ONNX backend's signal; the module's
    agent (threshold -50) answered the same prompt on the edge."""
    a = onnx_agent(tmp_path, export, upstream, min_mean_logprob="0.0")  # every token's logprob is < 0
    try:
        model = model_id(a)
        r = client(a).chat.completions.with_raw_response.create(model=model, messages=EASY, max_tokens=12,
                                                                temperature=0)
        assert (r.headers["x-cascade-tier"], r.headers["x-cascade-reason"]) == ("cloud", "low_confidence")
        body = r.parse()
        assert body.model_extra["cascade"]["confidence"]["tokens"] == 4
        expected = client(upstream).chat.completions.create(model=model, messages=EASY, max_tokens=12, temperature=0)
        assert body.choices[0].message.content == expected.choices[0].message.content
        with loopback.stream("POST", f"{a.url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": EASY, "max_tokens": 12, "temperature": 0, "stream": True}) as s:
            assert (s.headers["x-cascade-tier"], s.headers["x-cascade-reason"]) == ("cloud", "low_confidence")
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines)
        metrics = loopback.get(f"{a.url}/metrics").text
        assert 'cascade_edge_decisions_total{reason="low_confidence",tier="cloud"} 2.0' in metrics
    finally:
        a.stop()


def edge_run(home: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cascade_cli", "edge", "run", "--no-config", "--port",
                           str(free_port()), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CASCADE_HOME": str(home), **(env or {})})


def _the_error(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "no config file" not in ln]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("cascade: "), r.stderr[-2000:]
    assert "Uvicorn running" not in r.stdout + r.stderr  # refused before anything listened
    return lines[0]


def test_bad_input_exits_2_with_one_line_before_anything_listens(tmp_path, export, smollm2_path):
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    for f in export.iterdir():
        if f.name != "genai_config.json":
            os.symlink(f, no_config / f.name)
    assert "has no genai_config.json" in _the_error(edge_run(tmp_path, "--backend", "onnx", "--model",
                                                             str(no_config)))
    assert "is not a directory" in _the_error(edge_run(tmp_path, "--backend", "onnx", "--model", smollm2_path))
    assert "is not a directory" in _the_error(edge_run(tmp_path, "--backend", "onnx", "--model",
                                                       str(tmp_path / "missing")))
    err = _the_error(edge_run(tmp_path, "--backend", "onnx", "--model", str(export), "--providers", "cuda,bogus"))
    assert "unknown provider(s) 'bogus'" in err and "cuda" in err
    assert "unknown backend 'tensorrt'" in _the_error(edge_run(tmp_path, "--backend", "tensorrt"))


def test_a_mixed_onnxruntime_install_is_refused_at_start(tmp_path, export):
    """onnxruntime-gpu's metadata beside the CPU build's (what `pip install` of both leaves)."""
    site = tmp_path / "site"
    dist = site / "onnxruntime_gpu-1.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.32.0\n")
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    err = _the_error(edge_run(tmp_path, "--backend", "onnx", "--model", str(export), env={"PYTHONPATH": pythonpath}))
    assert "onnxruntime-gpu" in err and "onnxruntime " in err
