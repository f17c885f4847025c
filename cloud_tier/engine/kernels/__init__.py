"""Native kernels, compiled on first use with the machine's compiler (torch's cpp_extension), with a
pure-torch fallback when that is not possible.

One extension holds them all: the CPU decode paged attention (paged_attention_cpu.cpp) and the
layers' element-wise ops (layers_cpu.cpp: RMSNorm, residual add + RMSNorm, activation times up,
RoPE; int8_linear_cpu.cpp: weight-only INT8 products of decode batches). It is compiled once per
machine (``-O3 -march=native``, about a minute) into ``~/.cache/cascade/kernels/<cpu>`` (or
$CASCADE_KERNEL_CACHE), a build cache like the llama.cpp wheel's, keyed by the CPU's flags so a
native build never runs on another ISA, and by the sources' hash so two checkouts of different
versions (a worktree beside the main one, an upgrade) never build into one directory and load each
other's module. If there is no compiler, or CASCADE_ENGINE_NATIVE_KERNELS=0, ``load()`` returns
None and the engine uses its torch paths."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {}
# the decode attention, the layers' element-wise ops and the weight-only int8 product, one extension
SOURCES = ("paged_attention_cpu.cpp", "layers_cpu.cpp", "int8_linear_cpu.cpp")


def load():
    """The compiled extension, or None."""
    with _lock:
        if "ext" not in _state:
            _state["ext"] = _build()
        return _state["ext"]


def _build():
    if os.environ.get("CASCADE_ENGINE_NATIVE_KERNELS", "1") in ("0", "false", "no"):
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        here = Path(__file__).parent
        sources = [here / name for name in SOURCES]
        build_dir = _build_dir(b"".join(p.read_bytes() for p in [*sources, here / "cpu_common.h"]))
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(name="cascade_cpu_kernels", sources=[str(p) for p in sources],
                              build_directory=str(build_dir),
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back, say why once
        log.warning("native CPU kernels unavailable (%s); using the torch path", e)
        return None


def _build_dir(source: bytes) -> Path:
    key = hashlib.sha256(machine_key().encode() + source).hexdigest()[:12]
    return cache_root() / f"{platform.machine()}-{key}"


def cache_root() -> Path:
    """Where this machine's builds (and measured choices) are kept."""
    return Path(os.environ.get("CASCADE_KERNEL_CACHE") or Path.home() / ".cache" / "cascade" / "kernels")


def machine_key() -> str:
    """The architecture and CPU flags: what a native build, or a timing, holds for."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"
