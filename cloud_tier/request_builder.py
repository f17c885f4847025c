"""OpenAI request -> (prompt token ids, sampling params): the one translation the worker and the
gateway share, so both validate a request the same way (the gateway before routing it, the
worker when it is called directly). Needs the model's tokenizer, not the model."""

from __future__ import annotations

import dataclasses
import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cascade import errors
from cascade.chat_template import ChatTemplate, ChatTemplateError, chat_messages
from cascade.protocol import INT32, PRIORITY_CLASSES, ChatCompletionRequest, CompletionRequest
from cascade.structured.contract import TEXT, OutputContract, contract_of
from cascade.structured.grammar import check, contract_param, grammar_of
from cascade.structured.tools import CLOSE, OPEN
from cloud_tier.draft import Draft, DraftError, draft_of
from cloud_tier.sampling import SamplingParams


@dataclass(frozen=True)
class RequestPlan:
    """A validated request, ready for an engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    logprobs: int | None  # top-k wanted per token (None: no logprobs)
    priority: int = 0
    # its service level, from the body (priority_class, ttft_slo_s, tpot_slo_s, timeout: seconds for the
    # whole answer); a server may add its defaults and the X-Cascade-* headers (see ``service_level``)
    priority_class: str = "interactive"
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    timeout_s: float | None = None
    draft: Draft | None = None  # the device's tokens to verify (its tokenizer matched ours)
    contract: OutputContract = TEXT  # the answer's shape (response_format, tools): params.guided holds its grammar

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most it may generate: the KV it can need at its peak."""
        return len(self.prompt_token_ids) + self.params.max_tokens


class RequestBuilder:
    def __init__(self, tokenizer, max_model_len: int, default_max_tokens: int = 512, tokenizer_identity: str = "",
                 model_vocab_size: int = 0):
        """``tokenizer_identity``: this model's (``model_distribution.artifacts.tokenizer_identity``);
        a request's draft is used only when it names the same ("": never). ``model_vocab_size``: the
        ids the model can produce (its embedding rows, often past the tokenizer's: a draft may hold
        them); 0: the tokenizer's."""
        self.tokenizer = tokenizer
        self.tokenizer_identity = tokenizer_identity
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.template = ChatTemplate(getattr(tokenizer, "chat_template", None), tokenizer.bos_token or "",
                                     tokenizer.eos_token or "")
        self._bos = tokenizer.bos_token_id
        self._adds_bos = self._bos is not None and tokenizer.encode("a")[:1] == [self._bos]
        self._vocab = len(tokenizer)
        self.draft_vocab = max(self._vocab, model_vocab_size)
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self.special_tool_tags = OPEN in added and CLOSE in added  # Qwen's: named as tokens in a grammar

    def chat(self, req: ChatCompletionRequest) -> RequestPlan:
        contract = contract_of(req, "chat")
        tools = [t.openai() for t in contract.tools] if contract.calls_tools else None
        try:
            prompt = self.template.render(chat_messages(req.messages), tools)
        except ChatTemplateError as e:
            raise errors.bad_request(str(e), "messages") from e
        tokens = self.tokenizer.encode(prompt, add_special_tokens=False)
        if self._adds_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        stops = tuple(req.stop_list()) + self.template.stop_strings()
        k = (req.top_logprobs or 0) if req.logprobs else None
        return self._plan(req, tokens, req.token_limit(), stops, k, "messages", contract)

    def completion(self, req: CompletionRequest) -> RequestPlan:
        contract = contract_of(req, "completions")
        if isinstance(req.prompt, str):
            tokens = self.tokenizer.encode(req.prompt)
        else:
            tokens = list(req.prompt)
            if not tokens or any(not 0 <= t < self._vocab for t in tokens):
                raise errors.bad_request(f"prompt token ids must be non-empty and in [0, {self._vocab})", "prompt")
        return self._plan(req, tokens, req.token_limit(), tuple(req.stop_list()), req.logprobs, "prompt", contract)

    def grammar(self, contract: OutputContract) -> str | None:
        """``contract``'s grammar for our engine (None: free text); a 400 naming the keywords it cannot
        enforce."""
        grammar = grammar_of(contract, self.special_tool_tags)
        check(grammar, contract_param(contract))
        return grammar

    def _plan(self, req, tokens: list[int], max_tokens: int | None, stops: tuple[str, ...],
              logprobs: int | None, prompt_param: str, contract: OutputContract = TEXT) -> RequestPlan:
        n_ctx = self.max_model_len
        if len(tokens) >= n_ctx:
            raise errors.bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, your {prompt_param} "
                f"resulted in {len(tokens)} tokens.", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, n_ctx - len(tokens))
        elif len(tokens) + max_tokens > n_ctx:
            raise errors.bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the {prompt_param}, {max_tokens} in "
                f"the completion).", "max_tokens", "context_length_exceeded")
        extra = req.model_extra or {}
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                seed=req.seed, stop=stops, logprobs=logprobs,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                ignore_eos=_extra(extra, "ignore_eos", False, lambda v: isinstance(v, bool), "a boolean"),
                stop_token_ids=tuple(_extra(extra, "stop_token_ids", [], lambda v: isinstance(v, list) and all(
                    _int32(t) and t >= 0 for t in v), "a list of token ids")),
                guided=self.grammar(contract))
            priority = _extra(extra, "priority", 0, _int32, "an integer in [-2**31, 2**31)")
            priority_class = _extra(extra, "priority_class", "interactive", PRIORITY_CLASSES.__contains__,
                                    f"one of {', '.join(PRIORITY_CLASSES)}")
            ttft, tpot, timeout = (_extra(extra, name, None, _seconds, "a number of seconds > 0")
                                   for name in ("ttft_slo_s", "tpot_slo_s", "timeout"))
        except (ValueError, TypeError) as e:
            raise errors.bad_request(str(e)) from e
        try:
            draft = draft_of(req.cascade.draft if req.cascade else None, self.tokenizer_identity, self.draft_vocab)
        except DraftError as e:
            raise errors.bad_request(f"Invalid draft: {e}", e.param, "invalid_draft") from e
        return RequestPlan(tokens, params, logprobs, priority, priority_class, ttft, tpot, timeout, draft, contract)


