"""The size rules of the tree (issue 38): no source file over 400 lines, no function over 60, no file circle.

A file circle is two or more modules that import each other, at the top or lazily inside a function: the
import contract sees only packages, so a circle between two files of one package passes it.

An argument-parser table (a function whose name starts with ``add_`` and ends in ``_parser``/``_parsers``,
or ``build_parser``) may be longer: it is a table, not logic. Run from the repository root; exits 1 and
lists each file or function over its limit."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("cascade", "cascade_cli", "edge_agent", "cloud_tier", "model_distribution", "sync", "testkit")
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
    return found + circles(root)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every module ``name`` imports, anywhere in the file (``from a import b`` counts a.b if it is a module)."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            out.add(source)
            out.update(f"{source}.{alias.name}" for alias in node.names)
    return out


def circles(root: Path) -> list[str]:
    files = {module_name(root, p): p for package in PACKAGES for p in (root / package).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = imported(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {d for d in deps if d in files and d != name and not name.startswith(d + ".")}
    return [f"file circle: {' -> '.join(sorted(c))}" for c in strongly_connected(graph) if len(c) > 1]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the module graph is deep enough to matter for recursion)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out


if __name__ == "__main__":
    problems = violations(Path.cwd())
    print("\n".join(problems) or "structure: every file and function within its limit")
    sys.exit(1 if problems else 0)
