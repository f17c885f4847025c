"""dtype "auto": what it stands for on each kind of machine."""

import pytest

import cloud_tier.engine_config as config
from cloud_tier.engine_config import EngineConfig, resolve_dtype


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
    ({"avx2", "avx512f"}, "float32"),  # AVX-512 without bf16: bf16 GEMMs would be emulated
    (set(), "float32"),  # flags unknown
])
def test_auto_is_bfloat16_only_where_the_cpu_computes_in_it(monkeypatch, flags, expected):
    monkeypatch.setattr(config, "_cpu_flags", lambda: flags)
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("float32", "cuda") == "float32" and resolve_dtype("bfloat16", "cpu") == "bfloat16"


def test_auto_is_an_accepted_engine_dtype():
    assert EngineConfig(dtype="auto").dtype == "auto"
    with pytest.raises(ValueError):
        EngineConfig(dtype="int4")
