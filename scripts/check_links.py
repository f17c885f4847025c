"""Check that every relative link in README.md and docs/*.md resolves: the file exists and, for
``file.md#anchor``, the file has a heading whose GitHub anchor is ``anchor``.

    python docs/check_links.py        # exit 1 with one line per broken link
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in strip_code(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def strip_code(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def broken_links(doc: Path) -> list[str]:
    problems = []
    for line in strip_code(doc.read_text()):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                problems.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{doc.relative_to(ROOT)}: {target}: no heading with that anchor")
    return problems


def main() -> int:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for doc in docs for p in broken_links(doc)]
    for p in problems:
        print(p)
    print(f"{len(docs)} files checked, {len(problems)} broken link(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
