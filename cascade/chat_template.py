"""Chat prompts: the model's own Jinja template from GGUF metadata, or a plain transcript for
base models that carry none (Gemma 3 270M as shipped is a base model)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

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

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        msgs = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                for m in messages]
        if self._template is None:
            return _transcript(msgs)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=True,
                                         bos_token=self._bos, eos_token=self._eos)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from e

    def stop_strings(self) -> tuple[str, ...]:
        return TRANSCRIPT_STOPS if self._template is None else ()


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
