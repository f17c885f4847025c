"""The compiled CPU decode kernel against the pure-torch path (gather + SDPA) on the same cache:
every head dim it specializes (64, 128, 256) and one it does not, float32 and bfloat16 caches,
grouped-query heads, a sliding window, and both ways it shares out work (few sequences: by kv
head; many: by sequence)."""

import os
import subprocess
import sys

import pytest
import torch

from cloud_tier.engine.attention import AttentionMetadata, paged_attention

BLOCK = 16



def _step(num_seqs: int, heads: int, n_kv: int, dim: int, dtype: torch.dtype, window: int | None, native):
    """A decode step of ``num_seqs`` sequences with contexts of 1 to ~70 tokens on scattered blocks."""
    g = torch.Generator().manual_seed(num_seqs * 1000 + dim)
    num_blocks = 8 * num_seqs
    k_cache = torch.randn(num_blocks * BLOCK, n_kv, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK, n_kv, dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    lens = [1 + (7 * i * i + 3 * i) % 70 for i in range(num_seqs)]
    tables = [order[5 * i:5 * i + -(-n // BLOCK)] for i, n in enumerate(lens)]
    meta = AttentionMetadata.build([(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)], BLOCK,
                                   {window}, torch.device("cpu"), native)
    q = torch.randn(num_seqs, heads, dim, generator=g).to(dtype)
    k = torch.randn(num_seqs, n_kv, dim, generator=g).to(dtype)
    v = torch.randn(num_seqs, n_kv, dim, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("dim", [64, 128, 256, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 2, 40])
def test_the_kernel_matches_the_torch_path(native, dim, dtype, num_seqs):
    heads, n_kv = 6, 2
    q, k, v, kc, vc, meta = _step(num_seqs, heads, n_kv, dim, dtype, None, native)
    kernel = paged_attention(q, k, v, kc, vc, meta, dim ** -0.5)
    *_, torch_meta = _step(num_seqs, heads, n_kv, dim, dtype, None, None)
    reference = paged_attention(q, k, v, kc.clone(), vc.clone(), torch_meta, dim ** -0.5)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(kernel.float(), reference.float(), **tol)


@pytest.mark.parametrize("window", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_sees_only_its_last_tokens(native, window, dtype):
    """Windows that start mid-block and mid-tile (the bfloat16 path reads sixteen tokens at a time)."""
    q, k, v, kc, vc, meta = _step(12, 4, 1, 64, dtype, window, native)
    kernel = paged_attention(q, k, v, kc, vc, meta, 0.125, window)
    *_, torch_meta = _step(12, 4, 1, 64, dtype, window, None)
    reference = paged_attention(q, k, v, kc.clone(), vc.clone(), torch_meta, 0.125, window)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(kernel.float(), reference.float(), **tol)


def test_a_single_token_context_returns_its_value_row(native):
    """Softmax over one score is 1 whatever the score: the output is that token's V, exactly."""
    q, k, v, kc, vc, meta = _step(1, 3, 1, 64, torch.float32, None, native)
    assert int(meta.decodes[0].lens[0]) == 1
    out = paged_attention(q * 1e3, k, v, kc, vc, meta, 1.0)
    torch.testing.assert_close(out[0], v[0].expand(3, -1), atol=0, rtol=0)


@pytest.mark.parametrize("dim", [64, 128])
def test_both_bfloat16_paths_agree(native, dim, tmp_path):
    """Where the CPU has AVX512_BF16, bfloat16 takes its own path; CASCADE_ENGINE_FAST_DECODE=0
    keeps the generic one. Run in children (the switch is read once per process), the two agree to
    bfloat16's rounding of the output, on GQA heads with contexts that end mid-tile."""
    if not native.has_bf16_decode_path:
        pytest.skip("no AVX512_BF16 here: bfloat16 has only the generic path")
    g = torch.Generator().manual_seed(dim)
    lens = torch.tensor([1 + (13 * i * i + 5 * i) % 90 for i in range(40)], dtype=torch.int64)
    order = torch.randperm(40 * 6, generator=g)
    step = {"q": torch.randn(40, 9, dim, generator=g).to(torch.bfloat16),
            "kc": torch.randn(40 * 6 * BLOCK, 3, dim, generator=g).to(torch.bfloat16),
            "vc": torch.randn(40 * 6 * BLOCK, 3, dim, generator=g).to(torch.bfloat16),
            "tables": order.view(40, 6).contiguous(), "lens": lens}
    torch.save(step, tmp_path / "step.pt")
    script = ("import sys, torch\n"
              "from cloud_tier.engine import kernels\n"
              "t = torch.load(sys.argv[1])\n"
              "out = kernels.load().paged_decode(t['q'], t['kc'], t['vc'], t['tables'], t['lens'],\n"
              f"                                 {dim ** -0.5}, -1, {BLOCK})\n"
              "torch.save(out, sys.argv[2])\n")
    outs = []
    for flag in ("1", "0"):
        out = tmp_path / f"out{flag}.pt"
        subprocess.run([sys.executable, "-c", script, str(tmp_path / "step.pt"), str(out)], check=True,
                       env={**os.environ, "CASCADE_ENGINE_FAST_DECODE": flag}, timeout=600)
        outs.append(torch.load(out))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_gets_the_same_result_however_the_threads_share_the_work(native, dtype):
    """Sequences go to the threads longest first, whichever is free: one thread, two, and a batch in
    reverse order give every sequence the same bits."""
    heads, n_kv, dim = 9, 3, 64
    q, k, v, kc, vc, meta = _step(40, heads, n_kv, dim, dtype, None, native)
    paged_attention(q, k, v, kc, vc, meta, dim ** -0.5)  # stores the new rows
    group = meta.decodes[0]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            native.paged_decode(q, kc, vc, group.tables, group.lens, dim ** -0.5, 0, BLOCK, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    flipped = torch.empty_like(q)
    native.paged_decode(q.flip(0), kc, vc, group.tables.flip(0).contiguous(), group.lens.flip(0).contiguous(),
                        dim ** -0.5, 0, BLOCK, flipped)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], flipped.flip(0))
