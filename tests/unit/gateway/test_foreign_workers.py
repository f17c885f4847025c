"""The pure parts of fronting foreign workers: reading their /metrics, the circuit breaker, the
64-character prefix hashes, routing and shedding on their load, and the shapes of stored answers."""

from __future__ import annotations

import math

import pytest
import xxhash

from cascade import errors
from cascade.policy.backpressure import CircuitBreaker
from cloud_tier.gateway.foreign.answers import cache_key, chunks_to_response, prompt_text, response_to_chunks
from cloud_tier.gateway.foreign.routing import ForeignRouting, choose, pressure, pressure_limit
from cloud_tier.gateway.workers.metrics_scrape import ForeignLoad, detect_kind, parse_load
from cloud_tier.gateway.workers.placement import PrefixIndex, text_block_hashes
from cloud_tier.gateway.workers.pool import Worker

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2-135m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"} 0.75
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="40"} 1.0
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 20000.0
"""


def test_the_worker_kind_is_read_from_its_metric_names():
    assert detect_kind(VLLM) == "vllm"
    assert detect_kind(SGLANG) == "sglang"
    assert detect_kind("# TYPE python_gc_objects_collected_total counter\n") == "openai"


def test_vllm_and_sglang_load_is_read_from_their_metrics():
    v = parse_load("vllm", VLLM)
    assert (v.waiting, v.running, v.kv_usage, v.kv_tokens, v.block_size) == (5, 2, 0.75, 40 * 128, 128)
    s = parse_load("sglang", SGLANG)
    assert (s.waiting, s.running, s.kv_usage, s.kv_tokens) == (1, 3, 0.5, 20000)
    assert parse_load("openai", VLLM) == ForeignLoad()
    with pytest.raises(ValueError):
        parse_load("vllm", "vllm:num_requests_waiting{ 1 2 3")


def test_the_workers_breaker_opens_after_failures_in_a_row_and_a_probe_closes_it():
    now = [0.0]
    b = CircuitBreaker(threshold=2, base_backoff_s=5, max_backoff_s=20, clock=lambda: now[0])
    b.failure("x")
    b.success()
    b.failure("x")
    assert b.available  # not in a row
    b.failure("x")
    assert b.state == "open" and not b.available
    now[0] = 5.0
    assert b.state == "half_open" and b.allow()
    assert not b.available  # one probe at a time
    b.failure("x")  # the probe failed: open for twice as long
    now[0] = 14.0
    assert b.state == "open"
    now[0] = 15.0
    assert b.allow()
    b.abandon()  # the probe's client left: the next request probes
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.available


def test_text_block_hashes_are_gies_chain_seeded_by_the_model():
    text = "x" * 64 + "y" * 64 + "z" * 10
    hashes = text_block_hashes("m", text)
    assert len(hashes) == 2  # the trailing partial block is not hashed
    h0 = xxhash.xxh64_intdigest(b"x" * 64 + xxhash.xxh64_intdigest(b"m").to_bytes(8, "little"))
    assert hashes[0] == h0
    assert hashes[1] == xxhash.xxh64_intdigest(b"y" * 64 + h0.to_bytes(8, "little"))
    assert text_block_hashes("other", text)[0] != h0  # another model never shares a prefix
    assert text_block_hashes("m", "x" * 63) == []
    assert len(text_block_hashes("m", "a" * 64 * 300)) == 256


def _worker(url, waiting=0.0, running=0.0, kv=0.0, blocks=1000) -> Worker:
    w = Worker(url, role="both", kind="vllm", healthy=True, breaker=CircuitBreaker())
    w.foreign = ForeignLoad(waiting, running, kv, blocks * 16, 16)
    w.scraped_at = math.inf  # never stale in these tests
    return w


def test_pressure_counts_what_the_gateway_sent_since_the_scrape_and_stale_is_saturated():
    cfg = ForeignRouting(max_waiting=4, kv_high_watermark=0.8)
    w = _worker("a", waiting=2, kv=0.4)
    assert pressure(w, cfg, 0.0) == pytest.approx(0.5)
    w.sent_since_scrape = 2
    assert pressure(w, cfg, 0.0) == pytest.approx(1.0)
    w.scraped_at = 0.0
    assert pressure(w, cfg, 100.0) == math.inf


def test_lower_standing_requests_are_shed_first():
    cfg = ForeignRouting(max_waiting=10)
    assert pressure_limit(0, cfg) == 1.0 and pressure_limit(-3, cfg) == 1.0
    assert pressure_limit(3, cfg) == pytest.approx(0.7) and pressure_limit(50, cfg) == 0.5
    idx = PrefixIndex(1)
    busy = [_worker("a", waiting=8), _worker("b", waiting=8)]
    with pytest.raises(errors.APIError) as e:
        choose(busy, idx, [], priority=5, cfg=cfg, need_blocks=1)
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    ticket, _ = choose(busy, idx, [], priority=0, cfg=cfg, need_blocks=1)  # the first class still gets in
    assert ticket.worker.url in ("a", "b")
    full = [_worker("a", waiting=10), _worker("b", kv=0.95)]
    with pytest.raises(errors.APIError) as e:
        choose(full, idx, [], priority=0, cfg=cfg, need_blocks=1)
    assert e.value.status == 429 and e.value.code == "pool_saturated"


def test_prefix_affinity_wins_unless_the_holder_is_overloaded():
    cfg = ForeignRouting(max_waiting=100, affinity_queue_gap=4)
    idx = PrefixIndex(1)
    hashes = text_block_hashes("m", "p" * 64 * 8)
    a, b = _worker("a", running=1), _worker("b")
    idx.insert_hashes("a", hashes)
    assert choose([a, b], idx, hashes, 0, cfg, 1)[0].worker.url == "a"  # held there, lightly loaded
    a.foreign = ForeignLoad(0, 10, 0.0, 16000, 16)  # now far busier than b
    assert choose([a, b], idx, hashes, 0, cfg, 1)[0].worker.url == "b"
    assert idx.match_hashes(hashes) == {"a": 8, "b": 8}  # b holds it now too


def test_the_prefix_index_is_bounded_per_worker():
    idx = PrefixIndex(1, max_blocks_per_worker=100)
    idx.set_capacity("a", 3)
    idx.insert_hashes("a", [1, 2, 3, 4, 5])
    assert idx.num_blocks("a") == 3 and idx.match_hashes([1, 2, 3]) == {"a": 3}  # the prefix outlives its leaves


def test_a_stream_and_a_body_convert_into_each_other():
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]},
              {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
              {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
    body = chunks_to_response(chunks, "chat")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["total_tokens"] == 5
    again = chunks_to_response(response_to_chunks(body, "chat"), "chat")
    assert again["choices"] == body["choices"] and again["usage"] == body["usage"]
    text = {"id": "t", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}]}
    assert chunks_to_response(response_to_chunks(text, "completions"), "completions")["choices"] == text["choices"]


def test_only_deterministic_requests_have_a_cache_key_and_delivery_is_not_in_it():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert cache_key("t", "chat", {**base, "temperature": 0.7}) is None
    k = cache_key("t", "chat", {**base, "temperature": 0})
    assert k == cache_key("t", "chat", {**base, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}})
    assert k != cache_key("other", "chat", {**base, "temperature": 0})
    assert cache_key("t", "chat", {**base, "seed": 7}) is not None
    assert prompt_text("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}) == \
        "user\na\n"
