"""Gateway result cache: canonical keys for deterministic requests, TTL and LRU bounds."""

import pytest

from cloud_tier.gateway.result_cache import ResultCache, cache_key

CHAT = "/v1/chat/completions"
BASE = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def chat(**overrides):
    return {**BASE, **overrides}


def key(body, tenant="t", model="m", endpoint=CHAT):
    return cache_key(tenant, model, endpoint, body)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# --- cache_key --------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [
    pytest.param(chat(messages=[{"role": "user", "content": "  hi \n"}]), id="whitespace"),
    pytest.param(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "h"},
                                                             {"type": "text", "text": "i"}]}]),
                 id="text-parts-joined"),
    pytest.param(chat(temperature=0.0), id="int-or-float-temperature"),
    pytest.param(chat(stream=True, stream_options={"include_usage": True}), id="stream-ignored"),
    pytest.param(chat(user="alice"), id="user-ignored"),
    pytest.param(chat(cascade={"mode": "cloud"}), id="cascade-field-ignored"),
    pytest.param(chat(model="alias"), id="body-model-ignored-for-resolved-model"),
    pytest.param(chat(top_p=None), id="null-is-absent"),
    pytest.param(chat(stop=[]), id="empty-stop-is-absent"),
])
def test_equivalent_requests_share_a_key(variant):
    assert key(variant) == key(BASE) is not None


def test_stop_order_and_single_string_are_normalized():
    assert key(chat(stop=["b", "a"])) == key(chat(stop=["a", "b"]))
    assert key(chat(stop="a")) == key(chat(stop=["a"]))


@pytest.mark.parametrize("other", [
    pytest.param({"tenant": "u"}, id="tenant"),
    pytest.param({"model": "m2"}, id="model"),
    pytest.param({"endpoint": "/v1/completions"}, id="endpoint"),
    pytest.param({"body": chat(max_tokens=5)}, id="max_tokens"),
    pytest.param({"body": chat(max_completion_tokens=5)}, id="max_completion_tokens"),
    pytest.param({"body": chat(top_p=0.5)}, id="top_p"),
    pytest.param({"body": chat(top_k=5)}, id="top_k"),
    pytest.param({"body": chat(seed=1)}, id="seed"),
    pytest.param({"body": chat(stop=["x"])}, id="stop"),
    pytest.param({"body": chat(logprobs=True, top_logprobs=2)}, id="logprobs"),
    pytest.param({"body": chat(repetition_penalty=1.1)}, id="repetition_penalty"),
    pytest.param({"body": chat(response_format={"type": "json_object"})}, id="unknown-field"),
    pytest.param({"body": chat(messages=[{"role": "system", "content": "hi"}])}, id="role"),
    pytest.param({"body": chat(messages=[{"role": "user", "content": "hi", "name": "bob"}])},
                 id="message-name"),
    pytest.param({"body": chat(messages=[{"role": "user", "content": "hi!"}])}, id="content"),
])
def test_a_difference_that_changes_the_output_changes_the_key(other):
    args = {"tenant": "t", "model": "m", "endpoint": CHAT, "body": BASE, **other}
    assert key(args["body"], args["tenant"], args["model"], args["endpoint"]) != key(BASE)


@pytest.mark.parametrize("body", [
    pytest.param({"model": "m", "messages": BASE["messages"]}, id="temperature-absent-means-1"),
    pytest.param(chat(temperature=0.7), id="positive-temperature"),
    pytest.param(chat(temperature=False), id="bool-is-not-zero"),
    pytest.param(chat(temperature=1, seed="7"), id="seed-must-be-int"),
    pytest.param(chat(temperature=1, seed=True), id="seed-bool-is-not-int"),
    pytest.param(chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]), id="non-text-part"),
    pytest.param(chat(temperature=None), id="null-temperature"),
])
def test_non_deterministic_or_uncanonical_requests_have_no_key(body):
    assert key(body) is None


def test_seeded_sampling_is_cacheable_and_completions_prompt_is_keyed():
    body = {"model": "m", "prompt": "Once upon", "temperature": 0.8, "seed": 3}
    k = cache_key("t", "m", "/v1/completions", body)
    assert k is not None and len(k) == 64
    assert cache_key("t", "m", "/v1/completions", {**body, "prompt": "Once"}) != k


# --- ResultCache ------------------------------------------------------------------------------

def test_entry_expires_after_ttl_and_is_removed():
    clock = FakeClock()
    cache = ResultCache(ttl_s=10, clock=clock)
    cache.put("a", "A", 1)
    clock.now = 9.9
    assert cache.get("a") == "A"
    clock.now = 10.0
    assert cache.get("a") is None
    assert len(cache) == 0 and cache.total_bytes == 0
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 0)


@pytest.mark.parametrize("max_entries,max_bytes,puts,touch,expected", [
    pytest.param(2, 100, [("a", 1), ("b", 1), ("c", 1)], None, ["b", "c"], id="count-bound"),
    pytest.param(2, 100, [("a", 1), ("b", 1), ("c", 1)], "a", ["a", "c"], id="get-refreshes"),
    pytest.param(10, 10, [("a", 4), ("b", 4), ("c", 4)], None, ["b", "c"], id="byte-bound"),
    pytest.param(10, 10, [("a", 2), ("b", 2), ("c", 9)], None, ["c"], id="big-entry-evicts-many"),
    pytest.param(10, 10, [("a", 2), ("b", 11)], None, ["a"], id="oversize-not-stored"),
    pytest.param(10, 10, [("a", 2), ("a", 11)], None, [], id="oversize-replacement-drops-old"),
    pytest.param(10, 10, [("a", 6), ("a", 7)], None, ["a"], id="replacement-frees-old-bytes"),
])
def test_lru_eviction(max_entries, max_bytes, puts, touch, expected):
    cache = ResultCache(max_entries, max_bytes, clock=FakeClock())
    for i, (k, size) in enumerate(puts):
        if touch is not None and i == len(puts) - 1:
            assert cache.get(touch) is not None
        cache.put(k, k.upper(), size)
    present = [k for k in "abc" if cache.get(k) is not None]
    assert present == expected
    assert len(cache) == len(expected)
    assert cache.total_bytes <= max_bytes


def test_stats_count_hits_misses_and_evictions():
    cache = ResultCache(max_entries=1, clock=FakeClock())
    cache.put("a", 1, 1)
    cache.put("b", 2, 1)
    assert cache.get("a") is None and cache.get("b") == 2
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)


@pytest.mark.parametrize("kwargs", [{"max_entries": 0}, {"max_bytes": 0}, {"ttl_s": 0}])
def test_result_cache_rejects_non_positive_bounds(kwargs):
    with pytest.raises(ValueError):
        ResultCache(**kwargs)
