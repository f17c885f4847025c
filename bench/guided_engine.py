"""Guided decoding's cost in our engine: decode tokens per second with every request held to a JSON
Schema (``SamplingParams.guided``) against the same requests unconstrained, at batch 1 and 8, the same
prompts, and the time the mask itself takes per step (filled by the matchers, applied to the logits).

The schema asks for at least 40 array items, so no constrained request ends inside the measured steps;
the unconstrained ones ignore EOS. Runs alternate (plain, guided, plain, guided, ...) and each figure is
the best of ``--repeats`` (a neighbour's load only ever slows a run down); the mask's share of a guided
step (its milliseconds over the step's) is the figure a noisy machine changes least. Goals (issue 41):
under 5% slower at batch 1, under 10% at batch 8.

    .venv/bin/python bench/guided_engine.py [--model qwen2.5-coder-1.5b] [--weight-dtype int8] [--steps 24]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads: its OpenMP threads read it once

SCHEMA = {"type": "object", "required": ["people"], "additionalProperties": False, "properties": {
    "people": {"type": "array", "minItems": 40, "items": {
        "type": "object", "required": ["name", "city", "age", "bio"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}, "bio": {"type": "string"}}}}}}
PROMPT = ("Request {i}: list forty people as JSON, an object with a 'people' array of objects with a name, "
          "a city, an age and a short bio.")


class MaskTimer:
    """Wraps the sampler's ``mask_rows`` to add up the seconds it takes (the fill and the apply)."""

    def __init__(self):
        from cloud_tier.engine import sampler

        self.module, self.inner, self.seconds, self.calls = sampler, sampler.mask_rows, 0.0, 0
        sampler.mask_rows = self

    def __call__(self, logits, requests):
        start = time.perf_counter()
        out = self.inner(logits, requests)
        if out[1].rows:
            self.seconds += time.perf_counter() - start
            self.calls += 1
        return out

    def take(self) -> float:
        """Mean seconds per guided step since the last take."""
        mean = self.seconds / self.calls if self.calls else 0.0
        self.seconds, self.calls = 0.0, 0
        return mean


def decode_run(engine, batch: int, steps: int, guided: str | None) -> tuple[float, int]:
    """(decode tokens per second over ``steps`` steps once every request decodes, requests still running)."""
    from cloud_tier.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=guided is None, guided=guided)
    for i in range(batch):
        engine.add_request(PROMPT.format(i=i), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # the prefills
    engine.step()
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    running = engine.scheduler.num_running
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    engine.kv.reset_prefix_cache()
    return tokens / elapsed, running


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--weight-dtype", default="int8")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="measured decode steps per run")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each kind per batch size (alternated)")
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()

    from llguidance import LLMatcher

    from cascade.structured.grammar import JSON_STYLE
    from cloud_tier.engine import LLMEngine

    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_STYLE)
    engine = LLMEngine.from_model(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype,
                                  threads=args.threads, max_model_len=1024, num_kv_blocks=1024)
    timer = MaskTimer()
    started = time.perf_counter()
    engine.guides.matcher(grammar)  # the tokenizer for llguidance and the compile, once, outside the runs
    setup_s = time.perf_counter() - started
    print(f"model {args.model} (weights {args.weight_dtype}, {engine.config.dtype}), vocab "
          f"{engine.model.config['vocab_size']}, {args.threads} threads; llguidance tokenizer + first compile "
          f"{setup_s:.2f} s; {args.steps} steps a run, best of {args.repeats}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'guided tok/s':>13} {'overhead':>9} {'mask ms/step':>13} "
          f"{'mask share':>11} {'goal':>6}")
    for batch in (int(b) for b in args.batches.split(",")):
        decode_run(engine, batch, 4, None)  # warm this batch shape
        plain, guided, mask = [], [], []
        for _ in range(args.repeats):
            plain.append(decode_run(engine, batch, args.steps, None)[0])
            rate, running = decode_run(engine, batch, args.steps, grammar)
            guided.append(rate)
            mask.append(timer.take())
            assert running == batch, f"a guided request ended inside the run ({running} of {batch} left)"
        p, g, m = max(plain), max(guided), statistics.median(mask)
        overhead = (p - g) / p * 100
        goal = 5 if batch == 1 else 10
        share = m / (batch / g) * 100  # the mask's time over a guided step's
        print(f"{batch:>5} {p:>12.2f} {g:>13.2f} {overhead:>8.1f}% {m * 1e3:>13.3f} {share:>10.1f}% "
              f"{'met' if overhead < goal else 'MISSED':>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
