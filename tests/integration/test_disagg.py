"""Prefill on one engine, decode on another: the KV and the request record cross a real
transport, and the decode engine continues exactly where a co-located engine would."""

from __future__ import annotations

import asyncio

import pytest

from cloud_tier.disagg.messages import RequestRecord, TransferAck, TransferHeader
from cloud_tier.disagg.protocol import PrefillRequest
from cloud_tier.disagg.records import logprob_record, logprobs_of, params_of
from cloud_tier.disagg.transport import (
    KVReceiver,
    ShmSender,
    TcpSender,
    payload_to_tensor,
    tensor_payload,
)
from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.async_engine import AsyncLLMEngine

PROMPTS = ["The capital of France is", "Write a short poem about the sea. " * 6]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, logprobs=2),
          SamplingParams(temperature=0.8, seed=7, max_tokens=24)]


@pytest.fixture(scope="module")
def decode_engine(engine_home):
    return LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=1024,
                                max_num_batched_tokens=256, num_kv_blocks=256)


def _prefill(engine: LLMEngine, prompt: str, params: SamplingParams):
    req = engine.make_request(prompt, params)
    req.kv_transfer = True
    engine.add(req)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "transfer"
    return req, engine.export_kv(req.request_id)


def _run_to_end(engine: LLMEngine, first):
    final = first
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        engine.check_integrity()
    return final


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompt: str, params: SamplingParams, transport: str):
    """Prefill ``prompt`` on one engine, move it over ``transport``, adopt it on the other."""
    req, handoff = _prefill(prefill, prompt, params)
    adopted = {}

    async def handler(header: TransferHeader, payload: memoryview) -> TransferAck:
        rec = header.record
        new = decode.make_request(rec.prompt_token_ids, params_of(rec), rec.request_id)
        new.append_token(rec.output_token_ids[0])
        lp = logprobs_of(rec.logprobs[0]) if rec.logprobs else None
        adopted["first"] = decode.adopt(new, payload_to_tensor(header, payload).clone(), lp, rec.sampler_state)
        return TransferAck(request_id=rec.request_id, ok=True)

    ack = _send(prefill, req, handoff, params, handler, prefill.model_identity, transport)
    assert ack.ok, ack
    return adopted["first"]


def _send(prefill: LLMEngine, req, handoff, params: SamplingParams, handler, receiver_identity: str,
          transport: str) -> TransferAck:
    """Send a prefilled request's KV, as stored, to a receiver holding ``receiver_identity``; its ack.
    The KV is released on the prefill engine after."""
    record = RequestRecord(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids, sampling=params.to_dict(),
                           sampler_state=handoff.sampler_state,
                           logprobs=[logprob_record(lp) for lp in handoff.logprobs])

    async def move():
        receiver = KVReceiver(handler, model_identity=receiver_identity)
        await receiver.start()
        receiver.expect(req.request_id, "the-token", handoff.kv.nbytes)
        try:
            sender = TcpSender() if transport == "tcp" else ShmSender()
            header = TransferHeader(request_id=req.request_id, token="the-token", model_identity=prefill.model_identity,
                                    dtype=str(handoff.kv.dtype).removeprefix("torch."), shape=list(handoff.kv.shape),
                                    nbytes=0, checksum="", transport="tcp", record=record)
            return await sender.send(receiver.address, header, tensor_payload(handoff.kv))
        finally:
            await receiver.close()

    ack = asyncio.run(move())
    prefill.release_kv(req.request_id)
    prefill.check_integrity()
    return ack


@pytest.fixture(scope="module")
def co_located(smollm2_engine):
    """``co_located(params)``: the prefill engine's own outputs for PROMPTS, once per params (both
    transports compare with the same run)."""
    runs: dict[int, list] = {}

    def get(params: SamplingParams) -> list:
        key = PARAMS.index(params)
        if key not in runs:
            runs[key] = smollm2_engine.generate(PROMPTS, params)
        return runs[key]

    return get


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_handoff_over_a_transport_continues_like_one_engine(smollm2_engine, decode_engine, co_located, transport,
                                                           params):
    refs = co_located(params)
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        first = _handoff(smollm2_engine, decode_engine, prompt, params, transport)
        final = _run_to_end(decode_engine, first)
        assert final.token_ids == ref.token_ids
        assert final.text == ref.text
        if params.logprobs is not None:
            assert [lp.token_id for lp in final.logprobs] == ref.token_ids
    assert decode_engine.kv.num_free_blocks == decode_engine.kv.num_blocks


