"""The prefill -> decode wire codec: every message round-trips, garbage is a CodecError."""

import asyncio
import json
import math
import struct

import pytest

from cloud_tier.disagg.messages import (
    MAGIC,
    CodecError,
    MessageKind,
    RequestRecord,
    TokenLogprobRecord,
    TransferAck,
    TransferHeader,
    TruncatedError,
    decode,
    encode,
    payload_checksum,
    read_message,
)


def record(**kw) -> RequestRecord:
    fields = dict(request_id="req-1", prompt_token_ids=[1, 2, 3], output_token_ids=[7],
                  sampling={"temperature": 0.7, "max_tokens": 16, "seed": 3, "stop": ["\n"]},
                  eos_token_ids=[2], priority=1, num_cached_tokens=2,
                  logprobs=[TokenLogprobRecord(token_id=7, logprob=-0.25, top=[(7, -0.25), (9, -math.inf)])],
                  sampler_state=bytes(range(256)) * 3)
    return RequestRecord(**(fields | kw))


def header(**kw) -> TransferHeader:
    fields = dict(request_id="req-1", token="t0k3n", model_identity="smollm2-135m/float32", dtype="float32",
                  shape=[2, 2, 3, 4, 2, 8], nbytes=2 * 2 * 3 * 4 * 2 * 8 * 4, checksum="0badf00d",
                  transport="shm", shm_name="cascade-kv-0123abcd", record=record())
    return TransferHeader(**(fields | kw))


def frame(kind: int, body: bytes, magic: bytes = MAGIC) -> bytes:
    return struct.pack(">4sBI", magic, kind, len(body)) + body


async def read_from(data: bytes, **kw):
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await read_message(reader, **kw)


@pytest.mark.parametrize("msg", [
    record(),
    record(output_token_ids=[], logprobs=[], sampler_state=None, finish_reason="stop"),
    header(),
    header(transport="tcp", shm_name=None, dtype="bfloat16", shape=[0, 2, 1, 16, 2, 64], nbytes=0),
    TransferAck(request_id="req-1", ok=True),
    TransferAck(request_id="req-1", ok=False, code="no_capacity", message="12 blocks free, 40 needed"),
], ids=lambda m: type(m).__name__)
def test_every_message_kind_round_trips_through_one_frame(msg):
    data = encode(msg)
    assert data[:4] == MAGIC
    assert decode(data) == msg
    assert asyncio.run(read_from(data)) == msg


def test_record_keeps_bytes_and_infinite_logprobs_exactly():
    back = decode(encode(record()))
    assert back.sampler_state == bytes(range(256)) * 3
    assert back.logprobs[0].top == [(7, -0.25), (9, -math.inf)]


def test_python_construction_is_lax_but_the_wire_is_strict():
    assert record(eos_token_ids=frozenset({2})).eos_token_ids == [2]
    body = record().model_dump_json().replace('"priority":1', '"priority":"1"').encode()
    with pytest.raises(CodecError, match="priority"):
        decode(frame(MessageKind.REQUEST_RECORD, body))


@pytest.mark.parametrize("data, match", [
    (frame(3, b'{"request_id":"r","ok":true}', magic=b"CKV2"), "bad magic"),
    (frame(42, b'{"request_id":"r","ok":true}'), "unknown message kind 42"),
    (frame(3, b'{"request_id":"r","ok":true}')[:5], "shorter than its 9-byte prefix"),
    (frame(3, b'{"request_id":"r","ok":true}')[:-1], "its prefix says"),
    (frame(3, b'{"request_id":"r","ok":true}') + b"x", "its prefix says"),
    (frame(3, b'{"request_id":"r", ok'), "invalid TransferAck"),
    (frame(3, b'\xff\xfe{}'), "invalid TransferAck"),
    (frame(3, b'{"request_id":"r"}'), "ok"),  # missing field
    (frame(3, b'{"request_id":"r","ok":1}'), "ok"),  # 1 is not a bool on this wire
    (frame(3, b'{"request_id":"r","ok":true,"extra":0}'), "extra"),
    (frame(3, b'{"request_id":"r","ok":false,"code":"oops"}'), "code"),
    (frame(3, b'{"request_id":"r","ok":false}'), "a failed ack needs a code"),
    (frame(2, b'{"request_id":"r","ok":true}'), "invalid TransferHeader"),  # a valid ack, wrong kind
], ids=["magic", "kind", "short-prefix", "short-body", "trailing", "json", "utf8", "missing",
        "type", "extra", "code", "ok-without-code", "kind-body-mismatch"])
def test_garbage_is_a_codec_error(data, match):
    with pytest.raises(CodecError, match=match):
        decode(data)


@pytest.mark.parametrize("change, match", [
    (dict(shm_name="../../etc/passwd"), "shm_name"),
    (dict(shape=[2, -1, 3]), "shape"),
    (dict(dtype="float64"), "dtype"),
    (dict(nbytes=-1), "nbytes"),
])
def test_header_rules_hold_on_the_wire(change, match):
    body = json.loads(header().model_dump_json()) | change
    data = frame(MessageKind.TRANSFER_HEADER, json.dumps(body).encode())
    with pytest.raises(CodecError, match=match):
        decode(data)


def test_header_knows_its_payload_length():
    assert header(dtype="bfloat16", shape=[3, 2, 5]).expected_nbytes == 60
    assert header(shape=[4, 0, 7]).expected_nbytes == 0


def test_read_message_reads_one_frame_and_leaves_the_rest():
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(encode(header()) + b"payload")
        reader.feed_eof()
        got = await read_message(reader, TransferHeader)
        return got, await reader.read()
    assert asyncio.run(go()) == (header(), b"payload")


def test_read_message_rejects_truncation_wrong_kind_and_oversize():
    data = encode(TransferAck(request_id="r", ok=True))
    with pytest.raises(TruncatedError, match="after 0 of 9 bytes"):
        asyncio.run(read_from(b""))
    with pytest.raises(TruncatedError, match=f"after 3 of {len(data) - 9} bytes"):
        asyncio.run(read_from(data[:12]))
    with pytest.raises(CodecError, match="expected a TransferHeader, got a TransferAck"):
        asyncio.run(read_from(data, expected=TransferHeader))
    with pytest.raises(CodecError, match="over the 10-byte limit"):
        asyncio.run(read_from(data, max_len=10))
    assert issubclass(TruncatedError, CodecError) and issubclass(CodecError, ValueError)


def test_encode_refuses_what_is_not_a_wire_message():
    with pytest.raises(TypeError, match="TokenLogprobRecord"):
        encode(TokenLogprobRecord(token_id=1, logprob=0.0))


def test_checksum_is_stable_and_sees_a_flipped_bit():
    data = bytearray(range(256)) * 1000
    before = payload_checksum(data)
    assert before == payload_checksum(memoryview(bytes(data))) and len(before) == 8
    data[1234] ^= 0x10
    assert payload_checksum(data) != before


def test_the_time_a_request_waited_before_travels_as_a_duration_and_moves_its_arrival_back():
    from pydantic import ValidationError

    from cloud_tier.disagg.records import arrival_of

    assert record().waited_s == 0.0 and arrival_of(record(), received=500.0) == 500.0
    waited = record(waited_s=0.75)
    assert decode(encode(waited)).waited_s == 0.75
    assert arrival_of(waited, received=500.0) == 499.25  # the TTFT clock started where the client sent it
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValidationError):
            record(waited_s=bad)
