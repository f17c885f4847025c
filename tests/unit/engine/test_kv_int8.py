"""The INT8 KV cache: quantization bounds, the compiled int8 decode kernel against the torch path
and the float kernel, the transfer payload's exact round trip, and the blocks a budget buys."""

import pytest
import torch

from cloud_tier.engine.attention import AttentionMetadata, paged_attention
from cloud_tier.engine.kv_quant import Int8KV, dequantize, pack, quantize, unpack
from cloud_tier.engine.model_runner import ModelRunner
from cloud_tier.engine.models.llama import LlamaForCausalLM

BLOCK = 4


def tiny_llama(num_kv_heads: int = 2, head_dim: int = 16) -> LlamaForCausalLM:
    """A random-weight Llama: 2 layers, 4 query heads."""
    torch.manual_seed(0)
    config = {"vocab_size": 64, "hidden_size": 4 * head_dim, "num_attention_heads": 4,
              "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "intermediate_size": 96,
              "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    return LlamaForCausalLM(config, max_pos=256).eval()


def test_dequantized_rows_are_within_half_a_step_of_the_input():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of very different magnitude
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    assert (q.abs() <= 127).all() and (q.abs().amax(-1) == 127).all()  # each row's absmax maps to +-127
    err = (dequantize(q, scale, torch.float32) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()


def test_an_all_zero_row_stays_zero_and_bfloat16_input_quantizes_like_its_float32_value():
    x = torch.zeros(2, 1, 8)
    x[1, 0, 3] = -2.5
    q, scale = quantize(x)
    assert scale[0, 0] == 0 and (q[0] == 0).all() and (dequantize(q, scale, torch.float32)[0] == 0).all()
    assert q[1, 0, 3] == -127 and dequantize(q, scale, torch.float32)[1, 0, 3] == -2.5
    y = torch.randn(5, 2, 16).bfloat16()
    for a, b in zip(quantize(y), quantize(y.float()), strict=True):
        assert torch.equal(a, b)


def test_pack_and_unpack_are_exact_inverses():
    q, scale = quantize(torch.randn(3, 4, 2, 16))
    packed = pack(q, scale)
    assert packed.dtype == torch.int8 and packed.shape == (3, 4, 2, 20)
    q2, scale2 = unpack(packed)
    assert torch.equal(q2, q) and torch.equal(scale2, scale)


def test_int8_budget_buys_about_four_times_the_float32_blocks_and_twice_the_bfloat16_ones():
    model = tiny_llama(head_dim=64)
    fp32 = ModelRunner.bytes_per_block(model, 16, torch.float32)
    bf16 = ModelRunner.bytes_per_block(model, 16, torch.bfloat16)
    int8 = ModelRunner.bytes_per_block(model, 16, torch.float32, "int8")
    assert int8 == 2 * 2 * 16 * 2 * (64 + 4)  # K and V, layers, tokens, kv heads, bytes per row + scale
    assert ModelRunner.bytes_per_block(model, 16, torch.bfloat16, "int8") == int8  # whatever the model dtype
    budget = 1 << 24
    assert 3.7 < (budget // int8) / (budget // fp32) <= 4 and 1.85 < (budget // int8) / (budget // bf16) <= 2


def _filled_runner(kv_cache_dtype: str, seed: int, num_blocks: int = 6) -> ModelRunner:
    runner = ModelRunner(tiny_llama(), num_blocks, BLOCK, torch.float32, torch.device("cpu"),
                         kv_cache_dtype=kv_cache_dtype)
    runner.native_attention = None
    torch.manual_seed(seed)
    for k, v in runner.kv_caches:
        slots = torch.arange(num_blocks * BLOCK)
        for cache in (k, v):
            x = torch.randn(len(slots), 2, 16)
            if isinstance(cache, Int8KV):
                cache.write(slots, x)
            else:
                cache.copy_(x)
    return runner


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_read_blocks_then_write_blocks_round_trips_exactly(kv_cache_dtype):
    src, dst = _filled_runner(kv_cache_dtype, 1), _filled_runner(kv_cache_dtype, 2)
    payload = src.read_blocks([4, 1, 2])
    row = 20 if kv_cache_dtype == "int8" else 16
    assert payload.shape == (2, 2, 3, BLOCK, 2, row)
    assert payload.nbytes == 3 * ModelRunner.bytes_per_block(src.model, BLOCK, torch.float32, kv_cache_dtype)
    dst.write_blocks([0, 5, 3], payload)
    assert torch.equal(dst.read_blocks([0, 5, 3]), payload)
    assert not torch.equal(dst.read_blocks([1]), payload[:, :, 1:2])  # other blocks kept their own


def test_a_float_payload_is_refused_by_an_int8_cache_and_vice_versa():
    floats, ints = _filled_runner("auto", 1), _filled_runner("int8", 1)
    with pytest.raises(ValueError, match="does not match"):
        ints.write_blocks([0], floats.read_blocks([0]))
    with pytest.raises(ValueError, match="does not match"):
        floats.write_blocks([0], ints.read_blocks([0]))


def _decode_batch(n_kv: int, window: int | None, native):
    """Random int8 caches, and a decode step of 3 sequences with contexts crossing blocks."""
    torch.manual_seed(2)
    num_blocks, heads, dim = 16, 4, 32
    k_cache, v_cache = Int8KV.zeros((num_blocks * BLOCK, n_kv, dim), "cpu"), Int8KV.zeros(
        (num_blocks * BLOCK, n_kv, dim), "cpu")
    slots = torch.arange(num_blocks * BLOCK)
    k_cache.write(slots, torch.randn(len(slots), n_kv, dim))
    v_cache.write(slots, torch.randn(len(slots), n_kv, dim))
    tables = [[3, 7, 1], [9], [2, 4, 6, 8, 10]]
    lens = [11, 2, 19]
    meta = AttentionMetadata.build([(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)], BLOCK,
                                   {window}, torch.device("cpu"), native)
    q, k, v = torch.randn(3, heads, dim), torch.randn(3, n_kv, dim), torch.randn(3, n_kv, dim)
    return q, k, v, k_cache, v_cache, meta



@pytest.mark.parametrize("n_kv, window", [(4, None), (2, None), (1, 5)])
def test_the_int8_kernel_matches_the_torch_path_and_the_float_kernel_on_the_same_values(native, n_kv, window):
    q, k, v, kc, vc, meta = _decode_batch(n_kv, window, native)
    kc2, vc2 = Int8KV(kc.data.clone(), kc.scale.clone()), Int8KV(vc.data.clone(), vc.scale.clone())
    kernel = paged_attention(q, k, v, kc, vc, meta, 0.2, window)
    _, _, _, _, _, torch_meta = _decode_batch(n_kv, window, None)
    reference = paged_attention(q, k, v, kc2, vc2, torch_meta, 0.2, window)
    torch.testing.assert_close(kernel, reference, atol=1e-5, rtol=1e-4)
    # the float kernel over the dequantized cache (the new tokens included) computes the same from 4x the bytes
    kf, vf = kc.rows(torch.arange(len(kc.data)), torch.float32), vc.rows(torch.arange(len(vc.data)), torch.float32)
    slots = meta.slot_mapping
    floats = paged_attention(q, kf[slots], vf[slots], kf, vf, meta, 0.2, window)
    torch.testing.assert_close(kernel, floats, atol=1e-5, rtol=1e-4)


def test_engine_config_takes_auto_or_int8_and_names_both_when_refusing():
    from cloud_tier.engine_config import EngineConfig

    assert EngineConfig().kv_cache_dtype == "auto" and EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
