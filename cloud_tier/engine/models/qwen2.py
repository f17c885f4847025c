"""Qwen2 (Qwen2.5, Qwen2.5-Coder): the Llama decoder with a bias on q, k and v (none on o)."""

from __future__ import annotations

from cloud_tier.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """HF's Qwen2 configs carry no ``attention_bias`` flag: the q/k/v bias is always there (the
    fused ``qkv_proj.bias`` is filled from ``q_proj``/``k_proj``/``v_proj.bias`` at load time).
    RoPE (rotate-half, base from the config: 1e6 for Qwen2.5) and GQA are Llama's."""

    def __init__(self, config: dict, max_pos: int):
        if config.get("use_sliding_window"):
            raise NotImplementedError("Qwen2 with use_sliding_window is not supported")
        super().__init__({**config, "attention_bias": True}, max_pos)
