"""Structured outputs, cost: what the token mask costs per decoded token, in one run on the same schemas.

    .venv/bin/python bench/structured_decoding.py [--model smollm2-135m] [--limit 8] [--max-tokens 256]
        [--parts tiers,llguidance,llamacpp,vllm] [--tiers edge,cloud]

- tiers: decode tokens/s of each tier (bench/structured_coverage.py starts them), constrained
  (strict json_schema) vs unconstrained, same prompt and max_tokens, greedy, streamed; batch 1
  (sequential) and batch 8 (8 requests at once); goal: < 5 % slower at batch 1, < 10 % at 8;
- llguidance: grammar compile time (``LLMatcher(tokenizer, grammar)``, first compile, the servers' JSON
  style and limits) over the corpus on the GGUF's own vocabulary, and the mask's time per token along
  each example instance;
- llamacpp: llama-cpp-python's GBNF path (``response_format`` json_object + schema) vs none, tokens/s,
  and its grammar compile time (schema to GBNF, then llama.cpp's parse in ``llama_sampler_init_grammar``);
- vllm: vLLM's CPU build (~/.cache/cascade/vllm-venv) on our converted model dir, the same requests as
  the tiers; if it is not healthy in 5 min, or refuses guided decoding, the table says so.
Decode tokens/s of one request: (tokens - 1) / (last token's time - first token's time); each free request
is held to the length its constrained twin had (max_tokens), so both decode the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
from structured_coverage import Tier, add_tier_args, prompt, refusal, response_format, running_tier, tier_models
from structured_schemas import enforced, load_corpus  # noqa: I001 (siblings: sys.path[0] is bench/)

from cascade.processes import NotHealthy, free_port, spawn, stop, wait_healthy
from cascade.structured.grammar import JSON_STYLE, limits

SCHEMAS = ("kiosk_form", "tool_open_door", "sentiment", "github_issue", "sql_query_plan", "order_line_items",
           "sensor_reading", "payment_method", "flight_booking", "named_entities")
VLLM_PYTHON = Path.home() / ".cache/cascade/vllm-venv/bin/python"


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def decode_rate(tokens: int, first: float | None, last: float | None) -> float | None:
    return (tokens - 1) / (last - first) if tokens > 1 and first is not None and last > first else None


async def stream_one(tier: Tier, client, entry: dict, constrained: bool, max_tokens: int) -> dict:
    """One streamed greedy request: its completion tokens and decode rate, or the refusal."""
    kwargs = dict(model=tier.model, messages=prompt(entry), temperature=0, max_tokens=max_tokens, stream=True,
                  stream_options={"include_usage": True})
    if constrained:
        kwargs["response_format"] = response_format(entry)
    first = last = usage = None
    chunks = 0
    try:
        async for chunk in await client.chat.completions.create(**kwargs):
            now = time.perf_counter()
            if chunk.usage:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                chunks, first, last = chunks + 1, first or now, now
    except openai.APIStatusError as err:  # a 400 naming the parameter, or a server that fails on it
        return {"refused": refusal(err)}
    tokens = usage or chunks
    return {"tokens": tokens, "rate": decode_rate(tokens, first, last)}


async def one_round(tier: Tier, entries: list[dict], constrained: bool, batch: int, lengths: list[int]) -> dict:
    """Every entry once (``lengths``: each one's max_tokens), ``batch`` at a time: the median decode rate,
    aggregate tokens/s, each entry's completion tokens, the first refusal."""
    start, runs = time.perf_counter(), []
    async with tier.client(asynchronous=True) as client:
        for i in range(0, len(entries), batch):
            runs += await asyncio.gather(*(stream_one(tier, client, e, constrained, n)
                                           for e, n in zip(entries[i:i + batch], lengths[i:i + batch], strict=True)))
    wall = time.perf_counter() - start
    rates = [r["rate"] for r in runs if r.get("rate") is not None]
    refused = [r["refused"] for r in runs if "refused" in r]
    tokens = [r.get("tokens", 0) for r in runs]
    return {"median": statistics.median(rates) if rates else float("nan"), "agg": sum(tokens) / wall,
            "lengths": tokens, "refused": refused[0] if refused else ""}


def bench_server(tier: Tier, entries: list[dict], max_tokens: int) -> list[tuple]:
    """(server, batch, unconstrained, constrained) rows: a warm-up each way, then batch 1 and 8. The
    free requests get the constrained ones' lengths as max_tokens: the same tokens and the same batch
    as it drains (a JSON answer ends early; free ones running to max_tokens would be a fuller batch)."""
    asyncio.run(one_round(tier, entries[:1], False, 1, [16]))
    asyncio.run(one_round(tier, entries[:1], True, 1, [16]))
    rows = []
    for batch in (1, 8):
        bound = asyncio.run(one_round(tier, entries, True, batch, [max_tokens] * len(entries)))
        lengths = [n if n > 1 else max_tokens for n in bound["lengths"]]  # refused: the full length
        free = asyncio.run(one_round(tier, entries, False, batch, lengths))
        rows.append((f"{tier.name} ({tier.model})", batch, free, bound))
        print(f"  {tier.name} batch {batch} done", flush=True)
    return rows


def gguf_path(model: str) -> Path:
    from model_distribution.artifacts.catalog import Catalog

    home = Path(os.environ.get("CASCADE_HOME") or Path.home() / ".cascade")
    return Path(Catalog(home).get(model).path)


def bench_llguidance(gguf: Path, corpus: list[dict]) -> dict:
    """Compile times (ms) over the corpus and mask times (us per token) along the examples."""
    import llama_cpp
    import llguidance
    import llguidance.llamacpp
    import llguidance.numpy
    from llama_cpp._logger import set_verbose

    set_verbose(False)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    try:
        tok = llguidance.llamacpp.lltokenizer_from_vocab(llama_cpp.llama_model_get_vocab(model))
        compile_ms, mask_us, failed = [], [], []
        bitmask = llguidance.numpy.allocate_token_bitmask(1, tok.vocab_size)
        for entry in enforced(corpus):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(entry["schema"], defaults=JSON_STYLE)
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(tok, grammar, limits=limits())
            compile_ms.append(1000 * (time.perf_counter() - start))
            for token in tok.tokenize_str(json.dumps(entry["example"])):  # the servers' ", " and ": "
                start = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
                mask_us.append(1e6 * (time.perf_counter() - start))
                if not matcher.consume_token(token):
                    failed.append(entry["name"])
                    break
        return {"compile_ms": compile_ms, "mask_us": mask_us, "failed": failed}
    finally:
        llama_cpp.llama_model_free(model)


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """llama.cpp prints a grammar it cannot parse to fd 2, past Python's logging: hide it."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def gbnf_compile_ms(llm, corpus: list[dict]) -> tuple[list[float], list[str]]:
    """Schema to GBNF (llama-cpp-python) plus llama.cpp's grammar parse, per schema; the failures."""
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    times, failed = [], []
    for entry in corpus:
        start = time.perf_counter()
        try:
            grammar = LlamaGrammar.from_json_schema(json.dumps(entry["schema"]), verbose=False)
            sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, grammar._grammar.encode(), b"root")
        except Exception as err:  # the converter raises on what it does not know; the bench reports it
            failed.append(f"{entry['name']}: {type(err).__name__}")
            continue
        if not sampler:
            failed.append(f"{entry['name']}: parse")
            continue
        times.append(1000 * (time.perf_counter() - start))
        llama_cpp.llama_sampler_free(sampler)
    return times, failed