def with_headers(plan: RequestPlan, headers: Mapping[str, str], wall: float | None = None) -> RequestPlan:
    """``plan`` under the headers ``X-Cascade-Priority`` (a class: see ``priority_class_of``)
    and ``X-Cascade-Deadline`` (seconds from now, or an absolute time: a Unix timestamp or an HTTP
    date); the earlier of the body's ``timeout`` and the header's deadline wins. 400 on a bad one."""
    priority_class = priority_class_of(headers.get("x-cascade-priority"), plan.priority_class)
    timeout = plan.timeout_s
    if (raw := headers.get("x-cascade-deadline")) is not None:
        left = deadline_seconds(raw, wall)
        timeout = left if timeout is None else min(timeout, left)
    if (priority_class, timeout) == (plan.priority_class, plan.timeout_s):
        return plan
    return dataclasses.replace(plan, priority_class=priority_class, timeout_s=timeout)


def priority_class_of(header: str | None, body_value: object) -> str:
    """The class a request runs in: the lower standing of the header's and the body's (a request
    can only lower its own standing, whoever labels it: the edge agent marks its escalations with
    the header whatever the app's body says); interactive when neither names one. A value that is
    not a class is a 400 naming where it came from."""
    classes = ["interactive"]
    if header is not None:
        classes.append(_class(header.strip().lower(), "X-Cascade-Priority"))
    if body_value is not None:
        classes.append(_class(body_value, "priority_class"))
    return max(classes, key=PRIORITY_CLASSES.index)


def _class(value: object, param: str) -> str:
    if value not in PRIORITY_CLASSES:
        raise errors.bad_request(f"Invalid value for '{param}': {str(value)[:40]!r}; expected one of "
                                 f"{', '.join(PRIORITY_CLASSES)}.", param, "invalid_value")
    return value


def deadline_seconds(raw: str, wall: float | None = None) -> float:
    """Seconds left until the deadline an ``X-Cascade-Deadline`` header gives: a number of seconds
    (a relative timeout), a Unix timestamp (a number over 10^9) or an HTTP date. A deadline already
    past gives 0: the request ends at once with nothing (finish "length"). 400 otherwise."""
    wall = time.time() if wall is None else wall
    try:
        value = float(raw)
    except ValueError:
        try:
            value = email.utils.parsedate_to_datetime(raw).timestamp()
        except (TypeError, ValueError, IndexError):
            value = math.nan
    if not math.isfinite(value) or value < 0:
        raise errors.bad_request(f"Invalid X-Cascade-Deadline {raw[:60]!r}: give seconds from now, a Unix "
                                 "timestamp or an HTTP date.", "X-Cascade-Deadline", "invalid_value")
    return max(0.0, value - wall) if value > 1e9 else value


def check_slo_floors(extra: Mapping, min_ttft_s: float, min_tpot_s: float) -> None:
    """A 400 naming ``ttft_slo_s`` or ``tpot_slo_s`` when the body (its extra fields, ``extra``)
    asks a target tighter than the floor its tenant may ask (0: none), or one that is no number of
    seconds. A target under the floor is refused, not raised to it: the client learns what it
    will get. (Our workers serve no TPOT target tighter than their own floor whatever a gateway
    lets through.)"""
    for name, floor in (("ttft_slo_s", min_ttft_s), ("tpot_slo_s", min_tpot_s)):
        value = _extra(extra, name, None, _seconds, "a number of seconds > 0")
        if value is not None and value < floor:
            raise errors.bad_request(f"Invalid value for '{name}': {value:g} s is tighter than this API key may ask; "
                                     f"ask {floor:g} s or more.", name, "slo_below_floor")


def _seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9


def _int32(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and INT32[0] <= v <= INT32[1]


def _extra(extra: dict, name: str, default, valid, what: str):
    """An extra body field our engine takes (vLLM's names), checked: a 400 naming it otherwise."""
    value = extra.get(name, default)
    if value is None:
        return default
    if not valid(value):
        raise errors.bad_request(f"Invalid value for '{name}': it must be {what}, not {str(value)[:60]}.", name,
                                 "invalid_value")
    return value
