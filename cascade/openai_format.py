"""Generation events -> OpenAI response bodies and SSE chunks (chat and legacy completions)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from cascade.generation import Finish, TokenEvent
from cascade.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from cascade.structured.contract import wants_tool_calls
from cascade.structured.tools import ToolCall, ToolCallParser

DONE = "data: [DONE]\n\n"


def sse(payload) -> str:
    data = payload.model_dump_json(exclude_none=True) if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def _token_logprob(ev: TokenEvent) -> TokenLogprob:
    return TokenLogprob(
        token=ev.piece.decode("utf-8", errors="replace"), logprob=ev.logprob, bytes=list(ev.piece),
        top_logprobs=[TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.bytes)) for t in ev.top],
    )


def usage_of(finish: Finish) -> Usage:
    return Usage.of(finish.prompt_tokens, finish.completion_tokens)


def cascade_of(base: dict | None, finish: Finish | None) -> dict | None:
    """The response's ``cascade`` object: the edge agent's (tier, reason), ``truncated`` when the
    answer was cut short ("deadline"), and ``draft`` (tokens offered, accepted) when the engine
    verified a device's draft."""
    if finish is None or not (finish.truncated or finish.draft_offered):
        return base
    out = dict(base or {})
    if finish.truncated:
        out["truncated"] = finish.truncated
    if finish.draft_offered:
        out["draft"] = {"offered": finish.draft_offered, "accepted": finish.draft_accepted}
    return out


class ChatFormatter:
    """``tool_calls``: the request may be answered with tool calls: the model's call markup
    (``cascade.structured.tools``) becomes OpenAI ``tool_calls``, each streamed whole in one delta,
    and a finish after calls is "tool_calls"."""

    def __init__(self, model: str, logprobs: bool, tool_calls: bool = False):
        self.id = new_id("chatcmpl")
        self.created = now()
        self.model = model
        self.logprobs = logprobs
        self.cascade: dict | None = None  # set by the edge agent: goes on the final chunk / body
        self._calls = ToolCallParser() if tool_calls else None

    def _chunk(self, delta: DeltaMessage, events: Sequence[TokenEvent] = (), finish: Finish | None = None,
               usage: Usage | None = None) -> str:
        lp = ChoiceLogprobs(content=[_token_logprob(e) for e in events]) if self.logprobs and events else None
        choice = ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=finish.finish_reason if finish else None)
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                       usage=usage, cascade=cascade_of(self.cascade, finish) if finish else None))

    def first_chunk(self) -> str:
        return self._chunk(DeltaMessage(role="assistant", content=""))

    def token_chunk(self, ev: TokenEvent) -> str | None:
        if self._calls is not None:
            content, calls = self._calls.feed(ev.text)
            out = self._chunk(DeltaMessage(content=content), [ev]) if content or self.logprobs else ""
            return (out + self._call_chunks(calls)) or None
        if not ev.text and not self.logprobs:
            return None  # held back for a stop-string check; released later
        return self._chunk(DeltaMessage(content=ev.text), [ev])

    def _call_chunks(self, calls: list[ToolCall]) -> str:
        first = len(self._calls.calls) - len(calls)
        return "".join(self._chunk(DeltaMessage(tool_calls=[c.openai(first + i)])) for i, c in enumerate(calls))

    def _finish_calls(self, finish: Finish) -> tuple[str, str, Finish]:
        """(the rest of the content, the last calls' chunks, the finish) at the end of a tool-call answer."""
        head, calls = self._calls.feed(finish.text)
        tail, _ = self._calls.flush()
        if self._calls.calls and finish.finish_reason == "stop":
            finish = dataclasses.replace(finish, finish_reason="tool_calls")
        return head + tail, self._call_chunks(calls), finish

    def final_chunks(self, finish: Finish, include_usage: bool) -> list[str]:
        usage = usage_of(finish)
        text, calls = finish.text, ""
        if self._calls is not None:
            text, calls, finish = self._finish_calls(finish)
        out = [calls] if calls else []
        out.append(self._chunk(DeltaMessage(content=text or None), finish=finish, usage=usage))
        if include_usage:
            out.append(sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                               choices=[], usage=usage)))
        return out

    def response(self, events: list[TokenEvent], finish: Finish) -> ChatCompletion:
        text = "".join(e.text for e in events) + finish.text
        lp = ChoiceLogprobs(content=[_token_logprob(e) for e in events]) if self.logprobs else None
        message = ResponseMessage(content=text)
        if self._calls is not None:
            text, _, finish = self._finish_calls(dataclasses.replace(finish, text=text))
            calls = [c.openai() for c in self._calls.calls]
            message = ResponseMessage(content=text or (None if calls else ""), tool_calls=calls or None)
        choice = ChatChoice(message=message, logprobs=lp, finish_reason=finish.finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=usage_of(finish), cascade=cascade_of(self.cascade, finish))


class CompletionFormatter:
    def __init__(self, model: str, logprobs: int | None):
        self.cascade: dict | None = None
        self.id = new_id("cmpl")
        self.created = now()
        self.model = model
        self.logprobs = logprobs
        self._offset = 0

    def _logprobs(self, events: Sequence[TokenEvent]) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogprobs()
        for e in events:
            token = e.piece.decode("utf-8", errors="replace")
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({t.text: t.logprob for t in e.top})
            out.text_offset.append(self._offset)
            self._offset += len(e.text)
        return out

    def _chunk(self, text: str, events: Sequence[TokenEvent] = (), finish: Finish | None = None,
               usage: Usage | None = None) -> str:
        choice = CompletionChoice(text=text, logprobs=self._logprobs(events) if events else None,
                                  finish_reason=finish.finish_reason if finish else None)
        return sse(Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=usage, cascade=cascade_of(self.cascade, finish) if finish else None))

    def first_chunk(self) -> str | None:
        return None

    def token_chunk(self, ev: TokenEvent) -> str | None:
        if not ev.text and self.logprobs is None:
            return None
        return self._chunk(ev.text, [ev])

    def final_chunks(self, finish: Finish, include_usage: bool) -> list[str]:
        usage = usage_of(finish)
        out = [self._chunk(finish.text, finish=finish, usage=usage)]
        if include_usage:
            out.append(sse(Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                      usage=usage)))
        return out

    def response(self, events: list[TokenEvent], finish: Finish) -> Completion:
        text = "".join(e.text for e in events) + finish.text
        choice = CompletionChoice(text=text, logprobs=self._logprobs(events),
                                  finish_reason=finish.finish_reason)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                          usage=usage_of(finish), cascade=cascade_of(self.cascade, finish))


def formatter_for(endpoint: str, model: str, req) -> ChatFormatter | CompletionFormatter:
    """The formatter of ``req``'s answer on ``endpoint`` ("chat" | "completions"): tool calls parsed
    where the request allows them."""
    if endpoint == "chat":
        return ChatFormatter(model, req.logprobs, tool_calls=wants_tool_calls(req))
    return CompletionFormatter(model, req.logprobs)
