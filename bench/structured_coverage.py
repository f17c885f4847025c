"""Structured outputs, coverage: every schema of the corpus (bench/schemas) sent once to each tier with
``response_format`` json_schema (strict), greedy; per tier, whether the server compiled it (200, or a 400
naming the keyword it does not enforce) and whether the answer validates (jsonschema, formats checked).

    .venv/bin/python bench/structured_coverage.py [--model smollm2-135m] [--limit N] [--tiers edge,cloud]
        [--edge-model qwen2.5-coder-0.5b] [--cloud-model qwen2.5-coder-1.5b] [--max-tokens 256]

Each tier is started alone (2-core machines: the other one's threads would share its cores), through
bench/tiers.py: the edge agent without an upstream (it answers locally, llama.cpp), then the cloud
(`cascade cloud serve`, one co-located worker of our engine). It talks HTTP only, with the openai client.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
from structured_schemas import load_corpus  # noqa: I001 (siblings: sys.path[0] is bench/)
from tiers import bench_env, cloud_key, start_cloud, start_edge

from cascade.processes import stop, wait_healthy

EDGE_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
CLOUD_MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b")
TIERS = ("edge", "cloud")


@dataclass(frozen=True)
class Tier:
    """A running tier: its name, base URL, API key and the model it serves."""
    name: str
    url: str
    key: str
    model: str

    def client(self, asynchronous: bool = False, timeout_s: float = 600) -> openai.OpenAI | openai.AsyncOpenAI:
        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=f"{self.url}/v1", api_key=self.key or "none", timeout=timeout_s, max_retries=0)


@dataclass
class Outcome:
    """One schema's request to one tier."""
    schema: str
    tier: str
    expect: str
    compiled: bool
    valid: bool | None = None  # None: nothing generated (refused)
    finish: str = ""
    tokens: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def as_expected(self) -> bool:
        """Compiled iff marked enforced; a refusal of an unsupported schema names its keyword."""
        if self.expect == "enforced":
            return self.compiled
        return not self.compiled and self.expect.removeprefix("unsupported:") in self.error


def response_format(entry: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}


def prompt(entry: dict) -> list[dict]:
    text = f"Fill in this form as JSON: {entry['title']} ({entry['source']}). Answer with the JSON object only."
    return [{"role": "user", "content": text}]


def is_valid(schema: dict, text: str) -> bool:
    """Whether ``text`` is one JSON document valid against ``schema``, formats included."""
    try:
        instance = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return False
    validator = jsonschema.validators.validator_for(schema)
    return validator(schema, format_checker=validator.FORMAT_CHECKER).is_valid(instance)


def refusal(err: openai.APIStatusError) -> str:
    """The error's code, parameter and message in one line (the keyword is looked for in it)."""
    body = err.body if isinstance(err.body, dict) else {}
    if isinstance(body.get("error"), dict):
        body = body["error"]
    return f"{err.status_code} {body.get('code', '')} {body.get('param', '')}: {body.get('message', err.message)}"


def ask(tier: Tier, client: openai.OpenAI, entry: dict, max_tokens: int) -> Outcome:
    out = Outcome(entry["name"], tier.name, entry["expect"], compiled=False)
    start = time.perf_counter()
    try:
        resp = client.chat.completions.create(model=tier.model, messages=prompt(entry), temperature=0,
                                              max_tokens=max_tokens, response_format=response_format(entry))
    except openai.BadRequestError as err:
        out.seconds, out.error = time.perf_counter() - start, refusal(err)
        return out
    out.seconds = time.perf_counter() - start
    choice = resp.choices[0]
    out.compiled, out.finish = True, choice.finish_reason or ""
    out.tokens = resp.usage.completion_tokens if resp.usage else 0
    out.valid = is_valid(entry["schema"], choice.message.content)
    return out


