"""Derive a harsher-quantized edge variant of a GGUF with llama.cpp's own quantizer (the way a
fleet ships a smaller model to its devices than the one the cloud serves)."""

from __future__ import annotations

import os
from pathlib import Path

TYPES = ("q2_k", "q3_k_s", "q3_k_m", "q4_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k", "q8_0")


class QuantizeError(RuntimeError):
    """llama.cpp refused or failed to quantize."""


def quantize(src: Path, dst: Path, qtype: str = "q2_k", threads: int = 0) -> Path:
    """Requantize ``src`` into ``dst`` (written to a temporary file, then renamed). Tensors whose
    row length does not fit the type's super-block fall back to a type that does (llama.cpp)."""
    import llama_cpp

    if qtype not in TYPES:
        raise QuantizeError(f"type must be one of {', '.join(TYPES)}, got {qtype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params.allow_requantize = True
    params.nthread = threads or os.cpu_count() or 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise QuantizeError(f"llama.cpp could not quantize {src} to {qtype} (status {rc})")
    os.replace(tmp, dst)
    return dst
