"""The prefill -> decode wire: typed messages and the one codec that frames them.

A frame is ``b"CKV1"`` + a 1-byte ``MessageKind`` + a 4-byte big-endian body length + the body,
the message's JSON (UTF-8). Decoding is strict: unknown fields, wrong types ("1" for 1, 1.0 for
1, true for 1) and missing fields are rejected, so garbage never becomes a message.

    frame = encode(TransferAck(request_id="r1", ok=True))
    ack = decode(frame)  # or, from a stream: await read_message(reader, TransferAck)
"""

from __future__ import annotations

import asyncio
import enum
import math
import struct
import zlib
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cloud_tier.draft import Draft

MAGIC = b"CKV1"
_PREFIX = struct.Struct(">4sBI")  # magic, kind, body length
PREFIX_SIZE = _PREFIX.size  # 9
MAX_BODY = (1 << 32) - 1

# int8: an int8 KV cache as stored, each row followed by its float32 scale's 4 bytes (the shape's last
# dimension is head_dim + 4; cloud_tier.engine.kv_quant.pack)
KVDtype = Literal["float32", "bfloat16", "float16", "int8"]
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}

AckCode = Literal["", "truncated", "corrupt", "bad_header", "model_mismatch", "no_capacity",
                  "unknown_request", "error"]


class CodecError(ValueError):
    """A frame or its body is not a valid message of this wire."""


class TruncatedError(CodecError):
    """The stream ended before a whole frame arrived."""


class ByteReader(Protocol):
    """What `read_message` reads from: an `asyncio.StreamReader`, or anything that has its
    readexactly."""

    async def readexactly(self, n: int) -> bytes: ...


class _Message(BaseModel):
    # Python construction stays lax (a frozenset of eos ids becomes a list); `decode` validates
    # the wire strictly. -inf logprobs travel as JSON's -Infinity; bytes as (url-safe) base64.
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64",
                              ser_json_inf_nan="constants")


class TokenLogprobRecord(_Message):
    """One sampled token's logprob and, when asked, the top alternatives as (token_id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class RequestRecord(_Message):
    """The engine request handed from prefill to decode: what the decode worker needs to
    continue it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = []  # the first token, sampled by the prefill worker
    sampling: dict[str, Any]  # SamplingParams fields
    eos_token_ids: list[int] = []
    priority: int = 0
    # the request's service level (cloud_tier.engine.request.ServiceLevel); timeout_s: what was left of
    # its deadline when this record was sent (clocks differ between hosts, durations travel)
    priority_class: Literal["interactive", "escalation", "batch"] = "interactive"
    ttft_slo_s: Annotated[float, Field(gt=0)] | None = None
    tpot_slo_s: Annotated[float, Field(gt=0)] | None = None
    timeout_s: float | None = None
    # how long it had waited when this record was sent (in the gateway): the engine's TTFT clock
    # starts that much before the record arrives, at the request's arrival where the client sent it
    waited_s: Annotated[float, Field(ge=0, le=86400)] = 0.0
    tenant: str = Field(default="", max_length=256)
    logprobs: list[TokenLogprobRecord] = []  # of output_token_ids, when asked
    sampler_state: bytes | None = None  # torch.Generator state of a seeded request
    num_cached_tokens: int = 0  # prompt tokens the prefill worker took from its prefix cache
    finish_reason: str | None = None  # set when the request already ended on the prefill worker
    # The decode worker's secret for this request's KV transfer, sent to the prefill worker in
    # its PrefillRequest, which puts it in the TransferHeader (and sends no record with it).
    transfer_token: str = Field(default="", max_length=256)
    # a draft to verify (``cloud_tier.draft.Draft``): the device's tokens after the prompt, and its
    # probability of each / its distribution per position when it sampled (the gateway checked them)
    draft_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] = []
    draft_probs: list[Annotated[float, Field(ge=0, le=1)]] | None = None
    draft_top: list[Annotated[list[tuple[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=0, le=1)]]],
                              Field(max_length=64)]] | None = None

    def draft(self) -> Draft | None:
        """The record's draft as a ``cloud_tier.draft.Draft`` (None: it has none); ValueError when
        it is not a valid one."""
        if not self.draft_token_ids:
            return None
        return Draft(tuple(self.draft_token_ids), None if self.draft_probs is None else tuple(self.draft_probs),
                     None if self.draft_top is None else tuple(tuple((t, p) for t, p in pos)
                                                               for pos in self.draft_top))


