"""Read and validate a GGUF file's header quickly, without loading tensors.

``gguf.GGUFReader`` builds a numpy view per field and takes 10-45 s on our models because
of the tokenizer arrays. ``read_metadata`` (model listing) walks the key/value section once and
skips arrays by their lengths; ``validate_gguf`` (publishing) also walks the tensor infos and
checks that the data they describe is laid out the way llama.cpp's loader (ggml ``gguf.cpp``)
requires, still reading only the header: never tensor data.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from gguf.constants import GGML_QUANT_SIZES

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # llama.cpp dropped v1; v2 and v3 share the layout read here
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # a tensor name and its NUL must fit in ggml_tensor.name

# gguf value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALAR = {vtype: struct.Struct(fmt) for vtype, fmt in {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}.items()}
_U32, _U64, _I64 = _SCALAR[_UINT32], _SCALAR[_UINT64], _SCALAR[_INT64]
_PREAMBLE = struct.Struct("<IQQ")  # version, tensor count, key/value count
# the fewest bytes one key/value (empty key, one uint8) and one tensor info (empty name, one dim) take
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
# ggml type id -> (name, elements per block, bytes per block), from the gguf package's tables
_GGML_TYPES = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGML_QUANT_SIZES}
_WINDOW = 1 << 20

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
        if not isinstance(ftype, int) or isinstance(ftype, bool):
            return "unknown"
        return FILE_TYPES.get(ftype, f"ftype-{ftype}")

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
        r = _Reader(f)
        if r.size < 4 or _magic(r) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        try:
            version, n_tensors, n_kv = _PREAMBLE.unpack_from(*r.take(_PREAMBLE.size, "the header"))
            values, lengths, _ = _read_kvs(r, n_kv)
        except GGUFError as e:
            raise GGUFError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    return GGUFMetadata(version=version, tensor_count=n_tensors, values=values, array_lengths=lengths)


def validate_gguf(path: str | Path) -> GGUFMetadata:
    """The header of the GGUF file at ``path``, once the whole file checks out as one llama.cpp loads.

    Raises GGUFError with a one-line reason (without the path) unless: the magic is right; the
    version is 2 or 3; there is at least one tensor and a string ``general.architecture``; every
    key/value parses (known types, no duplicate keys, lengths and counts within the file);
    ``general.alignment``, if present, is a uint32 power of two; every tensor info parses (a unique
    name shorter than 64 bytes, 1 to 4 dims each >= 1 whose product fits an int64, a ggml type the
    ``gguf`` package knows, a first dim that is a multiple of its block size, an aligned offset); and
    every tensor's data lies inside the file, overlaps no other, and sits where ggml expects it
    (each tensor right after the previous one, padded to the alignment). Reads headers only.
    """
    with open(path, "rb") as f:
        r = _Reader(f)
        if r.size < 4 or _magic(r) != GGUF_MAGIC:
            raise GGUFError("not a GGUF file: it does not start with the GGUF magic")
        version, n_tensors, n_kv = _PREAMBLE.unpack_from(*r.take(_PREAMBLE.size, "the header"))
        if version not in SUPPORTED_VERSIONS:
            endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise GGUFError(f"unsupported GGUF version {version}{endian}: llama.cpp reads versions 2 and 3")
        if n_tensors == 0:
            raise GGUFError("no tensors: the header says the file holds 0 tensors")
        values, lengths, types = _read_kvs(r, n_kv)
        if types.get("general.architecture") != _STRING:
            raise GGUFError("no general.architecture: the header has no string key naming the model architecture")
        alignment = _alignment(values, types)
        tensors = _read_tensor_infos(r, n_tensors, alignment)
        _check_data(tensors, _aligned(r.pos, alignment), r.size, alignment)
    return GGUFMetadata(version=version, tensor_count=n_tensors, values=values, array_lengths=lengths)


class _Reader:
    """Bounds-checked reads at a cursor through a window of the file: skipped bytes are never read."""

    def __init__(self, f: BinaryIO):
        self.f, self.size, self.pos = f, os.fstat(f.fileno()).st_size, 0
        self.base, self.window = 0, b""

    def skip(self, n: int, what: str) -> int:
        """Move past the ``n`` bytes of ``what``; return where they start."""
        if n > self.size - self.pos:
            raise GGUFError(f"{what} needs {n} bytes at offset {self.pos} but the file ends at byte {self.size} "
                            "(truncated, or a corrupt length)")
        start, self.pos = self.pos, self.pos + n
        return start

    def take(self, n: int, what: str) -> tuple[bytes, int]:
        """The window holding the next ``n`` bytes, and where they start in it."""
        start = self.skip(n, what)
        at = start - self.base
        if at + n > len(self.window):
            self.f.seek(start)
            self.base, self.window, at = start, self.f.read(max(n, _WINDOW)), 0
            if len(self.window) < n:
                raise GGUFError(f"{what}: the file shrank while it was read")
        return self.window, at

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack_from(*self.take(fmt.size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(_U64, f"the length of {what}")
        window, at = self.take(n, f"{what} (a string of {n} bytes)")
        try:
            return window[at:at + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} is not valid UTF-8") from e

    def skip_strings(self, count: int, what: str) -> None:
        unpack = _U64.unpack_from
        for _ in range(count):  # the tokenizer's tokens and merges: no per-item calls to spare
            self.skip(unpack(*self.take(8, what))[0], what)


def _magic(r: _Reader) -> bytes:
    window, at = r.take(4, "the magic")
    return window[at:at + 4]


def _read_kvs(r: _Reader, n_kv: int) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    """The key/value section: scalar values, array lengths, and every key's value type."""
    if n_kv * _MIN_KV_BYTES > r.size - r.pos:
        raise GGUFError(f"the header claims {n_kv} key/value pairs, more than the {r.size - r.pos} bytes left "
                        "in the file hold (truncated, or a corrupt count)")
    values: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        key = r.string(f"key {i}")
        if key in types:
            raise GGUFError(f"duplicate key {key!r}")
        what = f"key {key!r}"
        types[key] = vtype = r.scalar(_U32, f"the type of {what}")
        if vtype == _ARRAY:
            lengths[key] = _skip_array(r, what)
        elif vtype == _STRING:
            values[key] = r.string(what)
        elif vtype in _SCALAR:
            values[key] = r.scalar(_SCALAR[vtype], what)
        else:
            raise GGUFError(f"{what} has unknown value type {vtype}")
    return values, lengths, types