def llamacpp_rate(llm, entry: dict, constrained: bool, max_tokens: int) -> tuple[int, float | None]:
    kwargs = {"response_format": {"type": "json_object", "schema": entry["schema"]}} if constrained else {}
    first = last = None
    tokens = 0
    for chunk in llm.create_chat_completion(messages=prompt(entry), temperature=0, max_tokens=max_tokens,
                                            stream=True, **kwargs):
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            tokens, first, last = tokens + 1, first or now, now
    return tokens, decode_rate(tokens, first, last)


def bench_llamacpp(gguf: Path, corpus: list[dict], entries: list[dict], max_tokens: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=1, verbose=False)
    with quiet_stderr():
        compile_ms, failed = gbnf_compile_ms(llm, corpus)
    llamacpp_rate(llm, entries[0], True, 8)  # warm-up
    bound = [llamacpp_rate(llm, e, True, max_tokens) for e in entries]
    free = [llamacpp_rate(llm, e, False, max(n, 2)) for e, (n, _) in zip(entries, bound, strict=True)]
    return {"compile_ms": compile_ms, "failed": failed, "free": statistics.median(r for _, r in free if r),
            "bound": statistics.median(r for _, r in bound if r)}


def bench_vllm(entries: list[dict], max_tokens: int, work: Path, model: str) -> list[tuple] | str:
    """vLLM started as tests/vllm_server.py starts it; the rows, or why there are none."""
    if not VLLM_PYTHON.exists():
        return f"not installed ({VLLM_PYTHON} missing: bash scripts/install-vllm.sh)"
    from model_distribution.artifacts.model_dirs import resolve_model_dir

    port = free_port()
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(model)),
           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "8"]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    proc = spawn(cmd, env=env, log=work / "vllm.log", cwd=work)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 300, "vLLM", path="/health", log=work / "vllm.log")
        return bench_server(Tier("vllm", f"http://127.0.0.1:{port}", "", model), entries, max_tokens)
    except NotHealthy as err:
        return f"did not start in 5 min: {str(err).splitlines()[0][:150]}"
    finally:
        stop(proc, timeout_s=30)


