"""validate_gguf refuses every GGUF llama.cpp would refuse, from the header alone: truncations,
corrupt counts and lengths, bad versions, tensor infos and tensor data layouts. The bad files are
a small valid GGUF (written by the `gguf` package) with a few bytes edited."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from model_distribution.artifacts.catalog import Catalog
from model_distribution.artifacts.gguf_meta import GGUFError, validate_gguf
from tests.unit.test_registry import make_gguf


def write_gguf(path: Path, alignment: int | None = None) -> Path:
    """Three tensors of three ggml types (F32, Q8_0, F16), a tokenizer array, no trailing padding."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_context_length(64)
    w.add_file_type(7)
    w.add_token_list(["a", "bb", "ccc", "dddd"])
    w.add_token_scores([0.0, 1.0, 2.0, 3.0])
    w.add_tensor("a.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("b.weight", np.ones((2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", np.ones((32,), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


ARCH, TOKENS, SCORES = "general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.scores"


def put(data: bytes, at: int, fmt: str, value: int) -> bytes:
    edited = bytearray(data)
    struct.pack_into(fmt, edited, at, value)
    return bytes(edited)


def _after(data: bytes, name: str) -> int:
    """Where what follows the length-prefixed string ``name`` starts."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def kv_type_at(data: bytes, key: str) -> int:
    """The byte position of ``key``'s value type (its value follows it; an array's item type and count too)."""
    return _after(data, key)


def tensor_field_at(data: bytes, name: str, field: str) -> int:
    """The byte position of one field of tensor ``name``'s info: n_dims, dims, type or offset."""
    at = _after(data, name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return {"n_dims": at, "dims": at + 4, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}[field]


def shift_offset(data: bytes, name: str, by: int) -> bytes:
    at = tensor_field_at(data, name, "offset")
    return put(data, at, "<Q", struct.unpack_from("<Q", data, at)[0] + by)


@pytest.fixture
def good(tmp_path) -> Path:
    return write_gguf(tmp_path / "good.gguf")


@pytest.fixture
def smollm2(tmp_path) -> Path:
    return Catalog(tmp_path).get("smollm2-135m").path


def refused(tmp_path: Path, data: bytes) -> str:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(GGUFError) as e:
        validate_gguf(bad)
    return str(e.value)


def test_real_ggufs_pass(smollm2, good, tmp_path):
    meta = validate_gguf(smollm2)
    assert (meta.version, meta.tensor_count, meta.architecture, meta.quantization) == (3, 272, "llama", "Q4_1")
    assert meta.vocab_size == 49152
    assert validate_gguf(make_gguf(tmp_path / "registry.gguf")).tensor_count == 1
    assert validate_gguf(good).array_lengths == {"tokenizer.ggml.tokens": 4, "tokenizer.ggml.scores": 4}
    assert validate_gguf(write_gguf(tmp_path / "aligned64.gguf", alignment=64)).values["general.alignment"] == 64


def test_a_1gb_gguf_with_a_big_vocabulary_validates_without_reading_tensor_data(tmp_path):
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"t{i}" for i in range(262_144)])
    w.add_tensor_info("big", (16384, 16384), np.dtype(np.float32), 16384 * 16384 * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + 16384 * 16384 * 4)  # sparse: the data is a hole
    start = time.perf_counter()
    assert validate_gguf(path).vocab_size == 262_144
    assert time.perf_counter() - start < 1.0  # about 0.1 s here; GGUFReader takes seconds


def test_smollm2_cut_short_is_refused(smollm2, tmp_path):
    with open(smollm2, "rb") as f:
        head = f.read(4_000_000)
    assert "key 'tokenizer.ggml.tokens' claims 49152 items, more than the 6893 bytes left in the file hold " \
           "(truncated, or a corrupt count)" == refused(tmp_path, head[:8000])
    assert "runs past the end of the file at byte 4000000" in refused(tmp_path, head)


