"""What a request asks of its answer's shape: ``response_format``, ``tools``, ``tool_choice`` and
``parallel_tool_calls``, read from the OpenAI body and checked once, the same way on both tiers.

``contract_of(req)`` gives an ``OutputContract`` or raises a 400 naming the field: an unknown
``response_format`` type, a schema that is not a JSON object or not a valid JSON Schema, one
larger than ``MAX_SCHEMA_BYTES``, an enum longer than ``MAX_ENUM``, a recursion that no finite
instance ends (``recursion.py``), tools with duplicate or malformed names, a ``tool_choice``
naming no tool. Whether the grammar engine can enforce a valid schema is ``grammar.check``'s.
Pure: no grammar engine here (jsonschema checks the schema against its meta-schema).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from cascade import errors
from cascade.structured.recursion import unbounded_recursion

MAX_SCHEMA_BYTES = 64 << 10  # a schema (or one tool's parameters) as JSON
MAX_ENUM = 1024  # values in one enum
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
FORMATS = ("text", "json_object", "json_schema")
CHOICES = ("none", "auto", "required")
LITERAL_KEYS = ("enum", "const", "default", "examples")  # their values are data, not schemas: never walked


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON Schema of the arguments object

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class OutputContract:
    """``format``: text | json_object | json_schema; ``schema``: the json_schema's; ``choice``:
    none | auto | required | a tool's name (tools given); ``parallel``: more than one call allowed."""

    format: str = "text"
    schema: dict | None = None
    schema_name: str = ""
    tools: tuple[Tool, ...] = ()
    choice: str = "none"
    parallel: bool = True
    digest: str = field(default="", compare=False)

    @property
    def calls_tools(self) -> bool:
        """The answer may hold tool calls (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.choice != "none"

    @property
    def structured(self) -> bool:
        """The answer's shape is constrained: JSON, or tool calls."""
        return self.format != "text" or self.calls_tools

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def answer_schema(self) -> dict | None:
        """The schema a text answer must meet (None: any text)."""
        if self.format == "json_schema":
            return self.schema
        return {"type": "object"} if self.format == "json_object" else None


TEXT = OutputContract()


def wants_tool_calls(req) -> bool:
    """The answer may hold tool calls (cheap: no schema checked; ``contract_of`` checks)."""
    extra = getattr(req, "model_extra", None) or {}
    return bool(extra.get("tools")) and extra.get("tool_choice") != "none"


async def contract_off_loop(req, endpoint: str = "chat") -> OutputContract:
    """``contract_of`` for a server's event loop: in a thread when the request is costly to check
    (a schema, tools: jsonschema checks each, which took seconds for 128 tools of long patterns)."""
    if not req.costly_to_plan():
        return contract_of(req, endpoint)
    import asyncio

    return await asyncio.to_thread(contract_of, req, endpoint)


def contract_of(req, endpoint: str = "chat") -> OutputContract:
    """The contract of an OpenAI request (its extra fields); a 400 naming the field otherwise
    (``tools`` on any ``endpoint`` but chat too)."""
    extra = getattr(req, "model_extra", None) or {}
    if endpoint != "chat" and (extra.get("tools") or extra.get("tool_choice") not in (None, "none")):
        raise errors.bad_request("`tools` are served on /v1/chat/completions only.", "tools", "unsupported_parameter")
    fmt, schema, name = _response_format(extra.get("response_format"))
    tools = _tools(extra.get("tools"))
    choice = _tool_choice(extra.get("tool_choice"), tools)
    parallel = extra.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise errors.bad_request("Invalid value for 'parallel_tool_calls': it must be a boolean.",
                                 "parallel_tool_calls", "invalid_value")
    if extra.get("functions") or extra.get("function_call") not in (None, "none"):
        raise errors.bad_request("The deprecated `functions` and `function_call` are not served; send `tools` "
                                 "and `tool_choice`.", "functions", "unsupported_parameter")
    if fmt == "text" and not tools:
        return TEXT
    digest = hashlib.sha256(json.dumps([fmt, schema, [t.openai() for t in tools], choice, parallel],
                                       sort_keys=True).encode()).hexdigest()
    return OutputContract(fmt, schema, name, tools, choice, parallel, digest)


