"""Gateway result cache: keys on the prompt's token ids and the sampling settings for
deterministic requests, TTL and LRU bounds."""

import pytest

from cloud_tier.gateway.pipeline.result_cache import ResultCache, cache_key
from cloud_tier.request_builder import RequestPlan
from cloud_tier.sampling import SamplingParams

CHAT = "chat"
BASE = RequestPlan([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0), None)


def plan(tokens=(1, 2, 3), **params) -> RequestPlan:
    return RequestPlan(list(tokens), SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **params}), None)


def key(p, tenant="t", model="m", endpoint=CHAT):
    return cache_key(tenant, model, endpoint, p)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# --- cache_key --------------------------------------------------------------------------------

def test_the_same_prompt_tokens_and_settings_share_a_key():
    assert key(plan()) == key(BASE) is not None and len(key(BASE)) == 64
    assert key(plan(temperature=0)) == key(BASE)  # 0 and 0.0 ask for the same thing


@pytest.mark.parametrize("other", [
    pytest.param({"tenant": "u"}, id="tenant"),
    pytest.param({"model": "m2"}, id="model"),
    pytest.param({"endpoint": "completions"}, id="endpoint"),
    # "...The sky is\n\n" and "...The sky is": the same text but for whitespace, other tokens
    pytest.param({"p": plan(tokens=(1, 2, 3, 198, 198))}, id="prompt-tokens"),
    pytest.param({"p": plan(tokens=(3, 2, 1))}, id="prompt-token-order"),
    pytest.param({"p": plan(max_tokens=5)}, id="max_tokens"),
    pytest.param({"p": plan(top_p=0.5)}, id="top_p"),
    pytest.param({"p": plan(top_k=5)}, id="top_k"),
    pytest.param({"p": plan(min_p=0.1)}, id="min_p"),
    pytest.param({"p": plan(seed=1)}, id="seed"),
    pytest.param({"p": plan(stop=("x",))}, id="stop"),
    pytest.param({"p": plan(stop_token_ids=(7,))}, id="stop_token_ids"),
    pytest.param({"p": plan(ignore_eos=True)}, id="ignore_eos"),
    pytest.param({"p": plan(logprobs=2)}, id="logprobs"),
    pytest.param({"p": plan(logprobs=0)}, id="logprobs-0-is-not-none"),
    pytest.param({"p": plan(repetition_penalty=1.1)}, id="repetition_penalty"),
    pytest.param({"p": plan(presence_penalty=0.5)}, id="presence_penalty"),
    pytest.param({"p": plan(frequency_penalty=0.5)}, id="frequency_penalty"),
])
def test_a_difference_the_model_sees_changes_the_key(other):
    args = {"tenant": "t", "model": "m", "endpoint": CHAT, "p": BASE, **other}
    assert key(args["p"], args["tenant"], args["model"], args["endpoint"]) != key(BASE)


@pytest.mark.parametrize("p", [
    pytest.param(plan(temperature=1.0), id="temperature-1"),
    pytest.param(plan(temperature=0.7), id="positive-temperature"),
])
def test_non_deterministic_requests_have_no_key(p):
    assert key(p) is None


def test_seeded_sampling_is_cacheable():
    seeded = plan(temperature=0.8, seed=3)
    assert key(seeded) is not None and key(seeded) != key(plan(temperature=0.8, seed=4))


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