def print_servers(rows: list[tuple], notes: list[str]) -> None:
    print(f"\n{'server':<32} {'batch':>5} {'free tok/s':>10} {'json tok/s':>10} {'slower':>7} "
          f"{'free agg':>8} {'json agg':>8}  goal")
    for server, batch, free, bound in rows:
        goal = 5 if batch == 1 else 10
        if bound["refused"]:
            print(f"{server:<32} {batch:>5} {free['median']:>10.1f} {'refused':>10}  {bound['refused'][:80]}")
            continue
        slower = 100 * (1 - bound["median"] / free["median"])
        print(f"{server:<32} {batch:>5} {free['median']:>10.1f} {bound['median']:>10.1f} {slower:>6.1f}% "
              f"{free['agg']:>8.1f} {bound['agg']:>8.1f}  <{goal}% {'met' if slower < goal else 'MISSED'}")
    for note in notes:
        print(note)


def print_inprocess(llg: dict | None, lcp: dict | None, n_corpus: int) -> None:
    if llg:
        print(f"\nllguidance, {len(llg['compile_ms'])} enforced schemas of {n_corpus}: compile p50 "
              f"{pct(llg['compile_ms'], .5):.2f} ms, p99 {pct(llg['compile_ms'], .99):.2f} ms; mask per token p50 "
              f"{pct(llg['mask_us'], .5):.1f} us, p99 {pct(llg['mask_us'], .99):.1f} us over {len(llg['mask_us'])} "
              f"tokens; examples the mask refused: {llg['failed'] or 'none'}")
    if lcp:
        print(f"llama-cpp-python GBNF, {len(lcp['compile_ms'])} of {n_corpus} schemas compiled: p50 "
              f"{pct(lcp['compile_ms'], .5):.2f} ms, p99 {pct(lcp['compile_ms'], .99):.2f} ms; failed: "
              f"{lcp['failed'] or 'none'}")
        print(f"llama-cpp-python 1 thread, decode tok/s median: free {lcp['free']:.1f}, json_object+schema "
              f"{lcp['bound']:.1f} ({100 * (1 - lcp['bound'] / lcp['free']):.1f}% slower)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tier_args(p)
    p.add_argument("--limit", type=int, default=8, help="schemas per server measurement (default: 8)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--parts", default="tiers,llguidance,llamacpp,vllm")
    args = p.parse_args()
    parts, corpus = args.parts.split(","), load_corpus()
    by_name = {e["name"]: e for e in corpus}
    entries = [by_name[n] for n in SCHEMAS[:args.limit]]
    models, rows, notes = tier_models(args), [], []
    llg = lcp = None
    with tempfile.TemporaryDirectory(prefix="structured-decoding-") as work:
        if "tiers" in parts:
            for name in [t for t in args.tiers.split(",") if t]:
                with running_tier(name, models[name], args, Path(work), parallel=8) as tier:
                    rows += bench_server(tier, entries, args.max_tokens)
        if "llguidance" in parts:
            llg = bench_llguidance(gguf_path(models["edge"]), corpus)
        if "llamacpp" in parts:
            lcp = bench_llamacpp(gguf_path(models["edge"]), corpus, entries, args.max_tokens)
        if "vllm" in parts:
            got = bench_vllm(entries, args.max_tokens, Path(work), "smollm2-135m")
            rows, notes = (rows + got, notes) if isinstance(got, list) else (rows, [*notes, f"vLLM: {got}"])
    print(f"\n{len(entries)} schemas, greedy, max_tokens {args.max_tokens}, streamed; {os.cpu_count()} cores; "
          "tok/s: median decode rate per request; agg: completion tokens / wall of the round")
    print_servers(rows, notes)
    print_inprocess(llg, lcp, len(corpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
