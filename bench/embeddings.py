"""Embeddings: texts/s on each tier against llama-cpp-python's own embedder, same GGUF, same texts.

    .venv/bin/python bench/embeddings.py [--model smollm2-135m] [--texts 128] [--batch 16] [--no-vllm]

Peers, one after the other on this machine, each given the same texts (the first user turns of our
packaged ShareGPT, cut to ``--max-chars``) in requests of ``--batch`` texts:
- llama.cpp: ``Llama(model_path, embedding=True, pooling_type=MEAN).embed(..., normalize=True)``
  in this process (the reference the cosine column compares against);
- edge: `cascade edge run` (llama.cpp's embedding mode through our agent, one input at a time);
- cloud: `cascade cloud serve --both 1` (our engine, through the gateway and the worker);
- vLLM: its CPU build's pooling runner (``--runner pooling --convert embed``, mean pooling,
  normalised: vLLM 0.32 spells it ``use_activation``) on our conversion of the same GGUF, when its
  virtualenv is there and it starts within ``--vllm-start-s``.
Each is warmed up with one request, then timed over all the texts."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.tiers import bench_env, cloud_key, start_cloud, start_edge
from cascade.eval.sharegpt import load_conversations
from cascade.processes import free_port, spawn, stop, wait_healthy

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before llama.cpp loads, as the agent does (busy cores)
VLLM_PYTHON = Path.home() / ".cache/cascade/vllm-venv/bin/python"


def texts_of(n: int, max_chars: int) -> list[str]:
    out = []
    for conv in load_conversations(4 * n):
        first = next((t.text for t in conv.turns if t.role in ("human", "user") and t.text.strip()), "")
        if first:
            out.append(first[:max_chars])
        if len(out) == n:
            break
    return out


def over_http(url: str, model: str, texts: list[str], batch: int, key: str = "unused") -> tuple[float, np.ndarray]:
    """(seconds, vectors) of embedding ``texts`` in requests of ``batch`` through ``url``'s /v1/embeddings."""
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=600) as client:
        def ask(part):
            r = client.post(f"{url}/v1/embeddings", json={"model": model, "input": part}, headers=headers)
            r.raise_for_status()
            return [d["embedding"] for d in r.json()["data"]]
        ask(texts[:1])
        start = time.perf_counter()
        vectors = [v for i in range(0, len(texts), batch) for v in ask(texts[i:i + batch])]
        return time.perf_counter() - start, np.array(vectors)


def llama_cpp_reference(path: str, texts: list[str], batch: int, n_ctx: int) -> tuple[float, np.ndarray]:
    import llama_cpp

    llm = llama_cpp.Llama(path, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=n_ctx,
                          n_batch=n_ctx, n_ubatch=n_ctx, n_threads=os.cpu_count(), verbose=False)
    llm.embed(texts[:1], normalize=True)
    start = time.perf_counter()
    vectors = [v for i in range(0, len(texts), batch) for v in llm.embed(texts[i:i + batch], normalize=True)]
    return time.perf_counter() - start, np.array(vectors)


def start_vllm(model: str, work: Path, n_ctx: int) -> tuple:
    from model_distribution.artifacts.model_dirs import resolve_model_dir

    port = free_port()
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(model)),
           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--dtype", "float32", "--max-model-len", str(n_ctx), "--runner", "pooling", "--convert", "embed",
           "--pooler-config", json.dumps({"pooling_type": "MEAN", "use_activation": True})]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    return spawn(cmd, env=env, log=work / "vllm.log", cwd=work), f"http://127.0.0.1:{port}"


def run_server(name: str, start, wait_s: float, texts, batch, model, results, log: Path | None = None, key=None):
    proc, url = start()
    try:
        wait_healthy(url, proc, wait_s, name, path="/health", log=log)
        results[name] = over_http(url, model, texts, batch, *(() if key is None else (key,)))
    except Exception as e:  # a peer that does not start is recorded, not fatal
        results[name] = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
    finally:
        stop(proc)


def print_table(results: dict, texts: list[str], tokens: int) -> None:
    ref = results["llama.cpp"][1]
    print(f"\n{len(texts)} texts, {tokens} tokens ({os.cpu_count()} CPUs)")
    print(f"{'peer':<10} {'texts/s':>8} {'tokens/s':>9} {'min cos vs llama.cpp':>21}")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<10} did not run: {r}")
            continue
        seconds, vectors = r
        cos = float((vectors * ref).sum(axis=1).min()) if vectors.shape == ref.shape else float("nan")
        print(f"{name:<10} {len(texts) / seconds:>8.1f} {tokens / seconds:>9.0f} {cos:>21.5f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--texts", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-chars", type=int, default=400)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--vllm-start-s", type=float, default=300.0)
    args = p.parse_args()
    from cascade.config import cascade_home
    from model_distribution.artifacts.catalog import Catalog

    catalog = Catalog(cascade_home())
    path = str(catalog.ensure_ready(catalog.get(args.model)))
    texts = texts_of(args.texts, args.max_chars)
    import llama_cpp

    vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    tokens = sum(len(vocab.tokenize(t.encode())) for t in texts)
    work = Path(tempfile.mkdtemp(prefix="embeddings-bench-"))
    env = bench_env(work)
    results: dict = {"llama.cpp": llama_cpp_reference(path, texts, args.batch, args.n_ctx)}
    m, n, b = args.model, args.n_ctx, args.batch
    run_server("edge", lambda: start_edge(env, m, n_ctx=n), 300, texts, b, m, results)
    key = cloud_key(env, work)
    run_server("cloud", lambda: start_cloud(env, m, "auto", "--both", "1", max_model_len=n), 600, texts, b, m,
               results, key=key)
    if args.no_vllm:
        results["vLLM"] = "--no-vllm"
    elif not VLLM_PYTHON.exists():
        results["vLLM"] = f"not installed ({VLLM_PYTHON})"
    else:
        run_server("vLLM", lambda: start_vllm(m, work, n), args.vllm_start_s, texts, b, m, results,
                   log=work / "vllm.log")
    print_table(results, texts, tokens)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
