"""The cloud tier under a ShareGPT load, against vLLM's CPU server, same run, same prompts:
`cascade cloud serve` disaggregated (1 prefill + 1 decode) and co-located (1 worker), then
`vllm serve` on the same converted weights.

    .venv/bin/python bench/cloud_serve.py [--num-prompts 32] [--max-concurrency 8]
        [--max-output-tokens 128] [--systems pd,both,vllm]
        [--vllm-python ~/.cache/cascade/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cascade.eval.sharegpt import load_conversations, sample_requests
from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command
from testkit.loadgen import LoadConfig, format_table, run_benchmark

# the figures here are about SmolLM2-135M (the defaults are the Qwen tier pair): every server started here serves it
os.environ.setdefault("CASCADE_EDGE_MODEL_NAME", "smollm2-135m")
os.environ.setdefault("CASCADE_CLOUD_ENGINE_MODEL", "smollm2-135m")

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
CASCADE = {"pd": ["--prefill", "1", "--decode", "1"],
           "both": ["--both", "1", "--prefill", "0", "--decode", "0"]}
NAMES = {"pd": "cascade cloud serve --prefill 1 --decode 1", "both": "cascade cloud serve --both 1",
         "vllm": "vLLM CPU (vllm serve)"}


def start(system: str, args, work: Path) -> tuple[subprocess.Popen, str, str | None]:
    port = free_port()
    if system == "vllm":
        from model_distribution.artifacts.model_dirs import resolve_model_dir

        proc = spawn([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      str(resolve_model_dir(MODEL)), "--served-model-name", MODEL,
                      "--dtype", "float32", "--max-model-len", "2048", "--port", str(port)],
                     env={"VLLM_CPU_KVCACHE_SPACE": "4"}, log=Path(os.devnull), cwd=work)
        return proc, f"http://127.0.0.1:{port}", None
    db = work / f"{system}.db"
    env = {"CASCADE_CLOUD_GATEWAY_DB": str(db), "CASCADE_CLOUD_GATEWAY_TTFT_SLO_S": "600"}
    out = subprocess.run(cascade_command("cloud", "keys", "create", "--db", str(db),
                                         "--tenant", "bench"),
                         env={**os.environ, "OMP_WAIT_POLICY": "passive", **env},
                         capture_output=True, text=True, check=True).stdout
    key = out.strip().splitlines()[-1]
    proc = spawn(cascade_command("cloud", "serve", "--port", str(port), "--max-model-len", "2048",
                                 *CASCADE[system]), env=env, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}", key


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--systems", default="pd,both,vllm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python",
                   default=str(Path.home() / ".cache/cascade/vllm-venv/bin/python"))
    args = p.parse_args()
    from serve_bench import load_tokenizer  # noqa: I001 (a sibling: sys.path[0] is bench/)

    requests = sample_requests(args.num_prompts, args.seed, load_tokenizer(MODEL),
                               args.max_prompt_tokens, args.max_output_tokens,
                               conversations=load_conversations())
    work = Path(tempfile.mkdtemp(prefix="cloud-serve-bench-"))
    tables = []
    for system in args.systems.split(","):
        if system == "vllm" and not Path(args.vllm_python).exists():
            tables.append(f"{NAMES[system]}: not installed ({args.vllm_python} missing)")
            continue
        proc, url, key = start(system, args, work)
        try:
            wait_healthy(url, proc, timeout_s=900, what=NAMES[system],
                         path="/health" if system == "vllm" else "/healthz")
            load = LoadConfig("chat", math.inf, args.max_concurrency, True, args.seed, key)
            asyncio.run(run_benchmark(url, MODEL, requests[:2], load))  # warm-up
            result = asyncio.run(run_benchmark(url, MODEL, requests, load))
            tables.append(f"== {NAMES[system]}\n{format_table(result)}")
        except (RuntimeError, OSError) as e:  # NotHealthy is a RuntimeError
            tables.append(f"== {NAMES[system]}: failed: {e}")
        finally:
            stop(proc, timeout_s=60)
    print(f"\n{len(requests)} ShareGPT requests, at most {args.max_concurrency} in flight, "
          f"output <= {args.max_output_tokens} tokens (ignore_eos), {os.cpu_count()} cores\n")
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
