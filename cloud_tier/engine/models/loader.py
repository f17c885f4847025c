"""Build a model from an HF-style directory (config.json + safetensors), fusing q/k/v and
gate/up projections into single matmuls."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from cloud_tier.engine.models.gemma3 import Gemma3ForCausalLM
from cloud_tier.engine.models.llama import LlamaForCausalLM
from cloud_tier.engine.models.qwen2 import Qwen2ForCausalLM

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
}
MODEL_TYPES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
               "gemma3_text": Gemma3ForCausalLM}


def read_config(model_dir: Path) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" in config and config.get("model_type") == "gemma3":
        config = {**config["text_config"], "architectures": config.get("architectures")}
    return config


def model_class(config: dict):
    for arch in config.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    raise NotImplementedError(f"unsupported model: architectures={config.get('architectures')} "
                              f"model_type={config.get('model_type')} (supported: {', '.join(ARCHITECTURES)})")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_pos: int) -> torch.nn.Module:
    config = read_config(model_dir)
    cls = model_class(config)
    model = _unfilled(cls, config, max_pos)
    state = _to_our_names(load_state_dict(model_dir), cls.FUSED)
    if model.lm_head is None:  # tied: a saver may have kept either name of the shared tensor
        head = state.pop("lm_head.weight", None)
        if "embed_tokens.weight" not in state and head is not None:
            state["embed_tokens.weight"] = head
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)  # the loaded tensors
    missing = [k for k in missing if not k.startswith("rotary")]
    if missing or unexpected:
        raise ValueError(f"weights do not match {cls.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(device=device, dtype=dtype)
    model.eval()
    return model


def _unfilled(cls, config: dict, max_pos: int) -> torch.nn.Module:
    """The model with its parameters on the meta device (no memory, no random init: the weights
    replace them), where its buffers can be made so; else on the CPU. ``Rotary`` builds its tables
    on the CPU whatever the device around it, so every model here takes the meta path: a 1.5B model in
    float32 then peaks at the weights and their fused copies, not twice that."""
    with torch.device("meta"):
        model = cls(config, max_pos=max_pos)
    if any(b.is_meta for b in model.buffers()):
        model = cls(config, max_pos=max_pos)
    return model


def _to_our_names(state: dict[str, torch.Tensor], fused: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """HF names -> ours: drop the ``model.`` prefix and concatenate fused projections."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("model.language_model."):
            name = name[len("model.language_model."):]
        elif name.startswith("model."):
            name = name[len("model."):]
        out[name] = t
    for fused_name, parts in fused.items():
        for key in [k for k in out if f".{parts[0]}." in k]:
            names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            out[key.replace(f".{parts[0]}.", f".{fused_name}.")] = torch.cat([out.pop(n) for n in names], dim=0)
    return out
