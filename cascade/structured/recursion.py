"""Recursion no finite JSON value ends: a ``$ref`` cycle whose every step is required (a required
property, a non-empty array's items, every branch of an ``allOf``). Such a schema would have the
model write until its token limit; it is refused up front instead."""

from __future__ import annotations

from typing import Any

MAX_NODES = 10_000  # schema nodes walked: the schema is already bounded in size (contract.MAX_SCHEMA_BYTES)


def unbounded_recursion(schema: dict) -> str | None:
    """The first ``$ref`` that must contain itself, or None."""
    forced: dict[str, set[str]] = {}
    for ref, node in _definitions(schema):
        forced[ref] = _forced_refs(node, 0, [0])
    for start in forced:
        path = _cycle(start, forced)
        if path:
            return path
    return None


def _definitions(schema: dict):
    yield "#", schema
    for key in ("$defs", "definitions"):
        defs = schema.get(key)
        if isinstance(defs, dict):
            for name, node in defs.items():
                yield f"#/{key}/{name}", node


def _forced_refs(node: Any, depth: int, walked: list[int]) -> set[str]:
    """The refs every instance of ``node`` must contain."""
    walked[0] += 1
    if not isinstance(node, dict) or depth > 64 or walked[0] > MAX_NODES:
        return set()
    out: set[str] = set()
    ref = node.get("$ref")
    if isinstance(ref, str):
        out.add(ref)
    for sub in node.get("allOf") or []:
        out |= _forced_refs(sub, depth + 1, walked)
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:  # forced only where every branch forces it
            sets = [_forced_refs(b, depth + 1, walked) for b in branches]
            out |= set.intersection(*sets)
    props = node.get("properties")
    required = node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name in props:
                out |= _forced_refs(props[name], depth + 1, walked)
    if isinstance(node.get("minItems"), int) and node["minItems"] >= 1:
        out |= _forced_refs(node.get("items"), depth + 1, walked)
    return out


def _cycle(start: str, forced: dict[str, set[str]]) -> str | None:
    stack, seen = [(start, [start])], set()
    while stack:
        ref, path = stack.pop()
        for nxt in forced.get(ref, ()):
            if nxt == start:
                return " -> ".join(path + [nxt])
            if nxt not in seen and nxt in forced:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None
