"""OpenAI's ``POST /v1/embeddings``, shared by the edge agent, the worker and the gateway: the strict
request schema, its inputs made token lists (truncation, vocabulary and context checks), and the
response (float lists or OpenAI's base64 of little-endian float32).

Every refusal is a 400 naming its field; nothing here sees a model (the tier passes its
tokenizer, vocabulary size, context length and vector size)."""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from cascade import errors
from cascade.protocol import CascadeOptions

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
MAX_TOKEN_ID = 2**31 - 1


class EmbeddingRequest(BaseModel):
    """The body of ``POST /v1/embeddings``. ``input``: a string, a list of strings, a list of token
    ids (one input) or a list of lists of token ids; ``truncate_prompt_tokens`` (vLLM's name):
    keep the last N tokens of each input, -1 for the model's context length; without it an input
    longer than the context is a 400, never cut silently."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1, le=1 << 20)] | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1, le=MAX_TOKEN_ID)] | None = None
    cascade: CascadeOptions | None = None  # the edge agent's: {"mode": "cloud"} asks the cloud

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> str | list:
        check_input(value)
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (the model's context length) or a positive number of tokens")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one item each: a string or a list of token ids."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if isinstance(x[0], int):
            return [list(x)]
        return list(x)


def check_input(value: Any) -> None:
    """ValueError (a 400 naming ``input``) unless ``value`` is one of OpenAI's four input shapes,
    non-empty throughout, with at most MAX_INPUTS inputs and token ids in [0, 2**31)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be an empty string")
        return
    if not isinstance(value, list):
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")
    if not value:
        raise ValueError("must not be an empty list")
    first = value[0]
    if _is_token(first):
        _check_tokens(value, "")
        return
    if len(value) > MAX_INPUTS:
        raise ValueError(f"has {len(value)} inputs; at most {MAX_INPUTS} are allowed in one request")
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ValueError(f"item {i} is not a string (a list of strings must hold only strings)")
            if not item:
                raise ValueError(f"item {i} is an empty string")
        return
    if isinstance(first, list):
        for i, item in enumerate(value):
            if not isinstance(item, list):
                raise ValueError(f"item {i} is not a list of token ids (a list of lists must hold only lists)")
            if not item:
                raise ValueError(f"item {i} is an empty list")
            _check_tokens(item, f"item {i}: ")
        return
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_tokens(ids: list, where: str) -> None:
    for j, t in enumerate(ids):
        if not _is_token(t):
            raise ValueError(f"{where}token {j} is not an integer token id")
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{where}token {j} ({t}) is not a token id")


def check_dimensions(req: EmbeddingRequest, native: int) -> None:
    """Our models are not Matryoshka models: ``dimensions`` may only name their own size."""
    if req.dimensions is not None and req.dimensions != native:
        raise errors.bad_request(f"This model's embeddings have {native} dimensions and cannot be shortened; "
                                 f"send `dimensions` {native} or leave it out.", "dimensions", "invalid_value")


def token_lists(req: EmbeddingRequest, tokenize: Callable[[str], list[int]], n_vocab: int,
                n_ctx: int, max_total: int | None = None) -> list[list[int]]:
    """Each input's token ids, checked against the vocabulary and truncated as asked; a 400 naming
    the field when an id is outside the vocabulary, an input is longer than ``n_ctx`` tokens
    without truncation asked, or the inputs hold more than ``max_total`` tokens together (what
    bounds a request's time: the body's size alone lets one ask for minutes of a device's compute)."""
    keep = req.truncate_prompt_tokens
    if keep == -1:
        keep = n_ctx
    if keep is not None and keep > n_ctx:
        raise errors.bad_request(f"truncate_prompt_tokens {keep} is more than this model's context length "
                                 f"({n_ctx} tokens).", "truncate_prompt_tokens", "invalid_value")
    out: list[list[int]] = []
    total = 0
    for i, item in enumerate(req.inputs()):
        ids = tokenize(item) if isinstance(item, str) else item
        if any(t >= n_vocab for t in ids):
            raise errors.bad_request(f"Input {i} has a token id outside this model's vocabulary [0, {n_vocab}).",
                                     "input", "invalid_value")
        if keep is not None:
            ids = ids[-keep:]
        elif len(ids) > n_ctx:
            raise errors.bad_request(
                f"Input {i} is {len(ids)} tokens; this model's context length is {n_ctx} tokens. Shorten it, or "
                "send `truncate_prompt_tokens` to keep its last tokens.", "input", "context_length_exceeded")
        if not ids:
            raise errors.bad_request(f"Input {i} has no tokens.", "input", "invalid_value")
        out.append(ids)
        total += len(ids)
        if max_total is not None and total > max_total:
            raise errors.bad_request(f"The inputs hold more than {max_total} tokens, the most one request may embed "
                                     "here; send them in several requests.", "input", "too_many_tokens")
    return out


def normalized(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to unit L2 norm (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return [float(x) for x in vector]
    packed = array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_base64(data: str) -> list[float]:
    """The inverse of ``encode_vector(..., "base64")`` (tests and clients)."""
    packed = array("f")
    packed.frombytes(base64.b64decode(data))
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def embedding_response(model: str, vectors: Sequence[Sequence[float]], encoding_format: str,
                       prompt_tokens: int) -> dict:
    """OpenAI's response body: ``{"object": "list", "data": [...], "model", "usage"}``."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
