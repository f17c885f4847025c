"""A model of an architecture the engine does not know is refused in one line that names it and
the supported ones, before anything is written: a GGUF by the converter, an HF directory by the
loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from cloud_tier.engine.models.loader import model_class
from model_distribution.artifacts.catalog import ModelNotFound
from model_distribution.artifacts.gguf_convert import FINGERPRINTS, UnsupportedArchitecture, ensure_hf_dir


def test_a_gguf_of_an_unknown_architecture_is_refused_naming_it_and_writes_no_model(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(256)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedArchitecture) as caught:
        ensure_hf_dir(path, cache)
    message = str(caught.value)
    assert "\n" not in message and "'phi3'" in message
    assert "supported: llama, qwen2, gemma3" in message
    # the commands report it as they report a model they cannot use
    assert isinstance(caught.value, ModelNotFound) and isinstance(caught.value, NotImplementedError)
    assert [p.name for p in cache.iterdir()] == [FINGERPRINTS]


def test_an_hf_directory_of_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(NotImplementedError) as caught:
        model_class({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})
    assert "Phi3ForCausalLM" in str(caught.value) and "Qwen2ForCausalLM" in str(caught.value)
    assert model_class({"architectures": ["Qwen2ForCausalLM"]}).__name__ == "Qwen2ForCausalLM"
    assert model_class({"model_type": "qwen2"}).__name__ == "Qwen2ForCausalLM"
