"""A tokenizer as files, so a gateway gets the exact tokenizer its workers serve without holding
the model: the worker dumps its HF tokenizer (``GET /internal/tokenizer``), the gateway loads it
with transformers' tokenizers alone (no torch, no weights)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

MAX_FILE_BYTES = 64 << 20  # Gemma 3's tokenizer.json is ~33 MB


def dump(tokenizer) -> dict[str, str]:
    """The files ``tokenizer.save_pretrained`` writes, by name (text files only)."""
    with tempfile.TemporaryDirectory(prefix="cascade-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(tmp).iterdir())
                if p.is_file() and p.stat().st_size <= MAX_FILE_BYTES}


def load(files: dict[str, str]):
    """An HF tokenizer from ``dump``'s files (names are plain file names: nothing else is written)."""
    # on a gateway-only host transformers warns at import that torch is missing: expected here
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="cascade-tokenizer-") as tmp:
        for name, text in files.items():
            if Path(name).name != name or name.startswith("."):
                raise ValueError(f"not a plain tokenizer file name: {name!r}")
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(tmp)
