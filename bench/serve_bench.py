"""Serving benchmark for any OpenAI-compatible server (our edge agent, the cloud worker, vLLM),
in the spirit of ``vllm bench serve``: ShareGPT prompts, Poisson arrivals, streamed responses,
TTFT / TPOT / ITL / E2E percentiles and throughput.

    .venv/bin/python bench/serve_bench.py --base-url http://127.0.0.1:8081 --model smollm2-135m \\
        --num-prompts 50 --request-rate inf --max-output-tokens 128 --seed 0 \\
        [--endpoint chat|completions] [--max-concurrency N] [--ignore-eos] [--save-json out.json]

Prompt and output lengths are counted with ``--tokenizer``: a catalogue model name (default
smollm2-135m, vocabulary only), a .gguf file, or a Hugging Face tokenizer directory.
The client itself (``run_benchmark``, ``compute_metrics``, ``format_table``) is
``testkit.loadgen``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from cascade.eval.sharegpt import SampledRequest, Tokenizer, load_conversations, sample_requests
from testkit.loadgen import (
    DEFAULT_TOKENIZER,
    ENDPOINTS,
    LoadConfig,
    _jsonable,
    format_table,
    run_benchmark,
)


class GGUFVocab:
    """A GGUF model's tokenizer, loaded without its weights."""

    def __init__(self, path: Path):
        from llama_cpp import Llama

        self._llm = Llama(model_path=str(path), vocab_only=True, verbose=False)

    def encode(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


def load_tokenizer(spec: str) -> Tokenizer:
    """A Hugging Face tokenizer directory, a .gguf file, or a catalogue model name."""
    path = Path(spec).expanduser()
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    if path.is_file():
        return GGUFVocab(path)
    from cascade.config import cascade_home
    from model_distribution.artifacts.catalog import Catalog

    catalog = Catalog(cascade_home())
    return GGUFVocab(catalog.ensure_ready(catalog.get(spec)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True,
                   help="e.g. http://127.0.0.1:8081 (with or without /v1)")
    p.add_argument("--model", required=True)
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, or inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap on each request's max_tokens (default: the ShareGPT reply length)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="catalogue model name, .gguf file, or HF tokenizer directory")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout (s)")
    p.add_argument("--save-json", type=Path, default=None)
    return p.parse_args(argv)


async def _probe(base_url: str, model: str, req: SampledRequest, load: LoadConfig) -> None:
    """Fail fast on a wrong URL or model: one short request before the measured run."""
    result = await run_benchmark(base_url, model, [replace(req, output_len=min(req.output_len, 4))],
                                 replace(load, request_rate=math.inf))
    if result.metrics.failed:
        raise SystemExit(f"probe request failed: {result.outcomes[0].error}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    t = time.perf_counter()
    conversations = load_conversations()
    tokenizer = load_tokenizer(args.tokenizer)
    requests = sample_requests(args.num_prompts, args.seed, tokenizer, args.max_prompt_tokens,
                               args.max_output_tokens, conversations=conversations)
    print(f"sampled {len(requests)} ShareGPT requests from {len(conversations)} conversations "
          f"in {time.perf_counter() - t:.1f}s")
    if not requests:
        raise SystemExit("no request fits the length limits")
    load = LoadConfig(args.endpoint, args.request_rate, args.max_concurrency, args.ignore_eos,
                      args.seed, args.api_key, args.timeout)
    asyncio.run(_probe(args.base_url, args.model, requests[0], load))
    result = asyncio.run(run_benchmark(args.base_url, args.model, requests, load))
    print(format_table(result))
    if args.save_json:
        cli = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        del cli["api_key"]
        data = {**result.to_json(), "args": _jsonable(cli)}
        args.save_json.write_text(json.dumps(data, indent=2, allow_nan=False))
        print(f"saved {args.save_json}")


if __name__ == "__main__":
    main()
