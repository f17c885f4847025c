"""Weight-only INT8: the quantization's round trip, the CPU kernel and the dense path against
x @ (w_int8 * scale).T computed in float64 (random shapes, odd K and N, float32 and bfloat16 rows,
batches on both sides of the kernel's row limit), a model's layers after ``quantize_model``, and
the config's refusal of a weight dtype it does not know."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cloud_tier.engine.models import int8_weights, layers
from cloud_tier.engine.models.int8_weights import Int8Weight, int8_product
from cloud_tier.engine.models.quantize import quantize_model, step_weight_bytes
from cloud_tier.engine_config import EngineConfig

# (rows, K, N): K and N odd or not a multiple of the 16 lanes, rows around the 4-row tiles and
# past KERNEL_MAX_ROWS (the dense path)
SHAPES = [(1, 33, 7), (2, 16, 4), (3, 100, 130), (5, 1537, 19), (8, 64, 65), (17, 48, 33), (40, 96, 50)]
# the relative error allowed against the float64 reference: float32 accumulation over up to 1537
# terms; bfloat16 output rounding (2^-8, plus the dense path's weight rounded to bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _reference(x: torch.Tensor, q: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ (q.data.double() * q.scale.double()[:, None]).T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_equals_the_dequantized_reference(native, dtype, rows, k, n, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    q = Int8Weight.quantize(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    expected = _reference(x, q, bias)
    for ext in (native, None):  # the kernel (or its dense path past the row limit), and the torch fallback
        y = int8_product(x, q, bias, ext)
        assert y.dtype == dtype and y.shape == (rows, n)
        err = ((y.double() - expected).abs().max() / expected.abs().max()).item()
        assert err < TOLERANCE[dtype], f"{'kernel' if ext else 'torch'}: relative error {err}"


def test_the_kernel_itself_runs_past_its_row_limit_correctly(native):
    """The kernel on a batch the engine sends to the dense path: equal all the same."""
    q = Int8Weight.quantize(torch.randn(37, 70))
    x = torch.randn(int8_weights.KERNEL_MAX_ROWS[torch.float32] + 3, 70)
    y = native.int8_linear(x, q.data, q.scale)
    assert torch.allclose(y.double(), _reference(x, q, None), rtol=1e-5, atol=1e-4)


def test_dequantize_kernel_rounds_once_as_torch_does(native):
    q = Int8Weight.quantize(torch.randn(9, 45))
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(9, 45, dtype=dtype)
        native.int8_dequantize_(out, q.data, q.scale)
        assert torch.equal(out, q.dequantized(dtype))


def test_quantization_is_symmetric_per_channel_within_half_a_step():
    w = torch.randn(6, 50) * torch.tensor([1e-3, 0.1, 1, 10, 100, 0.0])[:, None]
    q = Int8Weight.quantize(w)
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.scale.shape == (6,)
    assert q.data.abs().max() <= 127 and (q.data[:5].abs().amax(dim=1) == 127).all()  # each row's max hits 127
    err = (q.dequantized(torch.float32) - w).abs()
    assert (err <= q.scale[:, None] / 2 * (1 + 1e-6)).all()
    assert (q.dequantized(torch.float32)[5] == 0).all()  # an all-zero row stays zero
    assert q.nbytes == 6 * 50 + 6 * 4


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = layers.Linear(24, 40, bias=True)
        self.down_proj = layers.Linear(40, 24, bias=False)


class _TinyModel(nn.Module):
    """The parts quantize_model and pack_linears look at: layers of Linears, a tied embedding."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.embed_tokens = nn.Embedding(100, 24)
        self.lm_head = None


def test_quantize_model_replaces_the_linears_and_the_head(native):
    torch.manual_seed(0)
    model = _TinyModel()
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, layers.Linear)}
    before = step_weight_bytes(model)
    quantize_model(model)
    assert layers.pack_linears(model) == 0  # nothing left in float to pack
    x = torch.randn(3, 24)
    layers.use_native(native)
    try:
        for name, m in model.named_modules():
            if isinstance(m, layers.Linear):
                assert m.weight.numel() == 0 and m.int8.data.shape == weights[name].shape  # float weight dropped
                inp = torch.randn(3, m.in_features)
                expected = F.linear(inp, weights[name], m.bias)
                assert (m(inp) - expected).abs().max() < 0.05 * expected.abs().max()  # within quantization error
        logits = layers.head_linear(model, x, model.embed_tokens.weight)
    finally:
        layers.use_native(None)
    assert model.embed_tokens.weight.numel() == 100 * 24  # the lookups' table stays
    assert torch.allclose(logits, x @ model.int8_head.dequantized(torch.float32).T, rtol=1e-5, atol=1e-5)
    assert step_weight_bytes(model) < before / 3  # float32 -> int8 (+ a float32 scale per row of 24-40)


def test_unknown_weight_dtype_is_refused_naming_the_allowed():
    assert EngineConfig(weight_dtype="int8").weight_dtype == "int8"
    with pytest.raises(ValueError, match="weight_dtype must be one of auto, int8, got 'int4'"):
        EngineConfig(weight_dtype="int4")


@pytest.mark.parametrize("tie", [True, False])
def test_an_int8_engine_loads_and_serves_an_untied_head_in_float32(tmp_path, tie):
    """The Qwen GGUFs carry their own head (untied): with INT8 weights in float32, packing timed the
    emptied float head and the worker failed to start (IndexError). Both heads load and answer."""
    from cloud_tier.engine import LLMEngine, SamplingParams
    from tests.tiny_qwen2 import make_tiny_qwen2

    model_dir = make_tiny_qwen2(tmp_path / "m", tie=tie)
    engine = LLMEngine.from_model(str(model_dir), dtype="float32", weight_dtype="int8", max_model_len=256,
                                  num_kv_blocks=64)
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert len(done[rid]) == 4


def test_weight_dtype_comes_from_the_file_the_environment_and_reaches_started_workers(tmp_path):
    from cloud_tier.config import CloudConfig

    toml = tmp_path / "cloud.toml"
    toml.write_text('[engine]\nweight_dtype = "int8"\n')
    assert CloudConfig.load(toml, environ={}).engine.weight_dtype == "int8"
    env = CloudConfig.load(None, environ={"CASCADE_CLOUD_ENGINE_WEIGHT_DTYPE": "int8"})
    assert env.engine.weight_dtype == "int8"
    assert CloudConfig.from_dict(env.to_dict()).engine.weight_dtype == "int8"  # $CASCADE_WORKER_SETTINGS' round trip
