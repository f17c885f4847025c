"""Engine behaviour on the real SmolLM2: prefix caching, preemption, sampling, stop strings,
the incremental API, the async wrapper."""

import asyncio
import random

import pytest
import torch

from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.async_engine import AsyncLLMEngine, RequestFailedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SYSTEM = ("You are a meticulous assistant for a logistics company. Answer questions about shipments, "
          "warehouses and delivery windows precisely, cite the relevant policy section, and never "
          "invent tracking numbers. ") * 8


def run_to_end(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return [done[i] for i in ids]


def shared_prefix_prompts(engine, n_prefix_tokens=256):
    prefix_ids = engine.tokenizer.encode(SYSTEM)[:n_prefix_tokens]
    assert len(prefix_ids) == n_prefix_tokens
    tail_a = engine.tokenizer.encode(" Where is parcel 17?", add_special_tokens=False)
    tail_b = engine.tokenizer.encode(" When does the Lyon warehouse open?", add_special_tokens=False)
    return prefix_ids + tail_a, prefix_ids + tail_b


def test_generate_api_with_text_and_token_ids(smollm2_engine):
    outs = smollm2_engine.generate(["Hello", "Tell me about Paris"], SamplingParams(temperature=0.0, max_tokens=8))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.text and o.finish_reason == "length" for o in outs)
    by_ids = smollm2_engine.generate([smollm2_engine.tokenizer.encode("Hello")],
                                     SamplingParams(temperature=0.0, max_tokens=8))
    assert by_ids[0].token_ids == outs[0].token_ids
    assert outs[0].text == smollm2_engine.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)


def test_second_request_with_shared_prefix_computes_only_new_blocks(smollm2_engine):
    engine = smollm2_engine
    engine.kv.reset_prefix_cache()
    a, b = shared_prefix_prompts(engine)
    run_to_end(engine, [a], GREEDY)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    try:
        (out_b,) = run_to_end(engine, [b], GREEDY)
    finally:
        engine.scheduler.schedule = schedule
    (first,) = plans[0].scheduled
    assert first.request.num_cached_tokens == 256 and out_b.num_cached_tokens == 256
    assert first.num_new_tokens == len(b) - 256  # only the blocks after the shared prefix


def test_outputs_are_identical_with_prefix_cache_on_and_off(smollm2_engine, engine_home):
    a, b = shared_prefix_prompts(smollm2_engine)
    prompts = [a, b, a]
    with_cache = run_to_end(smollm2_engine, prompts, GREEDY)
    assert with_cache[2].num_cached_tokens >= 256
    off = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=1024, num_kv_blocks=512,
                               enable_prefix_caching=False)
    without = run_to_end(off, prompts, GREEDY)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
    assert without[2].num_cached_tokens == 0


def test_preemption_under_a_small_kv_budget_gives_the_same_outputs(smollm2_engine, engine_home):
    prompts = [f"Write a list of {n} fruits:" for n in range(3, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=24)  # 8-9 prompt tokens: 2 blocks each, 8 blocks hold 4
    reference = run_to_end(smollm2_engine, prompts, params)
    small = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=128, num_kv_blocks=8,
                                 block_size=16, max_num_batched_tokens=128)
    outs = run_to_end(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert small.kv.num_free_blocks == 8


def test_seed_reproducible_and_batch_independent(smollm2_engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11, max_tokens=12)
    alone = smollm2_engine.generate(["Once upon a time"], p)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12)
    batched = smollm2_engine.generate(["Once upon a time", "Hello", "Once upon a time"], [p, other, p])
    assert batched[0].token_ids == alone and batched[2].token_ids == alone
    seeds = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in (1, 2, 3)]
    others = {tuple(o.token_ids) for o in smollm2_engine.generate(["Once upon a time"] * 3, seeds)}
    assert len(others) > 1


