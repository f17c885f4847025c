"""The size rules of the tree (issue 38): no source file over 400 lines, no function over 60.

An argument-parser table (a function whose name starts with ``add_`` and ends in ``_parser``/``_parsers``,
or ``build_parser``) may be longer: it is a table, not logic. Run from the repository root; exits 1 and
lists each file or function over its limit."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("cascade", "cascade_cli", "edge_agent", "cloud_tier", "model_distribution", "sync")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def is_parser_table(name: str) -> bool:
    return name == "build_parser" or (name.startswith("add_") and name.endswith(("_parser", "_parsers")))


def violations(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n") + 1
            rel = path.relative_to(root)
            if lines > MAX_FILE_LINES:
                found.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES})")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not is_parser_table(node.name):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.lineno} {node.name}(): {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


if __name__ == "__main__":
    problems = violations(Path.cwd())
    print("\n".join(problems) or "structure: every file and function within its limit")
    sys.exit(1 if problems else 0)
