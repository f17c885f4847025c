"""Gemma 3 text decoder: interleaved sliding-window and global layers with their own RoPE
bases, q/k RMSNorm, GeGLU, sandwich norms, scaled embeddings."""

from __future__ import annotations

import torch
from torch import nn

from cloud_tier.engine.attention import AttentionMetadata, paged_attention
from cloud_tier.engine.models.layers import (
    GemmaRMSNorm,
    Linear,
    Rotary,
    apply_rotary,
    gelu_tanh_and_mul,
    head_linear,
    rope_theta,
)


def layer_types(c: dict) -> list[str]:
    if c.get("layer_types"):
        return list(c["layer_types"])
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(c["num_hidden_layers"])]


class Gemma3Attention(nn.Module):
    def __init__(self, c: dict, layer_type: str):
        super().__init__()
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c["num_key_value_heads"]
        self.head_dim = c["head_dim"]
        bias = c.get("attention_bias", False)
        self.qkv_proj = Linear(c["hidden_size"], (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, c["hidden_size"], bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, c["rms_norm_eps"])
        self.k_norm = GemmaRMSNorm(self.head_dim, c["rms_norm_eps"])
        self.scale = c["query_pre_attn_scalar"] ** -0.5
        self.is_sliding = layer_type == "sliding_attention"
        self.window = c["sliding_window"] if self.is_sliding else None
        if c.get("attn_logit_softcapping"):
            raise NotImplementedError("attention logit soft-capping is not supported")

    def forward(self, x, rope, kv, meta):
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, self.n_kv * self.head_dim,
                                          self.n_kv * self.head_dim], dim=-1)
        q = self.q_norm(q.view(-1, self.n_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.n_kv, self.head_dim))
        v = v.view(-1, self.n_kv, self.head_dim)
        q, k = apply_rotary(rope, q), apply_rotary(rope, k)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window)
        return self.o_proj(o.reshape(-1, self.n_heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise NotImplementedError(f"activation {c['hidden_activation']!r}")
        self.inter = c["intermediate_size"]
        self.gate_up_proj = Linear(c["hidden_size"], 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3Layer(nn.Module):
    def __init__(self, c: dict, layer_type: str):
        super().__init__()
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(c, layer_type)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(c)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, rope, kv, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: dict, max_pos: int):
        super().__init__()
        c = config
        self.config = c
        types = layer_types(c)
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Gemma3Layer(c, t) for t in types)
        self.norm = GemmaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        tied = c.get("tie_word_embeddings", True)
        self.lm_head = None if tied else Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.rotary_local = _rotary(c, "sliding_attention", max_pos)
        self.rotary_global = _rotary(c, "full_attention", max_pos)
        self.softcap = c.get("final_logit_softcapping")

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        a = self.layers[0].self_attn
        return len(self.layers), a.n_kv, a.head_dim

    def sliding_windows(self) -> set[int | None]:
        return {layer.self_attn.window for layer in self.layers}

    def layer_windows(self) -> list[int | None]:
        """Per layer, its sliding window (None: global)."""
        return [layer.self_attn.window for layer in self.layers]

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config["hidden_size"] ** 0.5, dtype=x.dtype)
        local, full = self.rotary_local.at(positions, x.dtype), self.rotary_global.at(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, local if layer.self_attn.is_sliding else full, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = head_linear(self, hidden, weight)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _rotary(c: dict, layer_type: str, max_pos: int) -> Rotary:
    theta, scaling = rope_theta(c, layer_type)
    return Rotary(c["head_dim"], theta, max_pos, scaling)
