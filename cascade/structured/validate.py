"""Does an answer keep its contract? The cascade's check before an edge answer reaches the app:
a JSON answer must parse and meet its schema (jsonschema, with string formats checked); a tool
call must name a given tool and its arguments meet that tool's parameter schema. Returns the
first problem, "" when the answer keeps the contract."""

from __future__ import annotations

import functools

from cascade import wire
from cascade.structured.contract import OutputContract
from cascade.structured.tools import ToolCallParser

MAX_ANSWER_BYTES = 4 << 20
PATTERN_TIMEOUT_S = 0.05  # one pattern against one string; a pattern that needs longer is not held against it


def problem(contract: OutputContract, text: str) -> str:
    """Why ``text`` (a whole answer) breaks ``contract``, or ""."""
    if not contract.structured:
        return ""
    parser = ToolCallParser() if contract.calls_tools else None
    content = text
    if parser is not None:
        head, _ = parser.feed(text)
        tail, _ = parser.flush()
        content = head + tail
        if parser.problems:
            return parser.problems[0]
        for call in parser.calls:
            if (why := _call_problem(contract, call)):
                return why
        if contract.choice != "auto" and not parser.calls:
            return f"tool_choice {contract.choice!r} asks for a call and the answer has none"
        if parser.calls and not contract.parallel and len(parser.calls) > 1:
            return "parallel_tool_calls is false and the answer has several calls"
        if parser.calls and not content.strip():
            return ""
    schema = contract.answer_schema()
    if schema is None:
        return ""
    return _json_problem(content, schema, "the answer")


def _call_problem(contract: OutputContract, call) -> str:
    tool = contract.tool(call.name)
    if tool is None or (contract.choice not in ("auto", "required") and call.name != contract.choice):
        return f"the answer calls {call.name[:64]!r}, which it may not"
    return _json_problem(call.arguments, tool.parameters, f"the arguments of {call.name!r}")


def _json_problem(text: str, schema: dict, what: str) -> str:
    try:
        value = wire.loads(text.strip(), limit=MAX_ANSWER_BYTES)
    except wire.WireError as e:
        return f"{what} is not JSON ({e.reason})"
    from jsonschema import FormatChecker
    from referencing.exceptions import Unresolvable

    try:
        validator = _checker(schema)(schema, format_checker=FormatChecker())
        error = next(iter(validator.iter_errors(value)), None)
    except (Unresolvable, RecursionError) as e:
        return f"{what} cannot be checked against its schema: {str(e)[:200]}"
    if error is None:
        return ""
    where = "/".join(str(p) for p in error.absolute_path) or "root"
    return f"{what} does not meet its schema at {where}: {error.message[:200]}"


def _checker(schema: dict):
    """The schema's validator class with ``pattern`` and ``patternProperties`` matched by the
    ``regex`` module under a time limit: Python's ``re`` backtracks exponentially on some patterns
    (an app's schema is outside data), and reads POSIX classes (``[[:alpha:]]``) as llguidance does not."""
    from jsonschema.validators import validator_for

    return _bounded(validator_for(schema))


@functools.cache
def _bounded(base):
    from jsonschema.validators import extend

    return extend(base, {"pattern": _pattern, "patternProperties": _pattern_properties})


def _search(pattern: str, text: str) -> bool | None:
    """Whether ``pattern`` matches in ``text``; None when it cannot be told in time (or compiled)."""
    import regex

    try:
        return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None
    except (TimeoutError, regex.error):
        return None


def _pattern(validator, pattern, instance, schema):
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and _search(pattern, instance) is False:
        yield ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)
