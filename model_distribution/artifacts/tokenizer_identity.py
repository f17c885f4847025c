"""A tokenizer's identity: two models whose identities are equal tokenize every text into the same
ids, so a draft one of them generated is meaningful to the other (the device's draft, verified by
the cloud's engine). Torch-free: the edge agent computes it for its model, the worker for its own.

For a GGUF: sha256 over ``tokenizer.ggml.model``, ``tokenizer.ggml.pre``, ``tokenizer.ggml.tokens``
and ``tokenizer.ggml.merges`` in this order, each length-prefixed (a tag byte: absent, a string or
an array; then the 8-byte little-endian length of its encoding; an array's encoding is its count,
then each item length-prefixed). For an HF directory (no GGUF: the tests' tiny models), the same
over tokenizer.json's model type, pre-tokenizer (canonical JSON), vocabulary in id order (added
tokens included) and merges: equal HF directories agree, but never with a GGUF."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO

from gguf.constants import GGUFValueType

GGUF_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_ABSENT, _STRING, _ARRAY = b"\x00", b"\x01", b"\x02"
_SCALAR_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
                 GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


def tokenizer_identity(path: str | Path) -> str:
    """The identity (sha256 hex) of the tokenizer of the GGUF file or HF directory at ``path``.
    ValueError if it has none."""
    path = Path(path)
    fields = _hf_fields(path) if path.is_dir() else _gguf_fields(path)
    h = hashlib.sha256()
    for value in fields:
        h.update(_encode(value))
    return h.hexdigest()


def model_tokenizer_identity(model: str) -> str:
    """The identity of a model named as the engine names one: a .gguf path, an HF directory or a
    catalogue name (its GGUF, assembled already when the engine loaded it)."""
    path = Path(model).expanduser()
    if not path.exists():
        from cascade.config import cascade_home
        from model_distribution.artifacts.catalog import Catalog

        catalog = Catalog(cascade_home())
        path = catalog.ensure_ready(catalog.get(model))
    return tokenizer_identity(path)


def _encode(value: str | list[str] | None) -> bytes:
    if value is None:
        return _ABSENT + _length(0)
    if isinstance(value, str):
        data = value.encode()
        return _STRING + _length(len(data)) + data
    items = b"".join(_length(len(b)) + b for b in (v.encode() for v in value))
    data = _length(len(value)) + items
    return _ARRAY + _length(len(data)) + data


def _length(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _gguf_fields(path: Path) -> list[str | list[str] | None]:
    """The four keys' values, read by one walk over the key/value section (``gguf.GGUFReader``
    builds a numpy view per array item: 10 s and more for a 150k-token vocabulary)."""
    wanted: dict[str, str | list[str]] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        for _ in range(n_kv):
            key = _string(f)
            (vtype,) = struct.unpack("<I", f.read(4))
            value = _value(f, vtype, keep=key in GGUF_KEYS)
            if key in GGUF_KEYS:
                wanted[key] = value
    if "tokenizer.ggml.tokens" not in wanted:
        raise ValueError(f"{path}: a GGUF without a tokenizer (no tokenizer.ggml.tokens)")
    return [wanted.get(key) for key in GGUF_KEYS]


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "surrogateescape")


def _value(f: BinaryIO, vtype: int, keep: bool):
    """A value of ``vtype`` (strings and arrays of strings kept when ``keep``; the rest skipped)."""
    if vtype == GGUFValueType.STRING:
        return _string(f)
    if vtype == GGUFValueType.ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item == GGUFValueType.STRING:
            items = [_string(f) for _ in range(count)]
            return items if keep else None
        if item == GGUFValueType.ARRAY:
            return [_value(f, item, keep) for _ in range(count)]
        f.seek(_SCALAR_SIZES[GGUFValueType(item)] * count, 1)
        return None
    f.seek(_SCALAR_SIZES[GGUFValueType(vtype)], 1)
    return None


def _hf_fields(path: Path) -> list[str | list[str] | None]:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{path}: an HF directory without tokenizer.json")
    tok = json.loads(file.read_text())
    model = tok.get("model") or {}
    vocab = dict(model.get("vocab") or {})
    for added in tok.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return [str(model.get("type")), json.dumps(tok.get("pre_tokenizer"), sort_keys=True),
            [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])], merges]
