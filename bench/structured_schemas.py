"""The structured-output corpus: real-world JSON schemas in ``bench/schemas/NN_short_name.json``.

Each file is ``{"name", "title", "source", "schema", "expect", "example"}``: ``name`` is an identifier fit
for ``response_format.json_schema.name``; ``expect`` is ``"enforced"`` (a token-mask engine compiles it)
or ``"unsupported:<keyword>"`` (llguidance refuses it, naming the keyword); ``example`` validates.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "schemas"


def load_corpus(path: Path | str | None = None) -> list[dict]:
    """The corpus's entries in file-name order (``path``: another folder of such files)."""
    folder = Path(path) if path is not None else CORPUS
    entries = []
    for file in sorted(folder.glob("*.json")):
        with file.open() as f:
            entries.append(json.load(f))
    return entries


def enforced(entries: list[dict]) -> list[dict]:
    """The entries a token-mask engine is expected to compile."""
    return [e for e in entries if e["expect"] == "enforced"]