def _response_format(value: Any) -> tuple[str, dict | None, str]:
    if value is None:
        return "text", None, ""
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        kind = value.get("type") if isinstance(value, dict) else value
        raise errors.bad_request(f"Invalid value for 'response_format.type': {str(kind)[:40]!r}; expected one of "
                                 f"{', '.join(FORMATS)}.", "response_format.type", "invalid_value")
    kind = value["type"]
    if kind != "json_schema":
        return kind, None, ""
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise errors.bad_request("'response_format.json_schema' must be an object with `name` and `schema`.",
                                 "response_format.json_schema", "invalid_value")
    name = spec.get("name", "")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise errors.bad_request("'response_format.json_schema.name' must be 1-64 letters, digits, _ or -.",
                                 "response_format.json_schema.name", "invalid_value")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise errors.bad_request("'response_format.json_schema.strict' must be a boolean.",
                                 "response_format.json_schema.strict", "invalid_value")
    schema = check_schema(spec.get("schema", {"type": "object"}), "response_format.json_schema.schema")
    return kind, schema, name


def check_schema(schema: Any, param: str) -> dict:
    """``schema`` if it is a JSON object, a valid JSON Schema, within the size and enum bounds and
    with no recursion that never ends; a 400 naming ``param`` otherwise."""
    if not isinstance(schema, dict):
        raise errors.bad_request(f"'{param}' must be a JSON Schema object, not {type(schema).__name__}.", param,
                                 "invalid_schema")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise errors.bad_request(f"'{param}' is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are served.",
                                 param, "schema_too_large")
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise errors.bad_request(f"'{param}' is not a valid JSON Schema ({where or 'root'}): {e.message[:200]}",
                                 param, "invalid_schema") from None
    _check_enums(schema, param)
    _check_refs(schema, schema, param)
    if (loop := unbounded_recursion(schema)) is not None:
        raise errors.bad_request(f"'{param}' recurses without bound: {loop} is required inside itself, so no "
                                 "finite JSON value meets it.", param, "invalid_schema")
    return schema


def _check_enums(node: Any, param: str, depth: int = 0) -> None:
    if isinstance(node, dict):
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_ENUM:
            raise errors.bad_request(f"'{param}' has an enum of {len(enum)} values; at most {MAX_ENUM} are served.",
                                     param, "schema_too_large")
        for v in node.values():
            _check_enums(v, param, depth + 1)
    elif isinstance(node, list):
        for v in node:
            _check_enums(v, param, depth + 1)


def _check_refs(root: dict, node: Any, param: str, depth: int = 0) -> None:
    """Every ``$ref`` points into the schema itself (``#`` or a JSON pointer that resolves): no
    schema is fetched, and one that points nowhere is refused here, not found out mid-answer."""
    if isinstance(node, list):
        for v in node:
            _check_refs(root, v, param, depth + 1)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if ref is not None and not _resolves(root, ref):
        raise errors.bad_request(f"'{param}' has a $ref {str(ref)[:80]!r} that points nowhere in the schema (only "
                                 "local references, \"#\" or \"#/$defs/...\", are served).", param, "invalid_schema")
    for key, v in node.items():
        if key not in LITERAL_KEYS:
            _check_refs(root, v, param, depth + 1)


def _resolves(root: dict, ref: Any) -> bool:
    if not isinstance(ref, str) or not ref.startswith("#"):
        return False
    node: Any = root
    for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]] if ref != "#" else []:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return isinstance(node, (dict, bool))


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise errors.bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools.", "tools", "invalid_value")
    tools, seen = [], set()
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise errors.bad_request(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}.",
                                     f"tools[{i}]", "invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise errors.bad_request(f"'tools[{i}].function.name' must be 1-64 letters, digits, _ or -.",
                                     f"tools[{i}].function.name", "invalid_value")
        if name in seen:
            raise errors.bad_request(f"'tools[{i}].function.name': the name {name!r} is used by two tools.",
                                     f"tools[{i}].function.name", "duplicate_tool_name")
        seen.add(name)
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise errors.bad_request(f"'tools[{i}].function.description' must be a string.",
                                     f"tools[{i}].function.description", "invalid_value")
        params = check_schema(fn.get("parameters", {"type": "object", "properties": {}}),
                              f"tools[{i}].function.parameters")
        if params.get("type", "object") != "object":
            raise errors.bad_request(f"'tools[{i}].function.parameters' must be a schema of an object (the "
                                     "arguments are an object of named values).", f"tools[{i}].function.parameters",
                                     "invalid_schema")
        tools.append(Tool(name, description, params))
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> str:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str) and value in CHOICES:
        if value != "none" and not tools:
            raise errors.bad_request(f"'tool_choice' is {value!r} but no `tools` are given.", "tool_choice",
                                     "invalid_value")
        return value
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise errors.bad_request("Invalid value for 'tool_choice': expected none, auto, required or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice",
                                 "invalid_value")
    if not any(t.name == name for t in tools):
        raise errors.bad_request(f"'tool_choice' names the function {name[:64]!r}, which is not in `tools`.",
                                 "tool_choice", "invalid_value")
    return name