def test_adopt_refuses_what_does_not_fit_and_changes_nothing(smollm2_engine, engine_home):
    """8 blocks (the engine holds at least max_model_len): one 5-block request adopted, a second
    one does not fit next to it."""
    from cloud_tier.engine.llm_engine import KVCapacityError

    small = LLMEngine.from_model("smollm2-135m", dtype="float32", max_model_len=128, num_kv_blocks=8,
                                 max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4)
    adopted = []
    for prompt in ("word " * 70, "other " * 70):
        req, handoff = _prefill(smollm2_engine, prompt, params)
        smollm2_engine.release_kv(req.request_id)
        new = small.make_request(req.prompt_token_ids, params, req.request_id)
        new.append_token(req.output_token_ids[0])
        assert small.kv.blocks_for_tokens(new.num_prompt_tokens) == 5
        if not adopted:
            adopted.append(small.adopt(new, handoff.kv))
            continue
        with pytest.raises(KVCapacityError):
            small.adopt(new, handoff.kv)
    small.check_integrity()
    assert small.kv.num_free_blocks == 3 and small.scheduler.num_running == 1


def test_prefill_worker_releases_the_kv_when_the_decode_target_is_dead(smollm2_engine):
    from cloud_tier.disagg.prefill import PrefillService

    async def go():
        engine = AsyncLLMEngine(smollm2_engine)
        try:
            svc = PrefillService(engine, timeout_s=2)
            record = RequestRecord(request_id="dead-target", prompt_token_ids=smollm2_engine.tokenizer.encode(
                "Hello there, " * 20), sampling=SamplingParams(temperature=0, max_tokens=8).to_dict())
            resp = await svc.prefill(PrefillRequest(record=record, kv_target="127.0.0.1:9", transport="tcp"))
            await engine.call(lambda e: None)  # the release is queued to the engine thread: let it run
            stats = await engine.call(lambda e: (e.kv.num_free_blocks, e.kv.num_blocks, dict(e.scheduler.held)))
            return resp, stats
        finally:
            engine.shutdown()

    resp, (free, total, held) = asyncio.run(go())
    assert not resp.ok and resp.code == "transfer_failed"
    assert free == total and not held
    smollm2_engine.check_integrity()


def _int8_engine():
    return LLMEngine.from_model("smollm2-135m", dtype="float32", kv_cache_dtype="int8", max_model_len=1024,
                                max_num_batched_tokens=256, num_kv_blocks=256, threads=1)


@pytest.fixture(scope="module")
def int8_engine(engine_home):
    return _int8_engine()


def test_int8_kv_crosses_the_transport_as_stored_and_continues_like_one_engine(int8_engine):
    decode = _int8_engine()
    params = PARAMS[0]
    refs = int8_engine.generate(PROMPTS, params)
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        final = _run_to_end(decode, _handoff(int8_engine, decode, prompt, params, "tcp"))
        assert final.token_ids == ref.token_ids
    assert decode.kv.num_free_blocks == decode.kv.num_blocks


def test_a_float_decode_worker_refuses_int8_kv_before_its_payload(int8_engine, decode_engine):
    async def never(header, payload):
        raise AssertionError("a refused transfer reached the handler")

    req, handoff = _prefill(int8_engine, PROMPTS[0], PARAMS[0])
    ack = _send(int8_engine, req, handoff, PARAMS[0], never, decode_engine.model_identity, "tcp")
    assert not ack.ok and ack.code == "model_mismatch" and "int8" in ack.message
    assert int8_engine.kv.num_free_blocks == int8_engine.kv.num_blocks


def test_a_guided_request_handed_over_continues_its_grammar_like_one_engine(smollm2_engine, decode_engine):
    """The grammar travels in the record; the prefill engine samples the first token under its mask, the
    decode engine's matcher takes that token before its first step, and the answer is the co-located one."""
    import json

    from llguidance import LLMatcher

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"enum": [1, 2, 3]}},
              "required": ["city", "rank"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=40, guided=grammar)
    ref = smollm2_engine.generate([PROMPTS[0]], params)[0]
    final = _run_to_end(decode_engine, _handoff(smollm2_engine, decode_engine, PROMPTS[0], params, "tcp"))
    assert final.token_ids == ref.token_ids and final.finish_reason == ref.finish_reason == "stop"
    answer = json.loads(final.text)
    assert set(answer) == {"city", "rank"} and answer["rank"] in (1, 2, 3)
    assert decode_engine.kv.num_free_blocks == decode_engine.kv.num_blocks
