"""Tool calls in the model's text (the Hermes format Qwen's template teaches) and back.

A model answers a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
block per call. ``ToolCallParser`` reads the answer as it streams: text outside the blocks is
content, each closed block becomes a ``ToolCall`` (OpenAI's shape: an id, the name, the arguments
as a JSON string). A block that does not parse stays content (``problems`` says why), so a
malformed call is never lost, and the cascade can judge it (``validate.py``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cascade import wire
from cascade.structured.contract import TOOL_NAME

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_BYTES = 1 << 20
MAX_STREAMED_CALLS = 128


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Feed text as it comes (``feed``), then ``flush`` at the end; each returns (content, calls)."""

    def __init__(self):
        self._buf = ""
        self._in_call = False
        self._after_call = False
        self._seen_close = -1  # the last </tool_call> of the open call's text already tried
        self.calls: list[ToolCall] = []
        self.problems: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = [], []
        while True:
            if not self._in_call:
                if self._after_call:  # the newline between calls (or after the last) is the markup's
                    self._buf = self._buf.lstrip("\n")
                    self._after_call = not self._buf
                at = self._buf.find(OPEN)
                if at < 0:
                    # held back: what may start a call's tag, and the newlines that would go before it
                    keep = _partial_suffix(self._buf, OPEN)
                    keep += len(self._buf[:len(self._buf) - keep]) - len(self._buf[:len(self._buf) - keep].rstrip("\n"))
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:at].rstrip("\n"))
                self._buf = self._buf[at + len(OPEN):]
                self._in_call = True
            end = self._block_end()
            if end is None:
                if len(self._buf) > MAX_CALL_BYTES:
                    content.append(OPEN + self._buf)
                    self._buf, self._in_call = "", False
                break
            block, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
            self._seen_close = -1
            self._in_call, self._after_call = False, True
            call = self._call(block)
            if call is None:
                content.append(f"{OPEN}{block}{CLOSE}")
            elif not any((c.name, c.arguments) == (call.name, call.arguments) for c in self.calls + calls):
                calls.append(call)  # the same call twice in one answer is one call (small models loop)
        self.calls.extend(calls)
        return "".join(content), calls

    def _block_end(self) -> int | None:
        """Where the open call's text ends (its ``</tool_call>``), or None while it may still grow. The
        call's JSON is read first, so a ``</tool_call>`` inside one of its strings does not end it;
        tried again only when a new ``</tool_call>`` has come (no re-read per token)."""
        buf = self._buf
        at = buf.find(CLOSE, self._seen_close + 1)
        if at < 0:
            return None
        self._seen_close = at
        start = len(buf) - len(buf.lstrip())
        try:
            _, end = _DECODER.raw_decode(buf, start)
        except json.JSONDecodeError as e:
            if e.pos >= len(buf) or e.msg.startswith("Unterminated string"):
                return None  # the JSON goes on past what has come
            return buf.find(CLOSE)  # not JSON: the block ends at its first close tag
        gap = len(buf[end:]) - len(buf[end:].lstrip())
        if buf.startswith(CLOSE, end + gap):
            return end + gap
        return buf.find(CLOSE, end) if buf.find(CLOSE, end) >= 0 else None

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The rest: an unclosed call's text (cut off) is content, unless whole calls came before it
        (a small model that repeats its calls until its token limit: the whole ones are the answer)."""
        rest = (OPEN + self._buf) if self._in_call else self._buf
        if self._in_call:
            self.problems.append("a tool call was cut off before </tool_call>")
            if self.calls:
                rest = ""
        self._buf, self._in_call = "", False
        return rest, []

    def _call(self, block: str) -> ToolCall | None:
        try:
            obj = wire.loads(block.strip(), limit=MAX_CALL_BYTES)
        except wire.WireError as e:
            self.problems.append(f"a tool call is not JSON: {e}")
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self.problems.append("a tool call has no \"name\"")
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = wire.loads(args, limit=MAX_CALL_BYTES)
            except wire.WireError:
                self.problems.append(f"the arguments of {obj['name']!r} are not JSON")
                return None
        return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_markup(name: str, arguments: str | dict) -> str:
    """A call as the model writes it (the assistant's earlier calls, rendered back into a prompt)."""
    if isinstance(arguments, str):
        try:
            arguments = wire.loads(arguments, limit=MAX_CALL_BYTES)
        except wire.WireError:
            pass  # kept as the string it was
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def tools_system_prompt(tools: list[dict]) -> str:
    """The tools, for a model whose template has no place for them (Qwen's own wording)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listing}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class StreamedCalls:
    """A chat stream's ``delta.tool_calls`` (a cloud's: outside data), assembled by index (a call's
    name, then its arguments in pieces), taken as the model's call markup once the choice finishes.
    ValueError for a delta that is not a call, a name that is not a function's name, more than
    ``MAX_STREAMED_CALLS`` calls or more than ``MAX_CALL_BYTES`` of a call's arguments."""

    def __init__(self):
        self._calls: dict[int, list[str]] = {}

    def add(self, deltas) -> None:
        for d in deltas if isinstance(deltas, list) else []:
            index = d.get("index", 0) if isinstance(d, dict) else None
            fn = d.get("function") if isinstance(d, dict) else None
            if type(index) is not int or not 0 <= index < MAX_STREAMED_CALLS or not isinstance(fn, dict):
                raise ValueError("a tool call delta without an index or a function")
            call = self._calls.setdefault(index, ["", ""])
            if isinstance(fn.get("name"), str):
                call[0] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                call[1] += fn["arguments"]
            if len(call[0]) > 64 or len(call[1]) > MAX_CALL_BYTES:
                raise ValueError("a tool call's name or arguments past their bound")

    def take(self) -> list[str]:
        for name, _ in self._calls.values():
            if not TOOL_NAME.match(name):
                raise ValueError(f"a tool call names no function: {name[:64]!r}")
        out = [call_markup(name, args or "{}") for _, (name, args) in sorted(self._calls.items())]
        self._calls.clear()
        return out