def cut_points(data: bytes, path: Path) -> dict[str, tuple[int, str]]:
    """Where to cut the small GGUF, and what the reason must name."""
    data_start = gguf.GGUFReader(path).tensors[0].data_offset
    return {
        "in the preamble": (12, "the header needs 20 bytes at offset 4 but the file ends at byte 12"),
        "in the first key": (30, "the header claims 5 key/value pairs, more than the 6 bytes left"),
        "in the token array": (kv_type_at(data, TOKENS) + 20, "key 'tokenizer.ggml.tokens' claims 4 items"),
        "in the last token": (data.index(b"dddd") + 2, "a string of key 'tokenizer.ggml.tokens' needs 4 bytes"),
        "in the float array": (kv_type_at(data, SCORES) + 20, "key 'tokenizer.ggml.scores' claims 4 items"),
        "in the first tensor info": (tensor_field_at(data, "a.weight", "dims"), "the header claims 3 tensors"),
        "in the last tensor's name": (data.index(b"c.weight") + 4, "the name of tensor 2 (a string of 8 bytes)"),
        "in the last tensor's dims": (tensor_field_at(data, "c.weight", "dims") + 3, "the dims of tensor 'c.weight'"),
        "in the last tensor's offset": (tensor_field_at(data, "c.weight", "offset") + 3,
                                        "the offset of tensor 'c.weight' needs 8 bytes"),
        "at the data start": (data_start, "tensor 'a.weight' (512 bytes at offset 0 of the data section"),
        "in the data": (data_start + 520, "tensor 'b.weight' (68 bytes at offset 512"),
        "one byte short": (len(data) - 1, "tensor 'c.weight' (64 bytes at offset 608"),
    }


@pytest.mark.parametrize("where", ["in the preamble", "in the first key", "in the token array", "in the last token",
                                   "in the float array", "in the first tensor info", "in the last tensor's name",
                                   "in the last tensor's dims", "in the last tensor's offset", "at the data start",
                                   "in the data", "one byte short"])
def test_a_truncated_file_is_refused_naming_where_it_ends(good, tmp_path, where):
    data = good.read_bytes()
    cut, names = cut_points(data, good)[where]
    reason = refused(tmp_path, data[:cut])
    assert names in reason and "truncated" in reason


def test_gguf_magic_then_zeros_is_refused(tmp_path):
    assert refused(tmp_path, b"GGUF" + bytes(1000)).startswith("unsupported GGUF version 0")
    assert "GGUF magic" in refused(tmp_path, b"GGU")
    assert "GGUF magic" in refused(tmp_path, b"")