@contextmanager
def running_tier(name: str, model: str, args, work: Path, parallel: int = 1) -> Iterator[Tier]:
    """One tier started through bench/tiers.py, healthy, stopped on the way out. The edge answers
    locally (no upstream), ``parallel`` requests at once; the cloud runs one co-located worker."""
    env = bench_env(work)
    if name == "edge":
        proc, url = start_edge({**env, "CASCADE_EDGE_UPSTREAM_URL": ""}, model, "--parallel", str(parallel))
        key, timeout_s = "", 900
    else:
        key = cloud_key(env, work)
        env["CASCADE_CLOUD_GATEWAY_RESULT_CACHE_TTL_S"] = "0.001"  # a repeated greedy request is generated again
        proc, url = start_cloud(env, model, args.weight_dtype, "--both", "1", "--prefill", "0", "--decode", "0")
        timeout_s = 1800
    try:
        wait_healthy(url, proc, timeout_s, f"{name} tier")
        yield Tier(name, url, key, model)
    finally:
        stop(proc)


def tier_models(args) -> dict[str, str]:
    return {"edge": args.edge_model or args.model, "cloud": args.cloud_model or args.model}


def add_tier_args(p: argparse.ArgumentParser) -> None:
    """The flags both structured-output benches share: models, tiers, the cloud's weights."""
    p.add_argument("--model", default="smollm2-135m", help="both tiers' model (default: smollm2-135m)")
    p.add_argument("--edge-model", choices=EDGE_MODELS, help="the edge's model instead of --model")
    p.add_argument("--cloud-model", choices=CLOUD_MODELS, help="the cloud's model instead of --model")
    p.add_argument("--tiers", default="edge,cloud", help="comma-separated: edge, cloud")
    p.add_argument("--weight-dtype", default="auto", help="the cloud engine's weights")


def print_table(outcomes: list[Outcome]) -> None:
    print(f"\n{'schema':<24} {'tier':<5} {'expect':<28} {'compiled':>8} {'valid':>5} {'finish':>7} "
          f"{'tokens':>6} {'s':>6}  refusal")
    for o in outcomes:
        valid = "-" if o.valid is None else ("yes" if o.valid else "NO")
        print(f"{o.schema:<24} {o.tier:<5} {o.expect:<28} {'yes' if o.compiled else 'no':>8} {valid:>5} "
              f"{o.finish:>7} {o.tokens:>6} {o.seconds:>6.2f}  {o.error[:70]}")


def print_totals(outcomes: list[Outcome], models: dict[str, str]) -> None:
    print(f"\n{'tier':<5} {'model':<20} {'schemas':>7} {'compiled':>8} {'refused':>7} {'as marked':>9} "
          f"{'valid':>12} {'length-cut':>10} {'tokens':>7} {'s':>7}")
    for tier in TIERS:
        rows = [o for o in outcomes if o.tier == tier]
        if not rows:
            continue
        compiled = [o for o in rows if o.compiled]
        valid = sum(1 for o in compiled if o.valid)
        print(f"{tier:<5} {models[tier]:<20} {len(rows):>7} {len(compiled):>8} {len(rows) - len(compiled):>7} "
              f"{sum(o.as_expected for o in rows):>9} {f'{valid}/{len(compiled)}':>12} "
              f"{sum(o.finish == 'length' for o in compiled):>10} {sum(o.tokens for o in compiled):>7} "
              f"{sum(o.seconds for o in rows):>7.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tier_args(p)
    p.add_argument("--limit", type=int, default=0, help="the first N schemas only (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    corpus = load_corpus()[:args.limit or None]
    models = tier_models(args)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="structured-coverage-") as work:
        for name in [t for t in args.tiers.split(",") if t]:
            with running_tier(name, models[name], args, Path(work)) as tier:
                client = tier.client()
                for entry in corpus:
                    outcomes.append(ask(tier, client, entry, args.max_tokens))
                    print(".", end="", flush=True)
    print(f"\n{len(corpus)} schemas of bench/schemas, greedy, max_tokens {args.max_tokens}, strict json_schema; "
          f"edge {models['edge']} (llama.cpp), cloud {models['cloud']} (our engine, weights {args.weight_dtype})")
    print_table(outcomes)
    print_totals(outcomes, models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
