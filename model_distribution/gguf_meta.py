"""Read a GGUF file's header metadata quickly, without loading tensors.

``gguf.GGUFReader`` builds a numpy view per field and takes 10-45 s on our models because
of the tokenizer arrays; listing models only needs a few scalar keys, so this walks the
key/value section once and skips arrays by their lengths.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"

# gguf value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALAR = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}

# llama_ftype (llama.h) -> the quantization name users know
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}


class GGUFError(ValueError):
    """The file is not a readable GGUF file."""


@dataclass(frozen=True)
class GGUFMetadata:
    """The scalar header keys of a GGUF file (arrays are skipped, their lengths kept)."""

    version: int
    tensor_count: int
    values: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.values.get("general.architecture", "unknown"))

    @property
    def name(self) -> str | None:
        return self.values.get("general.name")

    @property
    def quantization(self) -> str:
        ftype = self.values.get("general.file_type")
        return FILE_TYPES.get(ftype, f"ftype-{ftype}") if ftype is not None else "unknown"

    @property
    def chat_template(self) -> str | None:
        return self.values.get("tokenizer.chat_template")

    @property
    def context_length(self) -> int | None:
        return self.values.get(f"{self.architecture}.context_length")

    @property
    def vocab_size(self) -> int | None:
        return self.array_lengths.get("tokenizer.ggml.tokens")


def read_metadata(path: str | Path) -> GGUFMetadata:
    """Parse the header of the GGUF file at ``path``; raise GGUFError if it is not one."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        try:
            version, n_tensors, n_kv = struct.unpack("<IQQ", _read(f, 20))
            values: dict[str, Any] = {}
            lengths: dict[str, int] = {}
            for _ in range(n_kv):
                key = _read_str(f)
                vtype = _read_scalar(f, _UINT32)
                if vtype == _ARRAY:
                    item_type = _read_scalar(f, _UINT32)
                    count = _read_scalar(f, _UINT64)
                    lengths[key] = count
                    _skip_array(f, item_type, count)
                else:
                    values[key] = _read_value(f, vtype)
        except (struct.error, UnicodeDecodeError, EOFError) as e:
            raise GGUFError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    return GGUFMetadata(version=version, tensor_count=n_tensors, values=values, array_lengths=lengths)


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError("unexpected end of file")
    return data


def _read_scalar(f: BinaryIO, vtype: int) -> Any:
    fmt = _SCALAR[vtype]
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _read_str(f: BinaryIO) -> str:
    return _read(f, _read_scalar(f, _UINT64)).decode("utf-8")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_str(f)
    if vtype in _SCALAR:
        return _read_scalar(f, vtype)
    raise GGUFError(f"unknown GGUF value type {vtype}")


def _skip_array(f: BinaryIO, item_type: int, count: int) -> None:
    if item_type in _SCALAR:
        f.seek(struct.calcsize(_SCALAR[item_type]) * count, 1)
    elif item_type == _STRING:
        for _ in range(count):
            f.seek(_read_scalar(f, _UINT64), 1)
    elif item_type == _ARRAY:
        for _ in range(count):
            inner = _read_scalar(f, _UINT32)
            _skip_array(f, inner, _read_scalar(f, _UINT64))
    else:
        raise GGUFError(f"unknown GGUF array item type {item_type}")
