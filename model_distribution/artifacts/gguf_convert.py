"""GGUF -> a Hugging Face model directory, converted once and cached.

The edge ships GGUF files; the engine (and vLLM, and transformers) load plain HF directories.
``ensure_hf_dir`` dequantizes a GGUF into float32 safetensors under HF parameter names, with an
HF ``config.json`` rebuilt from the GGUF metadata (``gguf_hf_config``) and the tokenizer
transformers builds from it.

Cache layout, under ``cache_root`` (the engine passes ``$CASCADE_HOME/engine/models``)::

    gguf-sha256.json            {resolved path: {size, mtime_ns, sha256, architecture}}
    llama-<sha256[:16]>/        one directory per distinct GGUF content
        config.json             Llama/Qwen2Config, Gemma3TextConfig; float32, no quantization_config
        generation_config.json  bos/eos/pad; eos also lists the end-of-turn tokens llama.cpp stops on
        model.safetensors       float32, HF names; no lm_head when the embeddings are tied
        tokenizer.json, tokenizer_config.json, chat_template.jinja (when the GGUF has one)
        cascade_gguf.json       provenance (source, sha256, converter version); written last

Directories are named by content so that the same model under two paths converts once and an
edited file never reuses a stale conversion. Hashing 250 MB takes ~0.4 s, so the digest is kept
in ``gguf-sha256.json`` keyed by (path, size, mtime_ns): a cached call then reads no GGUF at all.
Each directory is built in a temporary sibling and renamed into place, so a reader never sees a
half-written one; two racing processes both convert and the first rename wins.

Conversion reads the GGUF once with ``gguf.GGUFReader`` (slow on big vocabularies: ~5 s for
SmolLM2, ~20 s for Gemma 3) and dequantizes with ``gguf.quants.dequantize``; transformers then
parses the file again for the tokenizer (~6 s, ~35 s). It undoes llama.cpp's two storage tricks:
Llama Q/K rows are permuted for its RoPE layout, and Gemma RMSNorm weights are stored as 1 + w.
Qwen2 (Llama with q/k/v biases) is stored unpermuted: llama.cpp's converter permutes Llama's
rows only, Qwen2 running its NEOX rotation, which is HF's rotate-half.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from cascade.errors import one_line
from model_distribution.artifacts.catalog import ModelNotFound
from model_distribution.artifacts.gguf_hf_config import HF_ARCHITECTURES, build_config, generation_config, write_config
from model_distribution.artifacts.gguf_meta import read_metadata

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the output changes, so old conversions are rebuilt
FINGERPRINTS = "gguf-sha256.json"
MARKER = "cascade_gguf.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", MARKER)

# GGUF tensor names (without ".weight") -> HF parameter names, checked against the parameter
# names of transformers' LlamaForCausalLM, Qwen2ForCausalLM and Gemma3ForCausalLM. Qwen2's q/k/v
# also carry a bias (blk.N.attn_q.bias -> ...q_proj.bias).
TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
}
BLOCK_NAMES = {
    "llama": {**_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
    "qwen2": {**_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        **_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_BIASED = {"qwen2": ("attn_q", "attn_k", "attn_v")}  # block tensors that also have a .bias


class UnsupportedArchitecture(ModelNotFound, NotImplementedError):
    """A GGUF of an architecture the converter, and so the engine, does not know: what the
    commands report as an unusable model (ModelNotFound), as the loader does an unknown HF one
    (NotImplementedError), in one line."""


class ConversionError(ModelNotFound):
    """A GGUF the converter cannot make into a model (values no model has, tensors missing or cut
    short, a tokenizer it cannot build) or cannot write (a read-only or full disk): one line that
    the commands print before exiting 2."""


def ensure_hf_dir(model_path: str | Path, cache_root: Path) -> Path:
    """An HF model directory holding the model at ``model_path``, converting a GGUF on first use.

    ``model_path`` is a .gguf file or an HF directory (one with config.json, returned as is).
    ConversionError (a ModelNotFound) for whatever a file's contents or the disk break: the file is
    outside data, and nothing it holds may end a command in a traceback.
    """
    try:
        return _ensure_hf_dir(Path(model_path), Path(cache_root))
    except (ModelNotFound, NotImplementedError):
        raise
    except OSError as e:
        raise ConversionError(f"{model_path}: cannot convert it into {cache_root}: "
                              f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from e
    except Exception as e:  # noqa: BLE001 (ValueError, KeyError, transformers' and numpy's own: one line)
        raise ConversionError(f"{model_path}: not a model the engine can run "
                              f"({type(e).__name__}: {one_line(e, 300)})") from e


def _ensure_hf_dir(model_path: Path, cache_root: Path) -> Path:
    if model_path.is_dir():
        if not (model_path / "config.json").is_file():
            raise ConversionError(f"{model_path} is a directory without config.json, not an HF model")
        return model_path
    cache_root.mkdir(parents=True, exist_ok=True)
    sha256, architecture = fingerprint(model_path, cache_root)
    _check_supported(model_path, architecture)
    out_dir = cache_root / f"{architecture}-{sha256[:16]}"
    if is_complete(out_dir):
        return out_dir
    start = time.monotonic()
    log.info("converting %s to an HF directory at %s (once)", model_path, out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=cache_root))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; other readers (vLLM in a container) need it
    try:
        convert(model_path, tmp_dir, sha256)
        _publish(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # gone already once published
    log.info("converted %s in %.1f s", model_path.name, time.monotonic() - start)
    return out_dir


def is_complete(out_dir: Path) -> bool:
    """Whether ``out_dir`` is a finished conversion by this converter version."""
    if not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads((out_dir / MARKER).read_text())["converter_version"] == CONVERTER_VERSION
    except (ValueError, KeyError):
        return False


def fingerprint(path: Path, cache_root: Path) -> tuple[str, str]:
    """(sha256, architecture) of the GGUF at ``path``, from the cache when size and mtime match."""
    st = path.stat()
    key = str(path.resolve())
    index_path = cache_root / FINGERPRINTS
    index = _read_json(index_path)
    entry = index.get(key)
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry["sha256"], entry["architecture"]
    with open(path, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    architecture = read_metadata(path).architecture
    index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256,
                  "architecture": architecture}
    _write_json_atomic(index_path, index)  # a racing writer may drop our entry: it is recomputed
    return sha256, architecture


def convert(gguf_path: Path, out_dir: Path, sha256: str) -> None:
    """Write the HF files for the GGUF at ``gguf_path`` into the existing, empty ``out_dir``."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    meta = read_metadata(gguf_path)
    _check_supported(gguf_path, meta.architecture)
    reader = gguf.GGUFReader(gguf_path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = build_config(meta, shapes)
    save_file(convert_tensors(reader, config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # save_file makes it private; the folder is 0755 for other readers
    del reader
    write_config(config, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    generation_config(config, tokenizer).save_pretrained(str(out_dir))
    marker = {"source": gguf_path.name, "sha256": sha256, "converter_version": CONVERTER_VERSION}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _check_supported(gguf_path: Path, architecture: str) -> None:
    if architecture not in HF_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{gguf_path.name}: the engine does not support architecture "
                                      f"{architecture!r} (supported: {', '.join(HF_ARCHITECTURES)})")


# --- tensors --------------------------------------------------------------------------------


def convert_tensors(reader, config) -> dict[str, torch.Tensor]:
    """Every tensor of ``reader``, dequantized to float32, under its HF name."""
    arch = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}[config.model_type]
    tensors = {}
    for t in reader.tensors:
        name = hf_name(arch, t.name)
        tensors[name] = _undo_llamacpp_layout(arch, t.name, _dequantize(t), config)
    return tensors


def hf_name(arch: str, gguf_name: str) -> str:
    """The HF parameter name of the GGUF tensor ``gguf_name`` (e.g. blk.3.attn_q.weight)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix == "weight" and stem in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[stem]}.weight"
    prefix, layer, part = (stem.split(".", 2) + ["", ""])[:3]
    known = suffix == "weight" or (suffix == "bias" and part in _BIASED.get(arch, ()))
    if known and prefix == "blk" and layer.isdigit() and part in BLOCK_NAMES[arch]:
        return f"model.layers.{layer}.{BLOCK_NAMES[arch][part]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF counterpart for {arch}")


def _dequantize(t) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: never the mmap


def _undo_llamacpp_layout(arch: str, gguf_name: str, w: torch.Tensor, config) -> torch.Tensor:
    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if arch == "llama" and part == "attn_q":
        return unpermute_rope_rows(w, config.num_attention_heads)
    if arch == "llama" and part == "attn_k":
        return unpermute_rope_rows(w, config.num_key_value_heads)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return w - 1.0  # llama.cpp stores 1 + w; HF's Gemma3RMSNorm computes x * (1 + w)
    return w


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``).

    Per head, llama.cpp interleaves the two rotary halves (rows 0, d/2, 1, d/2+1, ...) for its
    GPT-J-style RoPE; HF rotates the first half against the second.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --- files ----------------------------------------------------------------------------------


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp_dir`` to ``out_dir``. A complete ``out_dir`` (a racer's) wins;
    an incomplete or outdated one is replaced."""
    for attempt in range(2):
        try:
            tmp_dir.rename(out_dir)
            return
        except OSError:
            if is_complete(out_dir):
                return
            if attempt:
                raise
        stale = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex}.stale")
        with contextlib.suppress(FileNotFoundError):  # a racer may have moved it already
            out_dir.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