class TransferHeader(_Message):
    """Describes one request's KV payload: (num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim) elements of ``dtype``, ``nbytes`` long, sent raw after this frame (tcp) or left in
    the shared-memory segment ``shm_name`` (shm). The sender fills transport, nbytes, checksum
    and shm_name; a caller builds it with placeholders for them (nbytes=0, checksum="").
    ``token`` is the one the receiver expects for ``request_id`` (its ``transfer_token``)."""

    request_id: str
    token: str = Field(max_length=256)
    model_identity: str  # the receiver refuses KV from another model/dtype
    dtype: KVDtype
    shape: list[Annotated[int, Field(ge=0)]]
    nbytes: int = Field(ge=0)
    checksum: str  # payload_checksum() of the payload
    transport: Literal["tcp", "shm"]
    shm_name: str | None = Field(default=None, pattern=r"^cascade-kv-[0-9a-f]{1,64}$")
    record: RequestRecord

    @property
    def expected_nbytes(self) -> int:
        """The payload length ``shape`` and ``dtype`` imply."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


class TransferAck(_Message):
    """The receiver's answer to one transfer. ``ok`` is False exactly when ``code`` is set."""

    request_id: str
    ok: bool
    code: AckCode = ""
    message: str = ""

    @model_validator(mode="after")
    def _check(self) -> TransferAck:
        if self.ok != (self.code == ""):
            raise ValueError(f"ok={self.ok} with code {self.code!r}: a failed ack needs a code, "
                             "a good one none")
        return self


class MessageKind(enum.IntEnum):
    REQUEST_RECORD = 1
    TRANSFER_HEADER = 2
    TRANSFER_ACK = 3


_CLASS_OF_KIND: dict[MessageKind, type[_Message]] = {
    MessageKind.REQUEST_RECORD: RequestRecord,
    MessageKind.TRANSFER_HEADER: TransferHeader,
    MessageKind.TRANSFER_ACK: TransferAck,
}
_KIND_OF_CLASS = {cls: kind for kind, cls in _CLASS_OF_KIND.items()}

Message = RequestRecord | TransferHeader | TransferAck


def encode(msg: Message) -> bytes:
    """One frame holding ``msg``."""
    kind = _KIND_OF_CLASS.get(type(msg))
    if kind is None:
        raise TypeError(f"{type(msg).__name__} is not a message of this wire")
    body = msg.model_dump_json().encode()
    if len(body) > MAX_BODY:
        raise ValueError(f"{type(msg).__name__} body is {len(body)} bytes, over the frame limit")
    return _PREFIX.pack(MAGIC, kind, len(body)) + body


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """The message in exactly one whole frame; `CodecError` if it is not one."""
    kind, length = _parse_prefix(bytes(frame[:PREFIX_SIZE]), max_len=MAX_BODY)
    if len(frame) - PREFIX_SIZE != length:
        raise CodecError(f"frame body is {len(frame) - PREFIX_SIZE} bytes, "
                         f"its prefix says {length}")
    return _decode_body(kind, frame[PREFIX_SIZE:])


async def read_message(reader: ByteReader, expected: type[Message] | None = None,
                       max_len: int = 64 << 20) -> Message:
    """Read one frame from ``reader``. `TruncatedError` if the stream ends inside it, `CodecError`
    if it is malformed, longer than ``max_len`` or not an ``expected`` message."""
    prefix = await _read_exactly(reader, PREFIX_SIZE)
    kind, length = _parse_prefix(prefix, max_len=max_len)
    msg = _decode_body(kind, await _read_exactly(reader, length))
    if expected is not None and not isinstance(msg, expected):
        raise CodecError(f"expected a {expected.__name__}, got a {type(msg).__name__}")
    return msg


def payload_checksum(buf: bytes | bytearray | memoryview) -> str:
    """CRC-32 of a payload as 8 hex digits: it catches transport corruption at ~3 GB/s, where
    blake2b manages ~0.7 GB/s (100 MB on one core); it does not resist a malicious sender."""
    return f"{zlib.crc32(buf):08x}"


async def _read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise TruncatedError(f"stream ended after {len(e.partial)} of {n} bytes") from e


def _parse_prefix(prefix: bytes, max_len: int) -> tuple[MessageKind, int]:
    if len(prefix) < PREFIX_SIZE:
        raise CodecError(f"frame is {len(prefix)} bytes, "
                         f"shorter than its {PREFIX_SIZE}-byte prefix")
    magic, kind, length = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if kind not in _CLASS_OF_KIND:
        raise CodecError(f"unknown message kind {kind}")
    if length > max_len:
        raise CodecError(f"frame body of {length} bytes is over the {max_len}-byte limit")
    return MessageKind(kind), length


def _decode_body(kind: MessageKind, body: bytes | bytearray | memoryview) -> Message:
    cls = _CLASS_OF_KIND[kind]
    try:
        return cls.model_validate_json(bytes(body), strict=True)
    except ValidationError as e:
        # Covers invalid UTF-8 and JSON as well as schema violations.
        raise CodecError(f"invalid {cls.__name__}: {e}") from e
