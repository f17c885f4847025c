"""What the engine reads from a model directory besides the weights: the tokenizer and the
end-of-sequence ids; and where its KV tier's file lives."""

from __future__ import annotations

import json
from pathlib import Path

from cloud_tier.engine_config import EngineConfig


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_ids(model_dir: Path, tokenizer, hf_config: dict) -> frozenset[int]:
    """Every id that ends a sequence: generation_config.json's, config.json's and the tokenizer's."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, hf_config):
        eos = source.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def tier_dir(config: EngineConfig) -> Path:
    if config.kv_tier_path:
        return Path(config.kv_tier_path).expanduser()
    from cascade.config import cascade_home

    return cascade_home() / "engine"