def test_stop_strings_and_stop_token_ids(smollm2_engine):
    full = smollm2_engine.generate(["1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert "6" in full.text
    cut = smollm2_engine.generate(["1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=12, stop=("6",)))[0]
    assert cut.text == full.text[:full.text.index("6")] and cut.finish_reason == "stop"
    kept = smollm2_engine.generate(["1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=12, stop=("6",),
                                                                 include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:full.text.index("6") + 1]
    stop_id = full.token_ids[2]
    by_id = smollm2_engine.generate(["1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=12,
                                                                 stop_token_ids=(stop_id,)))[0]
    assert by_id.token_ids == full.token_ids[:3] and by_id.finish_reason == "stop"


def test_logprobs_are_the_models_distribution(smollm2_engine):
    out = smollm2_engine.generate(["The capital of France is"],
                                  SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert lp.top[0][0] == token and abs(lp.top[0][1] - lp.logprob) < 1e-6  # greedy = most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_abort_frees_the_request(smollm2_engine):
    rid = smollm2_engine.add_request("Tell me a long story", SamplingParams(max_tokens=100))
    smollm2_engine.step()
    smollm2_engine.abort(rid)
    assert not smollm2_engine.has_unfinished_requests()
    smollm2_engine.check_integrity()
    assert smollm2_engine.kv.num_free_blocks == smollm2_engine.kv.num_blocks


def test_prompt_longer_than_the_context_is_refused(smollm2_engine):
    with pytest.raises(ValueError, match="context"):
        smollm2_engine.add_request([1] * 2000, GREEDY)


def test_async_engine_streams_and_aborts_on_early_exit(smollm2_engine):
    expected = smollm2_engine.generate(["The capital of France is"], GREEDY)[0]

    async def scenario():
        engine = AsyncLLMEngine(smollm2_engine)
        try:
            pieces = [o async for o in engine.generate("The capital of France is", GREEDY)]
            assert pieces[-1].finished and pieces[-1].token_ids == expected.token_ids
            assert "".join(p.delta_text for p in pieces) == expected.text
            stream = engine.generate("Tell me a long story", SamplingParams(max_tokens=200))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(50):
                if not smollm2_engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            assert not smollm2_engine.has_unfinished_requests()
            with pytest.raises(ValueError):
                async for _ in engine.generate([1] * 2000, GREEDY):
                    pass
        finally:
            engine.shutdown()
    asyncio.run(scenario())


def test_kv_budget_below_max_model_len_is_refused_at_start(engine_home):
    with pytest.raises(ValueError, match=r"64 tokens.*max_model_len 1024"):
        LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=1024, num_kv_blocks=4, block_size=16)


def prefill_for_transfer(engine, prompt, params, request_id):
    """Prefill ``prompt`` as a prefill worker does; the handoff, with the KV released here."""
    req = engine.make_request(prompt, params, request_id)
    req.kv_transfer = True
    engine.add(req)
    while engine.has_unfinished_requests():
        engine.step()
    handoff = engine.export_kv(request_id)
    engine.release_kv(request_id)
    return handoff


def adoptable(engine, handoff, request_id):
    req = engine.make_request(handoff.request.prompt_token_ids, handoff.request.sampling_params, request_id)
    req.append_token(handoff.request.output_token_ids[0])
    return req


def test_async_engine_refuses_duplicate_ids_and_the_first_request_is_unharmed(smollm2_engine):
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # still running while the ids clash
    expected = smollm2_engine.generate(["The capital of France is"], long)[0]

    async def scenario():
        engine = AsyncLLMEngine(smollm2_engine)
        try:
            first = engine.stream(engine.prepare("The capital of France is", long, "dup"))
            pieces = [await anext(first)]
            with pytest.raises(ValueError, match="duplicate"):
                engine.prepare("Hello", GREEDY, "dup")
            with pytest.raises(ValueError, match="duplicate"):
                async for _ in engine.stream(smollm2_engine.make_request("Hello", GREEDY, "dup")):
                    pass
            pieces += [o async for o in first]
            assert pieces[-1].finished and pieces[-1].token_ids == expected.token_ids

            held = engine.prepare("Tell me about Paris", GREEDY, "held")
            held.kv_transfer = True
            assert [o async for o in engine.stream(held)][-1].finish_reason == "transfer"
            with pytest.raises(ValueError, match="duplicate"):  # the held KV is about to be exported
                async for _ in engine.stream(engine.prepare("Hello", GREEDY, "held")):
                    pass
            handoff = await engine.call(lambda e: e.export_kv("held"))
            assert handoff.request is held
            await engine.call(lambda e: e.release_kv("held"))
            assert await engine.call(lambda e: e.kv.num_free_blocks == e.kv.num_blocks)
        finally:
            engine.shutdown()
    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_async_engine_forgets_the_stream_of_an_adopted_request_never_read(smollm2_engine):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    handoff = prefill_for_transfer(smollm2_engine, "Hello there", params, "src")

    async def scenario():
        engine = AsyncLLMEngine(smollm2_engine)
        try:
            await engine.adopt(adoptable(smollm2_engine, handoff, "aborted"), handoff.kv)
            engine.abort("aborted")  # as the decode worker does when the caller went away
            await engine.adopt(adoptable(smollm2_engine, handoff, "finishes"), handoff.kv)
            while await engine.call(lambda e: e.has_unfinished_requests()):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)  # the loop runs what the engine thread scheduled
            assert not engine._streams
        finally:
            engine.shutdown()
    asyncio.run(asyncio.wait_for(scenario(), 120))
    smollm2_engine.check_integrity()


def test_stop_token_text_is_left_out_unless_asked_for(smollm2_engine):
    full = smollm2_engine.generate(["1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    stop_id = full.token_ids[2]
    decode = smollm2_engine.tokenizer.decode
    for include, n in ((False, 2), (True, 3)):
        out = smollm2_engine.generate(["1, 2, 3,"], SamplingParams(
            temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,), include_stop_str_in_output=include))[0]
        assert out.token_ids == full.token_ids[:3] and out.finish_reason == "stop"
        assert out.text == decode(full.token_ids[:n], skip_special_tokens=True)


def corrupted(params: SamplingParams, **fields) -> SamplingParams:
    """``params`` with values the door refuses, as if set after validation."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_one_request_that_cannot_be_sampled_fails_alone_and_the_engine_goes_on(smollm2_engine):
    expected = smollm2_engine.generate(["The capital of France is"], GREEDY)[0]

    async def scenario():
        engine = AsyncLLMEngine(smollm2_engine)
        try:
            async def run(prompt, params):
                return [o async for o in engine.generate(prompt, params)][-1]

            bad = corrupted(SamplingParams(max_tokens=16), temperature=float("nan"))
            tiny = SamplingParams(temperature=1e-39, repetition_penalty=1e-39, max_tokens=4)  # the API accepts it
            good, failed, small = await asyncio.gather(
                run("The capital of France is", GREEDY), run("Hello", bad), run("Hi", tiny), return_exceptions=True)
            assert isinstance(failed, RequestFailedError) and "finite" in str(failed)
            assert good.token_ids == expected.token_ids and small.finished
            assert engine.error is None
            assert (await run("The capital of France is", GREEDY)).token_ids == expected.token_ids
        finally:
            engine.shutdown()
    asyncio.run(asyncio.wait_for(scenario(), 120))
    smollm2_engine.check_integrity()


def test_a_failed_step_fails_its_batch_and_leaves_no_unwritten_kv_in_the_prefix_cache(smollm2_engine):
    engine = smollm2_engine
    engine.kv.reset_prefix_cache()
    prompt = shared_prefix_prompts(engine, 64)[0]
    expected = run_to_end(engine, [prompt], GREEDY)[0]
    engine.kv.reset_prefix_cache()
    good = engine.make_request(prompt, GREEDY)
    broken = engine.make_request("Hello", GREEDY)
    broken.token_ids[-1] = engine.model.config["vocab_size"] + 5  # the forward pass raises on it
    engine.add(good)
    engine.add(broken)
    outs = engine.step()
    assert {o.request_id for o in outs} == {good.request_id, broken.request_id}
    assert all(o.finished and o.finish_reason == "error" and o.error for o in outs)
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks
    again = run_to_end(engine, [prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == expected.token_ids


def test_adopting_kv_of_another_layout_is_refused_and_leaves_nothing_in_the_prefix_cache(smollm2_engine):
    import torch

    engine = smollm2_engine
    engine.kv.reset_prefix_cache()
    prompt = shared_prefix_prompts(engine, 64)[0]
    handoff = prefill_for_transfer(engine, prompt, GREEDY, "src")
    expected = run_to_end(engine, [prompt], GREEDY)[0]
    engine.kv.reset_prefix_cache()
    layers, _, blocks, bs, heads, dim = handoff.kv.shape
    other = torch.zeros(layers, 2, -(-blocks // 2), 2 * bs, heads, dim)  # a prefill worker with 32-token blocks
    with pytest.raises(ValueError, match="KV"):
        engine.adopt(adoptable(engine, handoff, "adopted"), other)
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks
    again = run_to_end(engine, [prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == expected.token_ids


def test_the_model_identity_names_the_kv_layout(smollm2_engine, engine_home):
    identity = smollm2_engine.model_identity
    layers, _, n_kv, head_dim = smollm2_engine.runner.kv_block_shape()
    for part in ("float32", "block_size=16", f"layers={layers}", f"kv_heads={n_kv}", f"head_dim={head_dim}"):
        assert part in identity
    other = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=256, num_kv_blocks=8, block_size=32)
    assert other.model_identity != identity  # a receiver refuses its KV at the door
    assert other.model_identity.replace("block_size=32", "block_size=16") == identity


def test_greedy_outputs_under_a_tiny_kv_budget_match_an_unconstrained_run(smollm2_engine, engine_home):
    """Seeded arrivals over several steps, priorities with (priority, arrival) ties, shared
    prefixes and chunked prefill in a cache of 8 blocks: preemption changes no token."""
    rng = random.Random(12)
    shared = [rng.randrange(100, 20000) for _ in range(20)]
    cases = []
    for i in range(6):
        own = [rng.randrange(100, 20000) for _ in range(rng.randint(3, 24))]
        prompt = (shared if i % 2 else []) + own
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(6, 20), ignore_eos=True),
                      rng.randint(0, 6), rng.choice((0, 0, 1))))
    unconstrained = smollm2_engine.generate([c[0] for c in cases], [c[1] for c in cases])  # one batch, no preemption
    reference = [o.token_ids for o in unconstrained]
    small = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=128, num_kv_blocks=8,
                                 block_size=16, max_num_batched_tokens=32)
    ids, done = [], {}
    for t in range(400):
        for prompt, sp, arrives, priority in cases:
            if arrives == t:  # arrival time in whole steps: ties are common
                ids.append(small.add(small.make_request(prompt, sp, priority=priority, arrival_time=float(t))))
        for out in small.step():
            if out.finished:
                done[out.request_id] = out
        small.check_integrity()
        if len(done) == len(cases):
            break
    order = sorted(range(len(cases)), key=lambda i: cases[i][2])  # ids were added in arrival order
    assert small.scheduler.num_preemptions > 0
    assert [done[ids[k]].token_ids for k in range(len(cases))] == [reference[i] for i in order]
    assert small.kv.num_free_blocks == 8


FLOAT_BLOCKS = 128  # the int8 engine's KV budget: what this many float32 blocks take


@pytest.fixture(scope="module")
def smollm2_int8_engine(smollm2_engine):
    """SmolLM2 on an int8 KV cache, given the bytes of FLOAT_BLOCKS float32 blocks."""
    from cloud_tier.engine.model_runner import ModelRunner

    budget = FLOAT_BLOCKS * ModelRunner.bytes_per_block(smollm2_engine.model, 16, torch.float32)
    return LLMEngine.from_model("smollm2-135m", dtype="float32", kv_cache_dtype="int8", max_model_len=1024,
                                max_num_batched_tokens=256, kv_cache_memory_bytes=budget, threads=1)


def test_an_int8_kv_cache_holds_about_four_times_the_float32_blocks_in_the_same_bytes(smollm2_engine,
                                                                                        smollm2_int8_engine):
    assert 3.7 < smollm2_int8_engine.kv.num_blocks / FLOAT_BLOCKS <= 4  # the scales take 4 of every head_dim + 4
    assert "dtype=int8" in smollm2_int8_engine.model_identity and "float32" in smollm2_int8_engine.model_identity
    assert smollm2_int8_engine.model_identity != smollm2_engine.model_identity


def test_int8_kv_handed_over_continues_like_a_local_run_and_a_float_engine_refuses_it(smollm2_engine,
                                                                                       smollm2_int8_engine):
    engine = smollm2_int8_engine
    engine.kv.reset_prefix_cache()
    prompt = shared_prefix_prompts(engine, 64)[0]
    expected = run_to_end(engine, [prompt], GREEDY)[0]
    engine.kv.reset_prefix_cache()
    handoff = prefill_for_transfer(engine, prompt, GREEDY, "int8-src")
    assert handoff.kv.dtype == torch.int8 and handoff.kv.shape[-1] == engine.runner.kv_block_shape()[-1] + 4
    with pytest.raises(ValueError, match="KV payload"):
        smollm2_engine.adopt(adoptable(smollm2_engine, handoff, "float-dst"), handoff.kv)
    smollm2_engine.check_integrity()
    assert not smollm2_engine.has_unfinished_requests()
    engine.kv.reset_prefix_cache()
    first = engine.adopt(adoptable(engine, handoff, "int8-dst"), handoff.kv, handoff.logprobs[0] if handoff.logprobs
                         else None, handoff.sampler_state)
    tokens = [first.new_token_ids[0]]
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    engine.check_integrity()
    assert tokens == expected.token_ids