def _skip_array(r: _Reader, what: str) -> int:
    item_type = r.scalar(_U32, f"the item type of {what}")
    count = r.scalar(_U64, f"the length of {what}")
    item_bytes = 8 if item_type == _STRING else _SCALAR[item_type].size if item_type in _SCALAR else None
    if item_bytes is None:  # ggml reads no arrays of arrays
        raise GGUFError(f"{what} is an array of unknown or unsupported value type {item_type}")
    if count * item_bytes > r.size - r.pos:
        raise GGUFError(f"{what} claims {count} items, more than the {r.size - r.pos} bytes left in the file hold "
                        "(truncated, or a corrupt count)")
    if item_type == _STRING:
        r.skip_strings(count, f"a string of {what}")
    else:
        r.skip(count * item_bytes, what)
    return count


def _alignment(values: dict[str, Any], types: dict[str, int]) -> int:
    if "general.alignment" not in types:
        return DEFAULT_ALIGNMENT
    if types["general.alignment"] != _UINT32:  # ggml asserts the type and aborts otherwise
        raise GGUFError(f"general.alignment has value type {types['general.alignment']}, not uint32")
    alignment = values["general.alignment"]
    if alignment == 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment {alignment} is not a power of two")
    return alignment


class _Tensor(NamedTuple):
    name: str
    offset: int  # from the start of the data section
    nbytes: int


def _read_tensor_infos(r: _Reader, n_tensors: int, alignment: int) -> list[_Tensor]:
    if n_tensors * _MIN_TENSOR_INFO_BYTES > r.size - r.pos:
        raise GGUFError(f"the header claims {n_tensors} tensors, more than the {r.size - r.pos} bytes left in the "
                        "file hold (truncated, or a corrupt count)")
    tensors: dict[str, _Tensor] = {}
    for i in range(n_tensors):
        name = r.string(f"the name of tensor {i}")
        if len(name.encode()) >= GGML_MAX_NAME:
            raise GGUFError(f"tensor {i}'s name {name[:80]!r} is longer than ggml's {GGML_MAX_NAME - 1} bytes")
        if name in tensors:
            raise GGUFError(f"duplicate tensor name {name!r}")
        what = f"tensor {name!r}"
        n_dims = r.scalar(_U32, f"the n_dims of {what}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GGUFError(f"{what} has {n_dims} dimensions, not 1 to {GGML_MAX_DIMS}")
        shape = [r.scalar(_I64, f"the dims of {what}") for _ in range(n_dims)]
        if min(shape) < 1:
            raise GGUFError(f"{what} has shape {shape}: every dimension must be at least 1")
        if math.prod(shape) >= 2**63 - 1:  # ggml counts elements in an int64
            raise GGUFError(f"{what} has shape {shape}: its element count overflows an int64")
        type_id = r.scalar(_U32, f"the ggml type of {what}")
        if type_id not in _GGML_TYPES:
            raise GGUFError(f"{what} has unknown ggml type {type_id}")
        type_name, block, block_bytes = _GGML_TYPES[type_id]
        if shape[0] % block:
            raise GGUFError(f"{what} has first dimension {shape[0]}, not a multiple of the {type_name} "
                            f"block size {block}")
        offset = r.scalar(_U64, f"the offset of {what}")
        if offset % alignment:
            raise GGUFError(f"{what} has offset {offset}, not a multiple of the alignment {alignment}")
        tensors[name] = _Tensor(name, offset, shape[0] // block * block_bytes * math.prod(shape[1:]))
    return list(tensors.values())


def _check_data(tensors: list[_Tensor], data_start: int, file_size: int, alignment: int) -> None:
    """Every tensor's bytes inside the file, none overlapping, each where ggml's loader expects it."""
    for t in tensors:
        if data_start + t.offset + t.nbytes > file_size:
            raise GGUFError(f"tensor {t.name!r} ({t.nbytes} bytes at offset {t.offset} of the data section "
                            f"starting at byte {data_start}) runs past the end of the file at byte {file_size}: "
                            "the file is truncated or the offset is corrupt")
    by_offset = sorted(tensors, key=lambda t: t.offset)
    for a, b in itertools.pairwise(by_offset):
        if b.offset < a.offset + a.nbytes:
            raise GGUFError(f"tensors {a.name!r} and {b.name!r} overlap: {a.name!r} spans data bytes "
                            f"[{a.offset}, {a.offset + a.nbytes}) and {b.name!r} starts at {b.offset}")
    expected = 0
    for t in tensors:  # ggml gguf.cpp: tensors follow each other in header order, each padded
        if t.offset != expected:
            raise GGUFError(f"tensor {t.name!r} has offset {t.offset} but llama.cpp expects {expected}: "
                            "tensors must follow each other in header order, each padded to the alignment")
        expected += _aligned(t.nbytes, alignment)


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment
