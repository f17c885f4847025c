"""OpenAI-compatible wire types shared by the edge agent and the cloud tier.

Requests are validated here (shape, ranges); what depends on a model (context length, known
model names) is checked by the service that serves it. Extra fields that OpenAI clients send
and we do not use are accepted and ignored, as OpenAI does for unknown-but-harmless fields.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
INT32 = (-(2**31), 2**31 - 1)  # what the queue and the engines store a priority in
# a request's priority class, served in this order (and preempted in the reverse): the app's own
# requests, the edge agents' escalations, the Batch API's lines
PRIORITY_CLASSES = ("interactive", "escalation", "batch")
INT64 = (-(2**63), 2**63 - 1)
Count = Annotated[int, Field(ge=1, le=INT32[1])]  # a number of tokens: positive, within 32 bits
TokenId = Annotated[int, Field(ge=INT32[0], le=INT32[1])]  # checked against the vocabulary where it runs
MAX_TTL_S = 365 * 24 * 3600.0
COSTLY_PROMPT_CHARS = 16 << 10  # a prompt past this is planned off the event loop


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=128)] | None = None  # assistant turns
    tool_call_id: Annotated[str, Field(max_length=128)] | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_DRAFT_TOKENS = 64
MAX_DRAFT_TOP = 64
Probability = Annotated[float, Strict(), Field(ge=0.0, le=1.0)]
DraftToken = Annotated[int, Strict(), Field(ge=0, le=INT32[1])]  # "2" or 2.0 is not a token id


class DraftOptions(BaseModel):
    """``cascade.draft``: the tokens the device already generated for this request (its hold-back),
    offered to the cloud to verify instead of starting over. Used only by a worker whose tokenizer
    identity equals ``tokenizer``; elsewhere the request runs as if it had none.

    ``probs``: the device's probability of each drafted token under its own sampling distribution
    (1.0 for a greedy device); ``top``: per position, that distribution as (token id, probability)
    pairs, for exact speculative sampling (where it covers the whole distribution)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    token_ids: Annotated[list[DraftToken], Field(min_length=1, max_length=MAX_DRAFT_TOKENS)]
    probs: list[Probability] | None = None
    top: list[Annotated[list[tuple[DraftToken, Probability]], Field(max_length=MAX_DRAFT_TOP)]] | None = None
    tokenizer: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[0-9A-Za-z:._-]+$")]

    @model_validator(mode="after")
    def _lengths(self) -> DraftOptions:
        for name in ("probs", "top"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.token_ids):
                raise ValueError(f"cascade.draft.{name} has {len(value)} entries for {len(self.token_ids)} "
                                 "token_ids")
        return self


class CascadeOptions(BaseModel):
    """The ``cascade`` extra body field: how this request may move between tiers."""

    mode: Literal["auto", "local", "cloud"] | None = None
    offline: Literal["queue", "local", "fail"] | None = None
    hint: Literal["easy", "hard"] | None = None  # the app's own judgement of the request
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")  # a typo ("modee") is a 400, not ignored

    latency_budget_s: Annotated[float, Field(gt=0, le=MAX_TTL_S)] | None = None  # for the overflow rule
    # the offline queue (used when the cloud cannot be reached)
    session: Annotated[str, Field(min_length=1, max_length=255)] | None = None  # queued items of a session keep order
    refine: bool = False  # offline "local": also queue the request for the cloud's answer
    callback_url: Annotated[str, Field(max_length=2048)] | None = None  # POSTed to when the queued request ends
    priority: Annotated[int, Field(ge=INT32[0], le=INT32[1])] = 0  # queued: higher is sent first
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S)] | None = None  # queued: expires if not delivered by then
    draft: DraftOptions | None = None  # an escalation's draft tokens, for the cloud to verify


MAX_PASSTHROUGH_DEPTH = 32


def _check_passthrough(value: Any, path: str, depth: int = 0) -> None:
    """Raise ValueError unless ``value`` holds only 64-bit integers, finite floats and UTF-8 strings."""
    if depth > MAX_PASSTHROUGH_DEPTH:
        raise ValueError(f"{path}: nested deeper than {MAX_PASSTHROUGH_DEPTH} levels")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if not INT64[0] <= value <= INT64[1]:
            raise ValueError(f"{path}: the integer {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: numbers must be finite")
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path}: the string is not valid UTF-8 (a lone surrogate)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_passthrough(k, f"{path}.<key>", depth + 1)
            _check_passthrough(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_passthrough(v, f"{path}[{i}]", depth + 1)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32[1])] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    user: str | None = None
    cascade: CascadeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _extras_are_safe(self) -> _SamplingFields:
        # fields we do not use pass through (to the cloud, into the offline queue): they must still be
        # what JSON and SQLite can carry, so one absurd value is a 400 here, not a failure downstream
        for name, value in (self.model_extra or {}).items():
            _check_passthrough(value, name)
        return self

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def costly_to_plan(self) -> bool:
        """Rendering and tokenizing it (and compiling its grammar) may take long enough to plan it off
        the event loop: a schema or tools, or a long text (a server's other requests must not wait)."""
        extra = self.model_extra or {}
        if extra.get("tools") or extra.get("response_format"):
            return True
        text = self.prompt if isinstance(getattr(self, "prompt", None), str) else ""
        for m in getattr(self, "messages", ()):
            text_len = len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
            if text_len > COSTLY_PROMPT_CHARS:
                return True
        return len(text) > COSTLY_PROMPT_CHARS or len(getattr(self, "messages", ())) > 64

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.messages[-1].role == "assistant" and len(self.messages) == 1:
            raise ValueError("messages must contain at least one non-assistant message")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise ValueError(f"messages[{i}] has role 'tool' without the 'tool_call_id' of the call it answers")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=1)])
    max_tokens: Count | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            v = v[0]  # a batch of one prompt (which must not be empty either)
        if isinstance(v, str) and v == "":
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def token_limit(self) -> int | None:
        return self.max_tokens


# ---- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict] | None = None  # OpenAI's shape: id, type "function", function {name, arguments}


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    cascade: dict[str, Any] | None = None  # which tier answered and why (edge agent)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # each with its ``index``; a call is sent whole in one delta


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    cascade: dict[str, Any] | None = None  # on the final chunk


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    cascade: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cascade"
    meta: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
