"""GGUF -> HF directory conversion, checked against transformers' own GGUF loader and llama.cpp.

Each model is converted once per session (SmolLM2 ~16 s, Gemma 3 ~60 s) and read once by the
reference loader (~30 s, ~45 s; tests/integration/gguf_reference.py, shared with the engine parity
tests); every test below shares both.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from model_distribution.artifacts import gguf_convert
from model_distribution.artifacts.catalog import Catalog, ModelNotFound
from model_distribution.artifacts.gguf_convert import (
    FINGERPRINTS,
    MARKER,
    REQUIRED_FILES,
    ensure_hf_dir,
    hf_name,
    is_complete,
)
from model_distribution.artifacts.gguf_meta import read_metadata
from tests.integration.gguf_reference import Reference, gguf_reference

PROMPT = "The capital of France is Paris. The capital of Germany is"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CHAT_TEXTS = (
    "<|im_start|>user\nHi there, 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there, 2+2?<end_of_turn>\n<start_of_turn>model\n",
    " Ünïcödé 日本語 🤖\ttabs  and\n\nnewlines, code: def f(x):\n    return x**2 ",
)
# The published HF configs of SmolLM2-135M-Instruct, gemma-3-270m and Qwen2.5-Coder-0.5B-Instruct;
# Gemma's sliding pattern, local RoPE base and query scalar are not in the GGUF, so they come from
# llama.cpp's defaults. Qwen's GGUF carries output.weight beside token_embd.weight: untied, as the
# file has it (the published config ties them), as transformers' GGUF loader does.
EXPECTED_CONFIG = {
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
    "gemma3-270m": {
        "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "sliding_window": 512, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
    "qwen2.5-coder-0.5b": {
        "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 4864, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643,
    },
}
# eos, then end-of-turn tokens (<|im_end|> is Qwen's eos, <|endoftext|> its other end of turn)
EXPECTED_STOP_IDS = {"smollm2-135m": [2, 0], "gemma3-270m": [1, 106], "qwen2.5-coder-0.5b": [151645, 151643]}


@dataclass(frozen=True)
class Converted:
    name: str
    gguf: Path
    cache_root: Path
    hf_dir: Path
    convert_s: float


@pytest.fixture(scope="module", params=["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow),
                                        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)])
def converted(request, engine_home) -> Converted:
    # the session's engine home: the engine tests then reuse this conversion instead of redoing it
    catalog = Catalog(engine_home)
    try:
        info = catalog.get(request.param)
    except ModelNotFound as e:
        pytest.skip(f"{request.param} is not in this machine's catalogue ({e})")
    gguf_path = catalog.ensure_ready(info)
    cache_root = engine_home / "engine" / "models"
    start = time.monotonic()
    hf_dir = ensure_hf_dir(gguf_path, cache_root)
    return Converted(request.param, gguf_path, cache_root, hf_dir, time.monotonic() - start)


@pytest.fixture(scope="module")
def reference(converted) -> Reference:
    """The model as transformers' GGUF loader builds it (shared with the engine parity tests)."""
    return gguf_reference(converted.gguf, converted.hf_dir)


def test_every_tensor_equals_the_transformers_gguf_loader(converted, reference):
    from safetensors.torch import load_file

    ours = load_file(converted.hf_dir / "model.safetensors")
    expected = reference.model.state_dict()
    tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
    assert set(ours) == set(expected) - tied
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        if not torch.equal(tensor, expected[name]):
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def test_tensor_names_invert_the_gguf_name_map(converted):
    import gguf
    from safetensors import safe_open

    config = json.loads((converted.hf_dir / "config.json").read_text())
    arch = read_metadata(converted.gguf).architecture
    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    with safe_open(converted.hf_dir / "model.safetensors", "pt") as f:
        for key in f.keys():
            stem, _, suffix = key.rpartition(".")  # weight, or a Qwen2 q/k/v bias
            assert hf_name(arch, f"{name_map.get_name(stem)}.{suffix}") == key


