"""A GGUF whose header no model has (a hostile or broken file) is refused by the converter in one
line, as a ConversionError (a ModelNotFound: the commands print it and exit 2), before anything is
written: before, each ended `cascade cloud worker|serve --model FILE` in a traceback, or was
converted and served garbage (a rope base of 0 or NaN, a NaN epsilon)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from model_distribution.artifacts.catalog import ModelNotFound
from model_distribution.artifacts.gguf_convert import FINGERPRINTS, ConversionError, ensure_hf_dir

GOOD = {"block_count": 2, "head_count": 4, "head_count_kv": 2, "rope.freq_base": 1e6,
        "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 256}


def qwen2_gguf(path, tensors=True, **meta):
    values = {**GOOD, **meta}
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_uint32("qwen2.block_count", values["block_count"])
    w.add_uint32("qwen2.context_length", values["context_length"])
    w.add_uint32("qwen2.embedding_length", 8)
    w.add_uint32("qwen2.feed_forward_length", 16)
    w.add_uint32("qwen2.attention.head_count", values["head_count"])
    w.add_uint32("qwen2.attention.head_count_kv", values["head_count_kv"])
    w.add_float32("qwen2.rope.freq_base", values["rope.freq_base"])
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", values["attention.layer_norm_rms_epsilon"])
    if tensors:
        w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("meta, says", [
    ({"head_count": 0}, "num_attention_heads = 0"),
    ({"head_count": 3, "head_count_kv": 2}, "do not share"),
    ({"rope.freq_base": float("nan")}, "rope.freq_base"),
    ({"rope.freq_base": 0.0}, "rope.freq_base"),
    ({"rope.freq_base": -1e4}, "rope.freq_base"),
    ({"attention.layer_norm_rms_epsilon": float("nan")}, "epsilon"),
    ({"block_count": 1_000_000}, "num_hidden_layers"),
    ({"block_count": 5}, "block_count is 5"),
    ({"context_length": 0}, "max_position_embeddings = 0"),
    ({"tensors": False}, "token_embd"),
])
def test_a_header_no_model_has_is_one_line_and_writes_nothing(tmp_path, meta, says):
    tensors = meta.pop("tensors", True)
    path = qwen2_gguf(tmp_path / "hostile.gguf", tensors=tensors, **meta)
    cache = tmp_path / "cache"
    with pytest.raises(ConversionError) as caught:
        ensure_hf_dir(path, cache)
    message = str(caught.value)
    assert isinstance(caught.value, ModelNotFound) and "\n" not in message and says in message, message
    assert [p.name for p in cache.iterdir()] == [FINGERPRINTS]


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path):
    path = qwen2_gguf(tmp_path / "fine.gguf")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConversionError, match="cannot convert it into"):
        ensure_hf_dir(path, blocker / "cache")
