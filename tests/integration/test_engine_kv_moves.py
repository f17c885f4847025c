"""KV that moves out of the cache and back on the real SmolLM2: preemption by swap or by
recompute, and the prefix cache's second tier. Each gives the greedy tokens of a run without it."""

import pytest

from cloud_tier.engine import LLMEngine, SamplingParams
from tests.integration.test_engine import run_to_end

SYSTEMS = [f"Policy book {n}: parcels for region {n} leave the depot at {n + 6} and carriers sign the "
           f"manifest of route {n * 3} before the customs check. " for n in range(5)]


@pytest.fixture(scope="module")
def fruit_reference(smollm2_engine):
    prompts = [f"Write a list of {n} fruits:" for n in range(3, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return prompts, params, [o.token_ids for o in run_to_end(smollm2_engine, prompts, params)]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_by_swap_or_recompute_gives_the_outputs_of_a_run_without_preemption(
        mode, fruit_reference, engine_home):
    prompts, params, reference = fruit_reference
    small = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=224, num_kv_blocks=14,
                                 block_size=16, max_num_batched_tokens=128, preemption_mode=mode, threads=1)
    outs = run_to_end(small, prompts, params)
    assert [o.token_ids for o in outs] == reference
    st = small.stats()
    assert st["preemptions"] > 0 and st["preemptions"] == st["preemptions_by_swap"] + st["preemptions_by_recompute"]
    if mode == "swap":
        assert st["preemptions_by_recompute"] == 0
    if mode == "recompute":
        assert st["preemptions_by_swap"] == 0 and st["preemptions_swapped_out_bytes"] == 0
    assert st["preemptions_swapped_in_bytes"] == st["preemptions_swapped_out_bytes"]
    assert not small.scheduler.swap.reserved and not small.scheduler.swap.payloads
    assert small.kv.num_free_blocks == 14


def test_a_swap_space_too_small_falls_back_to_recompute(fruit_reference, engine_home):
    prompts, params, reference = fruit_reference
    small = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=224, num_kv_blocks=14,
                                 block_size=16, max_num_batched_tokens=128, preemption_mode="swap",
                                 swap_space_bytes=1, threads=1)
    assert [o.token_ids for o in run_to_end(small, prompts, params)] == reference
    st = small.stats()
    assert st["preemptions_by_recompute"] > 0 and st["preemptions_by_swap"] == 0


def tier_prompts(tokenizer):
    """Five 96-token system prompts then the first again with a new question: in a cache of 16
    blocks the first one's blocks are evicted by the time it comes back."""
    prefixes = [tokenizer.encode(s * 4)[:96] for s in SYSTEMS]
    question = tokenizer.encode(" Question: where is parcel 17?", add_special_tokens=False)
    again = tokenizer.encode(" Question: when does the depot open?", add_special_tokens=False)
    return [p + question for p in prefixes] + [prefixes[0] + again, prefixes[1] + again]


def test_the_second_tier_serves_evicted_prefixes_with_the_outputs_of_no_cache(smollm2_engine, engine_home):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = tier_prompts(smollm2_engine.tokenizer)
    common = dict(dtype="float32", max_model_len=256, num_kv_blocks=16, block_size=16, threads=1)
    per_block = smollm2_engine.scheduler.swap.bytes_per_block  # the same layout: 16-token float32 blocks
    tiered = LLMEngine.from_model("smollm2-135m", kv_tier_bytes=64 * per_block, **common)
    untiered = LLMEngine.from_model("smollm2-135m", **common)
    outs = {name: [run_to_end(e, [p], params)[0] for p in prompts] for name, e in
            (("tier", tiered), ("no tier", untiered))}
    no_cache = LLMEngine.from_model("smollm2-135m", enable_prefix_caching=False, **common)
    outs["no cache"] = [run_to_end(no_cache, [p], params)[0] for p in prompts]
    tokens = {name: [o.token_ids for o in v] for name, v in outs.items()}
    assert tokens["tier"] == tokens["no tier"] == tokens["no cache"]
    st = tiered.stats()
    assert st["kv_tier_hits"] >= 2 * 6  # the last two prompts: 6 full blocks of prefix each
    assert st["kv_tier_loaded_bytes"] > 0 and st["kv_tier_saved_bytes"] > 0
    assert outs["tier"][-1].num_cached_tokens >= 96 and outs["no tier"][-1].num_cached_tokens == 0
    assert "kv_tier_hits" not in untiered.stats()
