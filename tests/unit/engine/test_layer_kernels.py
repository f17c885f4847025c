"""The compiled CPU element-wise ops (RMSNorm, residual add + RMSNorm, SiLU/GELU times up, RoPE)
against the torch code they replace, in float32 and bfloat16, on contiguous and strided inputs
(the views the models hand them), and the torch path taken where the kernels do not apply."""

import json

import pytest
import torch
import torch.nn.functional as F

from cloud_tier.engine.models import layers


def _tol(dtype):  # bfloat16: one unit in the last place (reductions sum in another order)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}


def _with(ext, fn):
    saved = layers._native.get("ext")
    layers.use_native(ext)
    try:
        return fn()
    finally:
        layers.use_native(saved)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls", [layers.RMSNorm, layers.GemmaRMSNorm])
def test_rms_norm_matches_the_torch_code_on_rows_and_on_strided_heads(native, dtype, norm_cls):
    g = torch.Generator().manual_seed(1)
    norm = norm_cls(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=g) * 0.3 + (0 if norm_cls is layers.GemmaRMSNorm else 1)
    norm = norm.to(dtype)
    rows = torch.randn(37, 64, generator=g).to(dtype) * 3
    heads = torch.randn(5, 6 * 64 + 32, generator=g).to(dtype)[:, :6 * 64].view(5, 6, 64)  # a split's view
    for x in (rows, heads):
        ours = _with(native, lambda x=x: norm(x))
        ref = _with(None, lambda x=x: norm(x))
        assert ours.shape == ref.shape and ours.dtype == dtype
        torch.testing.assert_close(ours, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_into_the_residual_and_normalizes_the_sum(native, dtype):
    g = torch.Generator().manual_seed(2)
    norm = layers.RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g) * 0.2 + 1
    norm = norm.to(dtype)
    x, residual = torch.randn(200, 576, generator=g).to(dtype), torch.randn(200, 576, generator=g).to(dtype)
    r1, r2 = residual.clone(), residual.clone()
    ours = _with(native, lambda: norm.add_forward(x, r1))
    ref = _with(None, lambda: norm.add_forward(x, r2))
    assert torch.equal(r1, r2)  # the add is torch's, rounded the same
    assert torch.equal(r1, residual + x)
    torch.testing.assert_close(ours, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_activation_times_up_matches_the_torch_code(native, dtype, act):
    g = torch.Generator().manual_seed(3)
    fn = layers.silu_and_mul if act == "silu" else layers.gelu_tanh_and_mul
    gate_up = (torch.randn(33, 2 * 1536, generator=g) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 1e-8, 20.0, 88.0, 100.0]).to(dtype)  # the clamps
    ours = _with(native, lambda: fn(gate_up.clone()))
    ref = _with(None, lambda: fn(gate_up.clone()))
    assert ours.shape == (33, 1536) and ours.dtype == dtype
    torch.testing.assert_close(ours, ref, **_tol(dtype))
    gate, up = gate_up.float().split(1536, dim=-1)
    exact = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    torch.testing.assert_close(ours.float(), exact, atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, tables", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_rotary_in_place_matches_the_torch_code_on_the_qkv_view(native, dtype, tables, dim):
    g = torch.Generator().manual_seed(4)
    rotary = layers.Rotary(dim, 10000.0, 512).to(tables)  # a model moved to bfloat16 moves its tables too
    heads, n_kv = 6, 2
    positions = torch.randint(0, 512, (40,), generator=g)
    qkv = torch.randn(40, heads + 2 * n_kv, dim, generator=g).to(dtype)
    ref = _with(None, lambda: layers.apply_rotary(rotary.at(positions, dtype), qkv[:, :heads + n_kv].clone()))
    view = qkv.clone()[:, :heads + n_kv]
    ours = _with(native, lambda: layers.apply_rotary(rotary.at(positions, dtype), view))
    assert ours.data_ptr() == view.data_ptr()  # rotated where it lies
    torch.testing.assert_close(ours, ref, **_tol(dtype))


def test_a_position_past_the_table_is_refused(native):
    rotary = layers.Rotary(64, 10000.0, 16)
    x = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="position"):
        _with(native, lambda: layers.apply_rotary(rotary.at(torch.tensor([3, 16]), torch.float32), x))


