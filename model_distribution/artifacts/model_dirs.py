"""Where a model's HF-style directory is: the engine loads from one, whatever a user names
(a catalogue name, a .gguf path or a directory)."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str) -> Path:
    """An HF-style directory for ``model``: itself if it is one, else the GGUF (a catalogue name
    or a path) converted once into ``$CASCADE_HOME/engine/models``."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    from cascade.config import cascade_home
    from model_distribution.artifacts.catalog import Catalog
    from model_distribution.artifacts.gguf_convert import ensure_hf_dir

    catalog = Catalog(cascade_home())
    gguf = catalog.ensure_ready(catalog.get(model))
    return ensure_hf_dir(gguf, cascade_home() / "engine" / "models")
