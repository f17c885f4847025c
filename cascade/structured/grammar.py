"""An output contract as a grammar for llguidance, the one grammar engine of both tiers.

Why llguidance (over xgrammar and outlines-core): CPU wheels with no dependencies (abi3, no torch),
a token mask in tens of microseconds over Qwen's 152k vocabulary (measured here: 50-130 us), an
Earley parser that takes JSON Schema and Lark alike (a tool call is Lark around JSON), tokenizers
from llama.cpp's vocabulary and from Hugging Face's, and a refusal, not a silent drop, of the
keywords it cannot enforce ("Unimplemented keys: [...]"), which becomes our 400 naming them.

``grammar_of(contract)`` gives the grammar (a string for ``LLMatcher``) or None for free text:
- json_object / json_schema: the schema, written as Python's ``json.dumps`` writes (", " and
  ": ", no free whitespace, which a small model would otherwise fill with newlines);
- tools (tool_choice auto | required | a name): the Hermes format Qwen's template teaches,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, the arguments held to the
  function's parameter schema from the first byte of a call; "auto" also allows a text answer
  (or, with a response_format, the JSON answer) with the calls after it.
"""

from __future__ import annotations

import json

from cascade import errors
from cascade.structured.contract import LITERAL_KEYS, OutputContract
from cascade.structured.tools import CLOSE as CALL_CLOSE
from cascade.structured.tools import OPEN as CALL_OPEN

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(contract: OutputContract, special_tags: bool = False) -> str | None:
    """The llguidance grammar of ``contract``, or None when the answer is free text. ``special_tags``:
    the tokenizer has ``<tool_call>`` and ``</tool_call>`` as special tokens (Qwen's), which the
    grammar must then name as tokens: their bytes alone would be spelled out by other tokens."""
    from llguidance import LLMatcher

    if not contract.structured:
        return None
    answer = contract.answer_schema()
    if not contract.calls_tools:
        return LLMatcher.grammar_from_json_schema(_closed(answer), defaults=JSON_STYLE)
    return LLMatcher.grammar_from_lark(_tools_lark(contract, answer, special_tags))


def _tools_lark(contract: OutputContract, answer: dict | None, special_tags: bool) -> str:
    tools = contract.tools if contract.choice in ("auto", "required") else (contract.tool(contract.choice),)
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    call_schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    tag_open, tag_close = (CALL_OPEN, CALL_CLOSE) if special_tags else (json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE))
    lines = [f"call: {tag_open} \"\\n\" call_json \"\\n\" {tag_close}",
             f"call_json: %json {json.dumps(_styled(call_schema))}"]
    many = contract.parallel and contract.choice in ("auto", "required")
    lines.append('calls: call ("\\n" call)*' if many else "calls: call")
    if contract.choice != "auto":
        return "\n".join(["start: calls", *lines])
    if answer is not None:
        lines.append(f"answer: %json {json.dumps(_styled(answer))}")
    else:
        lines.append(r"answer: TEXT" "\n" r"TEXT: /(?s:[^<].*)/")  # a call's markup never starts a text answer
    return "\n".join(["start: answer | calls | answer \"\\n\" calls", *lines])


def _styled(schema: dict) -> dict:
    return {**_closed(schema), "x-guidance": JSON_STYLE}


OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _closed(node, depth: int = 0):
    """``node`` with every object that names its properties and says nothing of others closed to
    them: the grammar writes only the properties a schema names (any instance is still valid; a
    small model would otherwise pad its arguments with made-up keys until its token limit). Not
    where schemas combine into one object (``allOf``, a ``$ref`` beside properties,
    ``unevaluatedProperties``): closing each part alone would refuse what the whole allows."""
    if depth == 0 and _combines(node):
        return node
    if depth > 64:
        return node
    if isinstance(node, list):
        return [_closed(v, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in LITERAL_KEYS else _closed(v, depth + 1)) for k, v in node.items()}
    if isinstance(node.get("properties"), dict) and not any(k in node for k in OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _combines(node, depth: int = 0) -> bool:
    if depth > 64:
        return True
    if isinstance(node, list):
        return any(_combines(v, depth + 1) for v in node)
    if not isinstance(node, dict):
        return False
    if "allOf" in node or "unevaluatedProperties" in node or ("$ref" in node and "properties" in node):
        return True
    return any(_combines(v, depth + 1) for k, v in node.items() if k not in LITERAL_KEYS)


def check(grammar: str | None, param: str) -> None:
    """A 400 naming the keywords the grammar engine cannot enforce (or its other complaint)."""
    if grammar is None:
        return
    from llguidance import LLMatcher

    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=limits())
    if failed:
        message = messages[0] if messages else "the grammar engine refused it"
        code = "unsupported_schema_keyword" if "Unimplemented keys" in message else "invalid_schema"
        raise errors.bad_request(f"'{param}' cannot be enforced: {message[:300]}", param, code)


def contract_param(contract: OutputContract) -> str:
    """The field a refusal of ``contract``'s grammar names."""
    if contract.calls_tools:
        return "tools"
    return "response_format.json_schema.schema" if contract.format == "json_schema" else "response_format"


def limits():
    """Bounds on a grammar's compile and per-token work (llguidance's own fuel counters): a schema
    that would need more is refused, not computed for seconds."""
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                          max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)
