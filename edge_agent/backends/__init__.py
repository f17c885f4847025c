"""Edge model backends behind one contract (base.py): llama.cpp for GGUF files, ONNX Runtime
GenAI for ONNX export directories."""

from __future__ import annotations

import functools
from pathlib import Path

from edge_agent.backends.base import Backend
from edge_agent.config import ModelConfig


def load_slots(fmt: str, path: Path | str, name: str, quantization: str, m: ModelConfig) -> list[Backend]:
    """``m.parallel`` loaded backends for a model of format ``fmt`` (gguf: llama.cpp, onnx: ONNX
    Runtime GenAI), all or none. The agent's start and the fleet's switch both load this way, so
    a fleet version runs on the backend its manifest's format names."""
    if fmt == "onnx":
        from edge_agent.backends.onnx import OnnxBackend, OnnxConfig

        cfg = OnnxConfig(path=str(path), name=name, n_ctx=m.n_ctx, providers=tuple(m.providers), threads=m.threads)
        make = functools.partial(OnnxBackend, cfg, quantization=quantization)
    elif fmt == "gguf":
        from edge_agent.backends.llamacpp import LlamaCppBackend, LlamaCppConfig

        cfg = LlamaCppConfig(path=str(path), name=name, n_ctx=m.n_ctx, n_batch=m.n_batch,
                             n_threads=m.threads, n_threads_batch=m.threads_batch, flash_attn=m.flash_attn)
        make = functools.partial(LlamaCppBackend, cfg, quantization=quantization)
    else:
        raise ValueError(f"no backend serves models of format {fmt!r} (gguf, onnx)")
    backends: list[Backend] = []
    try:
        for _ in range(m.parallel):
            b = make()
            b.load()
            backends.append(b)
    except BaseException:
        for b in backends:
            b.unload()
        raise
    return backends
