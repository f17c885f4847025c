"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral without sliding window) on paged KV."""

from __future__ import annotations

import torch
from torch import nn

from cloud_tier.engine.attention import AttentionMetadata, paged_attention
from cloud_tier.engine.models.layers import Linear, RMSNorm, Rotary, apply_rotary, head_linear, rope_theta, silu_and_mul


class LlamaAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads", self.n_heads)
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_heads
        bias = c.get("attention_bias", False)
        # q, k and v in one matmul (filled from q_proj/k_proj/v_proj at load time)
        self.qkv_proj = Linear(c["hidden_size"], (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, c["hidden_size"], bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, rope, kv, meta):
        qkv = self.qkv_proj(x).view(-1, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk = apply_rotary(rope, qkv[:, :self.n_heads + self.n_kv])  # q and k rotated in one pass
        q, k, v = qk[:, :self.n_heads], qk[:, self.n_heads:], qkv[:, self.n_heads + self.n_kv:]
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(-1, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.inter = c["intermediate_size"]
        self.gate_up_proj = Linear(c["hidden_size"], 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = LlamaMLP(c)

    def forward(self, h, residual, rope, kv, meta, next_norm: RMSNorm) -> torch.Tensor:
        """``h``: this layer's input, already normalized (``input_layernorm`` of ``residual``);
        adds both branches into ``residual`` in place and returns ``next_norm`` of it (the next
        layer's input norm, or the final one): each residual add fused with the norm after it."""
        h = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, kv, meta), residual)
        return next_norm.add_forward(self.mlp(h), residual)


class LlamaForCausalLM(nn.Module):
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: dict, max_pos: int):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.tie_word_embeddings = c.get("tie_word_embeddings", False)
        self.lm_head = None if self.tie_word_embeddings else Linear(c["hidden_size"], c["vocab_size"], bias=False)
        head_dim = self.layers[0].self_attn.head_dim
        theta, scaling = rope_theta(c)
        self.rotary = Rotary(head_dim, theta, max_pos, scaling)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the KV cache this model needs."""
        a = self.layers[0].self_attn
        return len(self.layers), a.n_kv, a.head_dim

    def sliding_windows(self) -> set[int | None]:
        return {None}

    def layer_windows(self) -> list[int | None]:
        return [None] * len(self.layers)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)  # a fresh tensor: the layers add into it in place
        rope = self.rotary.at(positions, residual.dtype)
        h = self.layers[0].input_layernorm(residual)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, kv, next_norm in zip(self.layers, kv_caches, norms, strict=True):
            h = layer(h, residual, rope, kv, meta, next_norm)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return head_linear(self, hidden, weight)
