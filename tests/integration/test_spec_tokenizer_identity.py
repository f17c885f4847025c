"""Tokenizer identities (model_distribution/artifacts/tokenizer_identity.py) of the catalogue's real
GGUFs: the Qwen2.5-Coder tier pair share one (a 0.5B draft is meaningful to the 1.5B), SmolLM2's
differs; the fast walk reads the same four values as gguf's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from cascade.config import cascade_home
from model_distribution.artifacts.catalog import Catalog
from model_distribution.artifacts.tokenizer_identity import GGUF_KEYS, _gguf_fields, tokenizer_identity


def gguf(name: str) -> Path:
    info = Catalog(cascade_home()).get(name)
    if not info.ready:
        pytest.skip(f"{name} is not assembled in {cascade_home()}")
    return Path(info.path)


def test_the_qwen_pair_shares_an_identity_and_smollm2_has_another():
    small, large = tokenizer_identity(gguf("qwen2.5-coder-0.5b")), tokenizer_identity(gguf("qwen2.5-coder-1.5b"))
    smol = tokenizer_identity(gguf("smollm2-135m"))
    assert small == large and len(small) == 64
    assert smol != small


def test_the_walk_reads_what_gguf_reads():
    from gguf import GGUFReader

    path = gguf("smollm2-135m")
    reader = GGUFReader(str(path))
    theirs = []
    for key in GGUF_KEYS:
        f = reader.fields.get(key)
        if f is None:
            theirs.append(None)
        elif len(f.types) > 1:
            theirs.append([bytes(f.parts[i]).decode() for i in f.data])
        else:
            theirs.append(bytes(f.parts[f.data[0]]).decode())
    assert _gguf_fields(path) == theirs


def test_an_hf_directory_has_an_identity_of_its_own(tmp_path):
    from tests.tiny_qwen2 import make_tiny_qwen2

    a = tokenizer_identity(make_tiny_qwen2(tmp_path / "a", tie=True))
    b = tokenizer_identity(make_tiny_qwen2(tmp_path / "b", tie=False, seed=1))  # other weights, same tokenizer
    assert a == b
    with pytest.raises(ValueError):
        tokenizer_identity(tmp_path)
