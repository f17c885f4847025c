"""The HF ``config.json`` and ``generation_config.json`` of a converted GGUF, rebuilt from its
metadata (``gguf_convert`` writes them beside the weights): LlamaConfig, Qwen2Config or
Gemma3TextConfig, with llama.cpp's defaults where the file is silent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from model_distribution.artifacts.gguf_meta import GGUFMetadata

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# End-of-turn tokens that llama.cpp also treats as end of generation (llama-vocab.cpp), listed
# in generation_config.json so that the engine stops where the edge does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")


def build_config(meta: GGUFMetadata, shapes: dict[str, tuple[int, ...]]):
    """The HF config for a GGUF with this metadata and these tensor shapes (HF order)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    fields = _common_fields(meta, shapes)
    _check_fields(fields, shapes)
    if meta.architecture == "gemma3":
        return Gemma3TextConfig(**fields, **_gemma3_fields(meta, fields))
    rotary_dims = _arch_value(meta, "rope.dimension_count", fields["head_dim"])
    if rotary_dims != fields["head_dim"]:
        raise ValueError(f"partial rotary ({rotary_dims} of {fields['head_dim']} dims) is not supported")
    # llama.cpp's and transformers' base where the file is silent (Qwen2.5's GGUFs state 1e6)
    theta = _positive("rope.freq_base", _f32(_arch_value(meta, "rope.freq_base", 10_000.0)))
    rope = {"rope_type": "default", "rope_theta": theta, **_rope_scaling(meta)}
    if meta.architecture == "qwen2":  # q/k/v biases are part of the architecture, no flag
        return Qwen2Config(**fields, hidden_act="silu", rope_parameters=rope, use_sliding_window=False)
    return LlamaConfig(**fields, hidden_act="silu", rope_parameters=rope)


MAX_LAYERS, MAX_WIDTH = 1024, 1 << 20  # past any model a 2-core host serves: a hostile header, not a model


def _check_fields(fields: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """The header's numbers are a model's: counts that are positive integers within bounds, heads that
    share the KV heads evenly, as many blocks as the file has tensors for, a finite positive epsilon.
    ValueError naming the key otherwise (a hostile or broken file: a NaN epsilon or a rope base of 0
    loaded and served garbage, a block_count of a million built a model for half a minute)."""
    if "token_embd.weight" not in shapes:
        raise ValueError("it has no token_embd.weight tensor")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        value = fields[key]
        limit = MAX_LAYERS if key == "num_hidden_layers" else 1 << 24 if key == "max_position_embeddings" else MAX_WIDTH
        if not _is_count(value) or value > limit:
            raise ValueError(f"{key} = {value!r} is not a count in 1..{limit}")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError(f"{fields['num_attention_heads']} attention heads do not share "
                         f"{fields['num_key_value_heads']} KV heads evenly")
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if blocks != set(range(fields["num_hidden_layers"])):
        raise ValueError(f"block_count is {fields['num_hidden_layers']} but the file has tensors for "
                         f"{len(blocks)} block(s)")
    if fields["max_position_embeddings"] < 2:
        raise ValueError(f"context_length {fields['max_position_embeddings']} is under 2 tokens")
    _positive("attention.layer_norm_rms_epsilon", fields["rms_norm_eps"])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(key: str, value) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} = {value!r} is not a finite positive number")
    return value


def _common_fields(meta: GGUFMetadata, shapes: dict[str, tuple[int, ...]]) -> dict:
    heads = _arch_value(meta, "attention.head_count")
    hidden = _arch_value(meta, "embedding_length")
    tokens = meta.values
    return {
        "architectures": [HF_ARCHITECTURES[meta.architecture]],
        "vocab_size": shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else 0,
        "hidden_size": hidden,
        "intermediate_size": _arch_value(meta, "feed_forward_length"),
        "num_hidden_layers": _arch_value(meta, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _arch_value(meta, "attention.head_count_kv", heads),
        "head_dim": _arch_value(meta, "attention.key_length", hidden // heads if _is_count(heads) else 0),
        "max_position_embeddings": _arch_value(meta, "context_length"),
        "rms_norm_eps": _f32(_arch_value(meta, "attention.layer_norm_rms_epsilon")),
        "bos_token_id": tokens.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": tokens.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": tokens.get("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "dtype": "float32",
    }


def _gemma3_fields(meta: GGUFMetadata, common: dict) -> dict:
    """Gemma 3 settings, with llama.cpp's defaults (llama-model.cpp) where the file is silent."""
    layers = common["num_hidden_layers"]
    pattern = _arch_value(meta, "attention.sliding_window_pattern", 6)  # every 6th layer is global
    global_theta = _positive("rope.freq_base", _f32(_arch_value(meta, "rope.freq_base", 1_000_000.0)))
    local_theta = _positive("rope.freq_base_swa", _f32(_arch_value(meta, "rope.freq_base_swa", 10_000.0)))
    # llama.cpp scales queries by 1/sqrt(head_dim), but the 27B (62 layers) by 1/sqrt(hidden/heads)
    scalar = common["head_dim"] if layers != 62 else common["hidden_size"] // common["num_attention_heads"]
    kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _arch_value(meta, "attention.sliding_window"),
        "layer_types": kinds,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": global_theta, **_rope_scaling(meta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": _arch_value(meta, "final_logit_softcapping", None),
        "attn_logit_softcapping": _arch_value(meta, "attn_logit_softcapping", None),
    }


def _rope_scaling(meta: GGUFMetadata) -> dict:
    kind = _arch_value(meta, "rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_arch_value(meta, "rope.scaling.factor"))}
    raise ValueError(f"rope scaling {kind!r} is not supported by the converter")


_REQUIRED = object()


def _arch_value(meta: GGUFMetadata, key: str, default=_REQUIRED):
    full_key = f"{meta.architecture}.{key}"
    if full_key in meta.array_lengths:
        raise ValueError(f"{full_key} is a per-layer array; only uniform layers are supported")
    if full_key in meta.values:
        return meta.values[full_key]
    if default is _REQUIRED:
        raise ValueError(f"GGUF metadata lacks {full_key}")
    return default


def _f32(value: float) -> float:
    """GGUF stores float32: 1e-05 reads back as 9.99999974e-06; recover the short decimal."""
    return float(str(np.float32(value)))


def write_config(config, out_dir: Path) -> None:
    """config.json as transformers 5 writes it, plus the keys transformers 4 (and vLLM on it) read."""
    config.save_pretrained(str(out_dir))
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data["torch_dtype"] = "float32"
    rope = data["rope_parameters"]
    if config.model_type == "gemma3_text":
        rope, local = rope["full_attention"], rope["sliding_attention"]
        data["rope_local_base_freq"] = local["rope_theta"]
        kinds = data["layer_types"] + ["full_attention"]  # no global layer: a pattern past the end
        data["sliding_window_pattern"] = kinds.index("full_attention") + 1
    data["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    data["rope_scaling"] = scaling if scaling["rope_type"] != "default" else None
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def generation_config(config, tokenizer):
    from transformers import GenerationConfig

    vocab = tokenizer.backend_tokenizer
    eos = [config.eos_token_id, *(vocab.token_to_id(t) for t in END_OF_TURN_TOKENS)]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                            eos_token_id=eos[0] if len(eos) == 1 else eos)