def test_config_is_rebuilt_from_gguf_metadata(converted, reference):
    from transformers import AutoConfig

    data = json.loads((converted.hf_dir / "config.json").read_text())
    assert "quantization_config" not in data
    assert data["torch_dtype"] == data["dtype"] == "float32"
    arch = read_metadata(converted.gguf).architecture
    assert data["architectures"] == [gguf_convert.HF_ARCHITECTURES[arch]]
    config = AutoConfig.from_pretrained(converted.hf_dir)
    for key, value in EXPECTED_CONFIG[converted.name].items():
        ours = getattr(config, key)
        if key == "head_dim" and not hasattr(reference.config, key):  # Qwen2's: hidden / heads
            assert ours == reference.config.hidden_size // reference.config.num_attention_heads
            continue
        from_transformers = getattr(reference.config, key)
        assert ours == value, key
        if key == "rms_norm_eps":  # GGUF holds float32: 1e-06 reads back as 9.99999997e-07
            ours, from_transformers = np.float32(ours), np.float32(from_transformers)
        assert ours == from_transformers, key
    generation = json.loads((converted.hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EXPECTED_STOP_IDS[converted.name]


def test_transformers_loads_the_directory_with_the_reference_logits(converted, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(converted.hf_dir, output_loading_info=True)
    assert model.dtype == torch.float32
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = AutoTokenizer.from_pretrained(converted.hf_dir)(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours, expected = model.eval()(ids).logits, reference.model(ids).logits
    assert torch.isfinite(expected).all()
    assert (ours - expected).abs().max().item() <= 1e-4


def test_tokenizer_matches_llama_cpp_on_chat_formatted_text(converted):
    import llama_cpp
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted.hf_dir)
    vocab = llama_cpp.Llama(str(converted.gguf), vocab_only=True, verbose=False)
    template = read_metadata(converted.gguf).chat_template
    assert tokenizer.chat_template == template
    texts = list(CHAT_TEXTS)
    if template:
        texts.append(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    for text in texts:
        assert tokenizer(text)["input_ids"] == vocab.tokenize(text.encode(), add_bos=True, special=True), text
    stop_ids = json.loads((converted.hf_dir / "generation_config.json").read_text())["eos_token_id"]
    llama_vocab = llama_cpp.llama_model_get_vocab(vocab.model)
    assert all(llama_cpp.llama_vocab_is_eog(llama_vocab, i) for i in stop_ids)


def test_second_call_returns_the_directory_without_reading_the_gguf(converted, monkeypatch):
    import gguf

    def parse(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_convert, "read_metadata", parse)
    monkeypatch.setattr(gguf, "GGUFReader", parse)
    start = time.monotonic()
    assert ensure_hf_dir(converted.gguf, converted.cache_root) == converted.hf_dir
    assert time.monotonic() - start < 1.0
    assert ensure_hf_dir(converted.hf_dir, converted.cache_root) == converted.hf_dir  # already HF
    # no temporary directories (the shared cache may hold the other model's finished conversion)
    leftovers = {p.name for p in converted.cache_root.iterdir()
                 if p.name != FINGERPRINTS and not (p / "cascade_gguf.json").is_file()}
    assert not leftovers


def test_a_lost_fingerprint_index_rehashes_and_reuses_the_directory(converted, monkeypatch):
    import gguf

    def parse(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(gguf, "GGUFReader", parse)
    (converted.cache_root / FINGERPRINTS).unlink()
    assert ensure_hf_dir(converted.gguf, converted.cache_root) == converted.hf_dir
    assert (converted.cache_root / FINGERPRINTS).is_file()


def _finished_dir(path: Path, tag: str) -> Path:
    path.mkdir()
    for name in REQUIRED_FILES:
        (path / name).write_text("{}")
    (path / MARKER).write_text(json.dumps({"converter_version": gguf_convert.CONVERTER_VERSION}))
    (path / "tag").write_text(tag)
    return path


def test_publish_keeps_a_racers_complete_directory_and_replaces_a_broken_one(tmp_path):
    out = tmp_path / "llama-0123456789abcdef"
    gguf_convert._publish(_finished_dir(tmp_path / "first", "first"), out)
    gguf_convert._publish(_finished_dir(tmp_path / "second", "second"), out)  # lost the race
    assert (out / "tag").read_text() == "first"
    (out / "model.safetensors").unlink()  # a directory someone damaged
    assert not is_complete(out)
    gguf_convert._publish(_finished_dir(tmp_path / "third", "third"), out)
    assert is_complete(out) and (out / "tag").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "second"])
