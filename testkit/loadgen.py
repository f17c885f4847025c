"""A load generator for any OpenAI-compatible server, in the spirit of ``vllm bench serve``:
timed arrivals, streamed responses, TTFT / TPOT / ITL / E2E percentiles and throughput. The
command line is ``bench/serve_bench.py``; the serving benchmarks and their tests use this module."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import httpx
import numpy as np

from cascade.eval.sharegpt import SampledRequest

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DEFAULT_TOKENIZER = "smollm2-135m"


# ---- per-request records and the metrics computed from them -----------------------------------

@dataclass
class RequestOutcome:
    """What one request did. Times are seconds; ``start_s`` is relative to the benchmark start."""

    prompt_len: int
    output_len: int  # the max_tokens asked for
    success: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: float | None = None  # None when no content arrived
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, chat template included

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds; NaN when there were no samples."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        ms = np.asarray(seconds, dtype=float) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])  # linear interpolation, as vLLM
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), len(ms))


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # successful requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # prompt + output tokens per second
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats  # over every gap of every successful request, as vLLM
    e2e: LatencyStats


def compute_metrics(outcomes: Sequence[RequestOutcome], duration_s: float) -> BenchMetrics:
    """Throughput and latency statistics over the successful requests of one run."""
    ok = [o for o in outcomes if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return BenchMetrics(
        completed=len(ok),
        failed=len(outcomes) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        ttft=LatencyStats.of([o.ttft_s for o in ok if o.ttft_s is not None]),
        tpot=LatencyStats.of([t for o in ok if (t := o.tpot_s) is not None]),
        itl=LatencyStats.of([gap for o in ok for gap in o.itl_s]),
        e2e=LatencyStats.of([o.e2e_s for o in ok]),
    )


# ---- the load generator -----------------------------------------------------------------------

@dataclass(frozen=True)
class LoadConfig:
    """How requests are sent. ``request_rate`` is requests/s (inf: all at once)."""

    endpoint: str = "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, not {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")


@dataclass
class BenchResult:
    base_url: str
    model: str
    load: LoadConfig
    metrics: BenchMetrics
    outcomes: list[RequestOutcome]
    started_at: str  # ISO 8601, UTC

    def to_json(self) -> dict:
        """Everything but the API key, per-request data included, as plain JSON values."""
        data = asdict(self)
        data["load"].pop("api_key")
        for d, o in zip(data["outcomes"], self.outcomes, strict=True):
            d["tpot_s"] = o.tpot_s
        return _jsonable(data)


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at ``request_rate``; all 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


def request_body(model: str, req: SampledRequest, load: LoadConfig) -> dict:
    """The JSON body of one streamed request."""
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if load.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if load.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension; other servers ignore unknown fields
    return body


def endpoint_url(base_url: str, endpoint: str) -> str:
    """``base_url`` may or may not end in /v1."""
    base = base_url.rstrip("/").removesuffix("/v1")
    return base + ENDPOINTS[endpoint]


async def send_one(client: httpx.AsyncClient, url: str, body: dict, outcome: RequestOutcome) -> None:
    """Send one streamed request and fill ``outcome`` in; failures are recorded, not raised."""
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                outcome.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"SSE data is not a JSON object: {data[:200]}")
                if "error" in chunk:
                    outcome.error = f"stream error: {_error_message(data.encode())}"
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    outcome.server_prompt_tokens = chunk["usage"].get("prompt_tokens")
                if _content(chunk):
                    now = time.perf_counter()
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - start
                    else:
                        outcome.itl_s.append(now - last)
                    last = now
                    chunks += 1
        outcome.e2e_s = time.perf_counter() - start
        outcome.output_tokens = usage_tokens if usage_tokens is not None else chunks
        outcome.success = True
    except (httpx.HTTPError, ValueError) as e:  # transport errors, malformed SSE JSON
        outcome.error = f"{type(e).__name__}: {e}"


def _content(chunk: dict) -> str:
    """The generated text of a chat or completions chunk ('' for role-only and usage chunks)."""
    choices = chunk.get("choices") or [{}]
    choice = choices[0]
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""


def _error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:500]
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err) if err else text[:500]


async def run_benchmark(base_url: str, model: str, requests: Sequence[SampledRequest],
                        load: LoadConfig | None = None) -> BenchResult:
    """Send ``requests`` to ``base_url`` as ``load`` says and measure every one of them."""
    load = load or LoadConfig()
    url = endpoint_url(base_url, load.endpoint)
    in_flight = load.max_concurrency or max(len(requests), 1)
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    timeout = httpx.Timeout(load.timeout_s, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    gate = asyncio.Semaphore(in_flight)
    outcomes = [RequestOutcome(r.prompt_len, r.output_len) for r in requests]
    started_at = datetime.now(UTC).isoformat(timespec="seconds")

    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()

        async def limited(req: SampledRequest, outcome: RequestOutcome) -> None:
            async with gate:
                outcome.start_s = time.perf_counter() - t0
                await send_one(client, url, request_body(model, req, load), outcome)

        tasks = []
        for at, req, outcome in zip(arrival_times(len(requests), load.request_rate, load.seed),
                                    requests, outcomes, strict=True):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(limited(req, outcome)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return BenchResult(base_url, model, load, compute_metrics(outcomes, duration), outcomes,
                       started_at)


# ---- reporting --------------------------------------------------------------------------------

def format_table(result: BenchResult) -> str:
    """The result as a fixed-width text table."""
    m = result.metrics
    rate = "inf" if math.isinf(result.load.request_rate) else f"{result.load.request_rate:g}"
    rows = [
        ("Request rate (req/s)", rate),
        ("Max concurrency", str(result.load.max_concurrency or "unbounded")),
        ("Successful requests", str(m.completed)),
        ("Failed requests", str(m.failed)),
        ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", str(m.total_input_tokens)),
        ("Total generated tokens", str(m.total_output_tokens)),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "="),
             f"{result.model} @ {endpoint_url(result.base_url, result.load.endpoint)}"]
    lines += [f"{k + ':':<36}{v:>14}" for k, v in rows]
    lines.append(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, s in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2E", m.e2e)):
        lines.append(f"{name:<10}{s.mean:>10.2f}{s.p50:>10.2f}{s.p90:>10.2f}{s.p99:>10.2f}")
    lines.append("=" * width)
    errors = sorted({o.error for o in result.outcomes if not o.success})
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)


def _jsonable(value):
    """NaN becomes null and infinity the string "inf": JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


# ---- tokenizers and the command line ----------------------------------------------------------