def test_the_torch_path_runs_where_the_kernels_do_not_apply(native):
    norm = layers.RMSNorm(8, 1e-6)
    x64 = torch.randn(4, 8, dtype=torch.float64)
    out = _with(native, lambda: norm.to(torch.float64)(x64))  # float64: no kernel, the torch code
    assert out.dtype == torch.float64
    odd = torch.randn(4, 16)[:, ::2]  # last dim strided
    torch.testing.assert_close(_with(native, lambda: layers.RMSNorm(8, 1e-6)(odd)),
                               _with(None, lambda: layers.RMSNorm(8, 1e-6)(odd)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_greedy_argmax_follows_numpys_rule_on_ties_nan_and_infinities(native, dtype):
    from cloud_tier.engine.sampler import _greedy

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 49152, generator=g).to(dtype)
    logits[1, [7, 300]] = 50.0  # a tie: the first
    logits[2, [10, 20]] = float("nan")  # NaN wins, the first one
    logits[2, 5] = float("inf")
    logits[3, 4000] = float("inf")
    logits[4] = float("-inf")  # nothing finite
    logits[5, 0] = 99.0  # at the edges
    logits[6, -1] = 99.0
    ours, reference = _greedy(logits, native), _greedy(logits, None)
    assert ours.token_ids == reference.token_ids
    assert ours.token_ids[1] == 7 and ours.token_ids[2] == 10 and ours.token_ids[5] == 0
    assert ours.token_ids[6] == 49151
    assert ours.errors == reference.errors and set(ours.errors) == {2, 3, 4}
    assert _greedy(logits[3:5], native).token_ids == [4000, 0]  # a row view of the batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1000 + 7])  # sixteen-lane bodies with a scalar tail, and a short row
def test_the_vector_bodies_and_their_tails_agree_with_the_torch_code(native, dtype, width):
    g = torch.Generator().manual_seed(6)
    norm = layers.RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=g) * 0.2 + 1
    norm = norm.to(dtype)
    x, residual = (torch.randn(7, width, generator=g).to(dtype) for _ in range(2))
    r1, r2 = residual.clone(), residual.clone()
    ours = _with(native, lambda: norm.add_forward(x, r1))
    torch.testing.assert_close(ours, _with(None, lambda: norm.add_forward(x, r2)), **_tol(dtype))
    assert torch.equal(r1, r2)
    gate_up = (torch.randn(5, 2 * width, generator=g) * 4).to(dtype)
    gate_up[:, width - 1] = float("nan")  # NaN in the tail stays NaN
    ours, ref = (_with(e, lambda: layers.silu_and_mul(gate_up.clone())) for e in (native, None))
    torch.testing.assert_close(ours, ref, equal_nan=True, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_argmax_finds_the_first_maximum_in_any_lane_and_in_the_tail(native, dtype):
    from cloud_tier.engine.sampler import _greedy

    g = torch.Generator().manual_seed(7)
    V = 32 * 40 + 13
    logits = torch.randn(8, V, generator=g).to(dtype)
    logits[0, [17, 33]] = 9.0  # a tie across two lanes of one chunk: the first
    logits[1, [40, 69]] = 9.0  # a tie where the lower lane holds the later index
    logits[2, V - 1] = 9.0  # in the tail
    logits[3, [5, V - 2]] = 9.0  # a tie between the vector body and the tail
    logits[4, V - 3] = float("nan")  # NaN only in the tail
    logits[5, :] = float("-inf")
    logits[5, V - 5] = -1e30  # the only finite value, in the tail
    logits[6, :] = float("-inf")
    logits[7, 1000] = float("nan")
    logits[7, 3] = float("inf")
    ours, reference = _greedy(logits, native), _greedy(logits, None)
    assert ours.token_ids == reference.token_ids
    assert ours.token_ids[:7] == [17, 40, V - 1, 5, V - 3, V - 5, 0]
    assert ours.errors == reference.errors


def test_a_batch_padded_to_whole_tiles_gives_the_same_products(monkeypatch):
    from cloud_tier.engine_config import has_amx

    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN packed linear in this torch")
    g = torch.Generator().manual_seed(8)
    weight = (torch.randn(96, 64, generator=g) * 0.1).to(torch.bfloat16)
    packed = reorder(weight, 256)
    for rows in (layers.PAD_FROM_ROWS + 1, 200, 208):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        monkeypatch.setattr(layers, "_pad_rows", False)
        plain = layers._linear(x, weight, None, packed)
        monkeypatch.setattr(layers, "_pad_rows", True)
        padded = layers._linear(x, weight, None, packed)
        assert padded.shape == (rows, 96) and padded.is_contiguous()
        if has_amx():  # one tile kernel for every row: bit for bit (measured on AMX)
            assert torch.equal(padded, plain)
        else:
            torch.testing.assert_close(padded, plain, atol=1e-2, rtol=1.6e-2)


def _packs_here():
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN packed linear in this torch")
    return reorder


def test_float32_on_packed_weights_matches_f_linear_from_two_rows_and_the_head_from_one():
    reorder = _packs_here()
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(96, 64, generator=g) * 0.1
    bias = torch.randn(96, generator=g)
    packed = reorder(weight, 256)
    for rows in (1, 2, 7, 200, layers.PACKED_MAX_ROWS + 3):
        x = torch.randn(rows, 64, generator=g)
        ours = layers._linear(x, weight, bias, packed)
        torch.testing.assert_close(ours, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        if rows == 1:  # a layer's matrix-vector product stays on F.linear, bit for bit
            assert torch.equal(ours, F.linear(x, weight, bias))
        head = layers._linear(x, weight, None, packed, min_rows=1)
        assert torch.equal(head, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


class _Tiny(torch.nn.Module):
    """The parts pack_linears looks at: decoder layers of Linears, an LM head."""

    def __init__(self, dtype):
        super().__init__()
        block = torch.nn.Module()
        block.up, block.down = layers.Linear(32, 48, bias=False), layers.Linear(48, 32, bias=False)
        self.layers = torch.nn.ModuleList([block])
        self.embed_tokens = torch.nn.Embedding(100, 32)
        self.lm_head = layers.Linear(32, 100, bias=False)
        self.to(dtype)


@pytest.mark.parametrize("mode, dtype, packed", [
    ("0", torch.bfloat16, False), ("0", torch.float32, False),
    ("1", torch.bfloat16, True), ("float32", torch.float32, True), ("1", torch.float64, False)])
def test_pack_linears_packs_what_the_mode_and_dtype_say(monkeypatch, mode, dtype, packed):
    _packs_here()
    monkeypatch.setenv("CASCADE_ENGINE_PACKED_LINEAR", mode)
    model = _Tiny(dtype)
    count = layers.pack_linears(model)
    assert count == (3 if packed else 0)
    assert (model.layers[0].up.packed is not None) == packed
    assert (getattr(model, "packed_head", None) is not None) == packed
    if packed:
        x = torch.randn(5, 32, dtype=dtype)
        tol = _tol(dtype)
        torch.testing.assert_close(model.layers[0].up(x), F.linear(x, model.layers[0].up.weight), **tol)
        torch.testing.assert_close(layers.head_linear(model, x, model.lm_head.weight),
                                   F.linear(x, model.lm_head.weight), **tol)


def test_the_float32_choice_is_timed_once_per_machine_and_read_back(monkeypatch, tmp_path):
    _packs_here()
    monkeypatch.setenv("CASCADE_ENGINE_PACKED_LINEAR", "1")
    monkeypatch.setenv("CASCADE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(layers, "_fp32_choice", {})
    first = layers.pack_linears(_Tiny(torch.float32))
    assert first in (0, 3) and len(layers._fp32_choice) == 1
    (kept,) = tmp_path.glob("linear-choice-*.json")
    choice = next(iter(layers._fp32_choice.values()))
    assert list(json.loads(kept.read_text()).values()) == [choice]

    monkeypatch.setattr(layers, "_time_fp32", lambda *a: pytest.fail("timed again"))
    assert layers.pack_linears(_Tiny(torch.float32)) == first  # this process's choice
    monkeypatch.setattr(layers, "_fp32_choice", {})  # another process: the choice read from disk
    kept.write_text(json.dumps({k: not v for k, v in json.loads(kept.read_text()).items()}))
    assert layers.pack_linears(_Tiny(torch.float32)) == (0 if choice else 3)

    kept.write_text("<html>not json")  # a damaged file: timed again, and rewritten whole
    monkeypatch.setattr(layers, "_fp32_choice", {})
    monkeypatch.setattr(layers, "_time_fp32", lambda *a: True)
    assert layers.pack_linears(_Tiny(torch.float32)) == 3
    assert list(json.loads(kept.read_text()).values()) == [True]
