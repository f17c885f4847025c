"""OpenAI request -> (prompt token ids, sampling params): the one translation the worker and the
gateway share, so both validate a request the same way (the gateway before routing it, the
worker when it is called directly). Needs the model's tokenizer, not the model."""

from __future__ import annotations

from dataclasses import dataclass

from cascade import errors
from cascade.chat_template import ChatTemplate, ChatTemplateError
from cascade.protocol import INT32, ChatCompletionRequest, CompletionRequest
from cloud_tier.sampling import SamplingParams


@dataclass(frozen=True)
class Plan:
    """A validated request, ready for an engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    logprobs: int | None  # top-k wanted per token (None: no logprobs)
    priority: int = 0

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most it may generate: the KV it can need at its peak."""
        return len(self.prompt_token_ids) + self.params.max_tokens


class RequestBuilder:
    def __init__(self, tokenizer, max_model_len: int, default_max_tokens: int = 512):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.template = ChatTemplate(getattr(tokenizer, "chat_template", None), tokenizer.bos_token or "",
                                     tokenizer.eos_token or "")
        self._bos = tokenizer.bos_token_id
        self._adds_bos = self._bos is not None and tokenizer.encode("a")[:1] == [self._bos]
        self._vocab = len(tokenizer)

    def chat(self, req: ChatCompletionRequest) -> Plan:
        try:
            prompt = self.template.render([{"role": m.role, "content": m.text()} for m in req.messages])
        except ChatTemplateError as e:
            raise errors.bad_request(str(e), "messages") from e
        tokens = self.tokenizer.encode(prompt, add_special_tokens=False)
        if self._adds_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        stops = tuple(req.stop_list()) + self.template.stop_strings()
        k = (req.top_logprobs or 0) if req.logprobs else None
        return self._plan(req, tokens, req.token_limit(), stops, k, "messages")

    def completion(self, req: CompletionRequest) -> Plan:
        if isinstance(req.prompt, str):
            tokens = self.tokenizer.encode(req.prompt)
        else:
            tokens = list(req.prompt)
            if not tokens or any(not 0 <= t < self._vocab for t in tokens):
                raise errors.bad_request(f"prompt token ids must be non-empty and in [0, {self._vocab})", "prompt")
        return self._plan(req, tokens, req.token_limit(), tuple(req.stop_list()), req.logprobs, "prompt")

    def _plan(self, req, tokens: list[int], max_tokens: int | None, stops: tuple[str, ...],
              logprobs: int | None, prompt_param: str) -> Plan:
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
                    _int32(t) and t >= 0 for t in v), "a list of token ids")))
            priority = _extra(extra, "priority", 0, _int32, "an integer in [-2**31, 2**31)")
        except (ValueError, TypeError) as e:
            raise errors.bad_request(str(e)) from e
        return Plan(tokens, params, logprobs, priority)


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
