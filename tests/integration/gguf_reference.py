"""transformers' own GGUF loader as the numerical reference, built once per test process: the
conversion tests compare our converted tensors with it, the parity tests our engine's tokens and
logits. Each build parses the GGUF in Python (SmolLM2 ~30 s, Gemma 3 ~45 s here; the same again
twice over through ``from_pretrained(gguf_file=...)``, which parses it for the config and again for
the weights), so the two test modules share one model per GGUF (~0.5 GB SmolLM2, ~1.1 GB Gemma 3
held to the end of the run)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Reference:
    model: torch.nn.Module
    config: object


@functools.cache
def gguf_reference(gguf: Path, hf_dir: Path) -> Reference:
    """The model in ``gguf`` as transformers' GGUF loader builds it (float32, eval mode); ``hf_dir``
    (our conversion of it) gives only the parameter names the loader maps the GGUF names to.

    ``from_pretrained(gguf_file=...)`` runs exactly ``load_gguf_checkpoint`` for these
    architectures (and needs accelerate); calling the loader directly parses the file once
    instead of twice. Both give the same tensors and logits (checked by hand). Treat the model
    as read-only: other tests share it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used, to map the GGUF names
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
    config = AutoConfig.for_model(**parsed["config"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    loaded = model.load_state_dict(parsed["tensors"], strict=False)
    assert loaded.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    assert not loaded.unexpected_keys
    return Reference(model, config)
