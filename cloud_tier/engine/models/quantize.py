"""``EngineConfig.weight_dtype = "int8"`` applied to a loaded model: its linear layers' (and LM head's)
weights replaced by ``int8_weights.Int8Weight`` copies, which ``layers.Linear`` and ``head_linear``
then multiply by (see int8_weights for the format, the kernel and the dense path)."""

from __future__ import annotations

import torch
from torch import nn

from cloud_tier.engine.models.int8_weights import Int8Weight
from cloud_tier.engine.models.layers import Linear

# The LM head (or the tied embedding used as one) is quantized too: per-row INT8 of a 150k-vocab head
# measured within the same agreement and perplexity bounds as the layers alone (bench/weight_int8.py),
# and it is ~15% of the 1.5B's bytes per step. The embedding table itself stays (rows are looked up).
QUANTIZE_HEAD = True


def quantize_model(model: nn.Module, head: bool = QUANTIZE_HEAD) -> int:
    """Quantize every ``layers.Linear`` of ``model`` (and, with ``head``, its LM head) in place; their
    float weights are dropped (an untied head's too; a tied embedding stays, for its lookups). Returns
    the weight bytes a step reads after it. Call before ``pack_linears``, which leaves these alone."""
    lm_head = getattr(model, "lm_head", None)
    with torch.inference_mode(False), torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear) and m is not lm_head and m.int8 is None:
                m.int8 = Int8Weight.quantize(m.weight)
                m.weight = nn.Parameter(torch.empty(0, dtype=m.weight.dtype, device=m.weight.device),
                                        requires_grad=False)
        if head and getattr(model, "int8_head", None) is None:
            weight = model.embed_tokens.weight if lm_head is None else lm_head.weight
            model.int8_head = Int8Weight.quantize(weight)
            if lm_head is not None:
                lm_head.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                              requires_grad=False)
    return step_weight_bytes(model)


def step_weight_bytes(model: nn.Module) -> int:
    """The bytes of the weights one decode step reads: every linear layer's and the head's (the
    embedding's lookups and the norms are left out: a few rows, small vectors)."""
    lm_head = getattr(model, "lm_head", None)
    total = 0
    for m in model.modules():
        if isinstance(m, Linear) and m is not lm_head:
            total += m.int8.nbytes if m.int8 is not None else m.weight.numel() * m.weight.element_size()
    q = getattr(model, "int8_head", None)
    if q is not None:
        return total + q.nbytes
    head = model.embed_tokens.weight if lm_head is None else lm_head.weight
    return total + head.numel() * head.element_size()