REFUSALS = {  # an edit of the small GGUF's bytes -> what the reason must say
    "version 1": (lambda d: put(d, 4, "<I", 1), "unsupported GGUF version 1: llama.cpp reads versions 2 and 3"),
    "version 4": (lambda d: put(d, 4, "<I", 4), "unsupported GGUF version 4"),
    "big-endian": (lambda d: put(d, 4, "<I", 3 << 24), "version 50331648 (a big-endian file?)"),
    "zero tensors": (lambda d: put(d, 8, "<Q", 0), "no tensors"),
    "tensor count past the file": (lambda d: put(d, 8, "<Q", 2**40), "claims 1099511627776 tensors"),
    "key count past the file": (lambda d: put(d, 16, "<Q", 2**40), "claims 1099511627776 key/value pairs"),
    "key length past the file": (lambda d: put(d, 24, "<Q", 2**62), "key 0 (a string of 4611686018427387904 bytes)"),
    "string length past the file": (lambda d: put(d, kv_type_at(d, ARCH) + 4, "<Q", 2**40),
                                    "key 'general.architecture' (a string of 1099511627776 bytes) needs"),
    "string array count past the file": (lambda d: put(d, kv_type_at(d, TOKENS) + 8, "<Q", 2**60),
                                         "key 'tokenizer.ggml.tokens' claims 1152921504606846976 items"),
    "float array count past the file": (lambda d: put(d, kv_type_at(d, SCORES) + 8, "<Q", 2**40),
                                        "key 'tokenizer.ggml.scores' claims 1099511627776 items"),
    "unknown value type": (lambda d: put(d, kv_type_at(d, "llama.context_length"), "<I", 13),
                           "key 'llama.context_length' has unknown value type 13"),
    "array of arrays": (lambda d: put(d, kv_type_at(d, TOKENS) + 4, "<I", 9),
                        "key 'tokenizer.ggml.tokens' is an array of unknown or unsupported value type 9"),
    "duplicate key": (lambda d: d.replace(b"llama.context_length", ARCH.encode()),
                      "duplicate key 'general.architecture'"),
    "no architecture": (lambda d: d.replace(ARCH.encode(), b"general.architectur3"), "no general.architecture"),
    "duplicate tensor name": (lambda d: d.replace(b"c.weight", b"a.weight"), "duplicate tensor name 'a.weight'"),
    "no dims": (lambda d: put(d, tensor_field_at(d, "a.weight", "n_dims"), "<I", 0),
                "tensor 'a.weight' has 0 dimensions, not 1 to 4"),
    "five dims": (lambda d: put(d, tensor_field_at(d, "a.weight", "n_dims"), "<I", 5),
                  "tensor 'a.weight' has 5 dimensions, not 1 to 4"),
    "a zero dim": (lambda d: put(d, tensor_field_at(d, "a.weight", "dims") + 8, "<q", 0),
                   "tensor 'a.weight' has shape [32, 0]: every dimension must be at least 1"),
    "dims product overflows": (lambda d: put(put(d, tensor_field_at(d, "a.weight", "dims"), "<q", 2**32),
                                             tensor_field_at(d, "a.weight", "dims") + 8, "<q", 2**31),
                               "tensor 'a.weight' has shape [4294967296, 2147483648]: its element count overflows"),
    "unknown ggml type": (lambda d: put(d, tensor_field_at(d, "b.weight", "type"), "<I", 99),
                          "tensor 'b.weight' has unknown ggml type 99"),
    "a removed ggml type": (lambda d: put(d, tensor_field_at(d, "b.weight", "type"), "<I", 4),
                            "tensor 'b.weight' has unknown ggml type 4"),
    "rows not whole blocks": (lambda d: put(d, tensor_field_at(d, "b.weight", "dims"), "<q", 48),
                              "tensor 'b.weight' has first dimension 48, not a multiple of the Q8_0 block size 32"),
    "misaligned offset": (lambda d: shift_offset(d, "b.weight", 1),
                          "tensor 'b.weight' has offset 513, not a multiple of the alignment 32"),
    "offset past the end": (lambda d: shift_offset(d, "c.weight", 1024),
                            "tensor 'c.weight' (64 bytes at offset 1632 of the data section starting at byte 448)"
                            " runs past the end of the file at byte 1120"),
    "overlapping tensors": (lambda d: put(d, tensor_field_at(d, "b.weight", "offset"), "<Q", 0),
                            "tensors 'a.weight' and 'b.weight' overlap: 'a.weight' spans data bytes [0, 512)"),
    "a gap between tensors": (lambda d: shift_offset(d, "c.weight", 32) + bytes(32),
                              "tensor 'c.weight' has offset 640 but llama.cpp expects 608"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_corrupt_file_is_refused_with_the_reason(good, tmp_path, case):
    edit, reason = REFUSALS[case]
    assert reason in refused(tmp_path, edit(good.read_bytes()))


@pytest.mark.parametrize("alignment, vtype, reason", [(48, "<I", "general.alignment 48 is not a power of two"),
                                                      (0, "<I", "general.alignment 0 is not a power of two"),
                                                      (8, "<i", "general.alignment has value type 5, not uint32")])
def test_a_bad_alignment_is_refused(tmp_path, alignment, vtype, reason):
    data = write_gguf(tmp_path / "aligned.gguf", alignment=64).read_bytes()
    at = kv_type_at(data, "general.alignment")
    if vtype == "<i":
        data = put(data, at, "<I", 5)  # int32: the same 4 bytes, a type ggml refuses here
    assert reason in refused(tmp_path, put(data, at + 4, vtype, alignment))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[bytes, Path]:
    folder = tmp_path_factory.mktemp("gguf_property")
    return write_gguf(folder / "good.gguf").read_bytes(), folder / "edited.gguf"


def validated_quickly(path: Path) -> bool:
    """validate_gguf's verdict; it must answer in a fraction of a second and raise nothing but GGUFError."""
    start = time.perf_counter()
    try:
        validate_gguf(path)
        ok = True
    except GGUFError:
        ok = False
    assert time.perf_counter() - start < 0.5
    return ok


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_truncation_is_refused_quickly(small, data):
    good, path = small
    cut = data.draw(st.integers(0, len(good) - 1))
    path.write_bytes(good[:cut])
    assert not validated_quickly(path)  # the small file has no trailing padding: every byte is needed


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_any_single_byte_corruption_is_refused_or_accepted_quickly(small, data):
    good, path = small
    at = data.draw(st.integers(0, len(good) - 1))
    value = data.draw(st.integers(0, 255).filter(lambda v: v != good[at]))
    path.write_bytes(good[:at] + bytes([value]) + good[at + 1:])
    validated_quickly(path)
