"""Chat prompts: the model's own Jinja template from GGUF metadata, or a plain transcript for
base models that carry none (Gemma 3 270M as shipped is a base model)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Base models get a transcript; generation stops where the model starts the next user turn.
TRANSCRIPT_STOPS = ("\nUser:", "\nuser:", "\n\nUser")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this model's template."""


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = template
        self._bos, self._eos = bos_token, eos_token
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)

    @property
    def is_transcript(self) -> bool:
        return self._template is None

    @property
    def knows_tools(self) -> bool:
        """The template renders ``tools`` and assistant ``tool_calls`` itself (Qwen's does)."""
        return self.source is not None and "tools" in self.source and "tool_call" in self.source

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None) -> str:
        """``messages``: dicts with role and content, and for tool use (``chat_messages``) an
        assistant's ``tool_calls`` and a tool answer's ``tool_call_id``; ``tools``: OpenAI's tool
        objects, rendered by the template when it knows them, else as a system message."""
        msgs = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        if not self.knows_tools:
            msgs = _tools_as_text(msgs, tools)
            tools = None
        if self._template is None:
            return _transcript(msgs)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=True, bos_token=self._bos,
                                         eos_token=self._eos, **({"tools": list(tools)} if tools else {}))
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from e

    def stop_strings(self) -> tuple[str, ...]:
        return TRANSCRIPT_STOPS if self._template is None else ()


def chat_messages(messages) -> list[dict[str, Any]]:
    """A request's ``ChatMessage``s as the dicts templates take: the text, and for tool use the
    assistant's calls (arguments as objects, as Qwen's template writes them) and ``tool_call_id``."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str):
    from cascade import wire

    try:
        return wire.loads(text, limit=1 << 20)
    except wire.WireError:
        return text


def _tools_as_text(messages: list[dict], tools: Sequence[dict] | None) -> list[dict]:
    """For a template with no place for tools: the tools in a system message, earlier calls as the
    model's markup, tool answers as a tool turn's text."""
    from cascade.structured.tools import call_markup, tools_system_prompt

    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(call_markup(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    if tools:
        prompt = tools_system_prompt(list(tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _raise(message: str):
    raise TemplateError(message)


def _transcript(messages: list[dict[str, str]]) -> str:
    names = {"user": "User", "assistant": "Assistant", "tool": "Tool"}
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"{m['content']}\n")
        else:
            parts.append(f"{names[m['role']]}: {m['content']}")
    parts.append("Assistant:")
    return "\n".join(parts)
