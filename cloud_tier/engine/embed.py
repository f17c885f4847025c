"""Embeddings from the engine's own model: the final hidden state (after the final norm, before the
LM head), mean-pooled over each input's tokens and L2-normalised, as the edge agent's llama.cpp
embedder pools the same GGUF.

A batch of inputs runs as one forward of its own, never inside a generation step: on scratch KV
tensors sized for it (a fresh prompt attends only to itself, so the engine's paged cache, its
blocks and its prefix cache are neither read nor touched). Call it on the engine thread between
steps (``AsyncLLMEngine.call``), as the runner's kernels and the model are not shared safely."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cloud_tier.engine.attention import AttentionMetadata
from cloud_tier.engine.kv_quant import Int8KV

POOLING = "mean"


def batches(inputs: Sequence[Sequence[int]], max_tokens: int) -> list[list[list[int]]]:
    """``inputs`` in order, in groups of at most ``max_tokens`` tokens (an input longer than that
    alone): one forward each, so the engine's steps run between them."""
    groups: list[list[list[int]]] = []
    size = 0
    for ids in inputs:
        if not groups or size + len(ids) > max_tokens:
            groups.append([])
            size = 0
        groups[-1].append(list(ids))
        size += len(ids)
    return groups


@torch.inference_mode()
def embed_tokens(engine, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
    """One unit vector per input (token ids within the vocabulary, at most ``max_model_len`` each),
    from ``engine`` (an ``LLMEngine``), in one forward."""
    runner = engine.runner
    bs, dev = runner.block_size, runner.device
    chunks, flat, blocks = [], [], 0
    for ids in inputs:
        n = -(-len(ids) // bs)
        chunks.append((0, len(ids), list(range(blocks, blocks + n))))
        flat.extend(ids)
        blocks += n
    _, n_kv, head_dim = runner.model.kv_shape
    shape = (blocks * bs, n_kv, head_dim)

    def scratch():
        return Int8KV.zeros(shape, dev) if runner.kv_int8 else torch.zeros(shape, dtype=runner.dtype, device=dev)

    caches = [(scratch(), scratch()) for _ in runner.model.layer_windows()]
    meta = AttentionMetadata.build(chunks, bs, runner.windows, dev, runner.native_attention)
    if runner.separate_windows:  # the sliding-window layers read the same scratch blocks
        meta.windowed = AttentionMetadata.build(chunks, bs, runner.windows - {None}, dev, runner.native_attention)
    hidden = runner.model(torch.tensor(flat, device=dev), meta.positions, caches, meta)
    out, row = [], 0
    for ids in inputs:
        pooled = hidden[row:row + len(ids)].float().mean(dim=0)
        out.append(F.normalize(pooled, dim=0).cpu().tolist())
        row += len(ids)
    return out
