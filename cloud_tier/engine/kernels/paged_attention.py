"""The CPU decode paged-attention kernel: compiled once per machine (``-O3 -march=native``, about a
minute) into ``~/.cache/cascade/kernels/<cpu>`` (or $CASCADE_KERNEL_CACHE), a build cache like the
llama.cpp wheel's, keyed by the CPU's flags so a native build never runs on another ISA, and by
the source's hash so two checkouts of different versions (a worktree beside the main one, an
upgrade) never build into one directory and load each other's module. If there is no compiler,
or CASCADE_ENGINE_NATIVE_KERNELS=0, ``load()`` returns None and attention uses the pure-torch path."""

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

        src = Path(__file__).with_name("paged_attention_cpu.cpp")
        build_dir = _build_dir(src.read_bytes())
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(name="cascade_paged_attention_cpu", sources=[str(src)], build_directory=str(build_dir),
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back, say why once
        log.warning("native paged-attention kernel unavailable (%s); using the torch path", e)
        return None


def _build_dir(source: bytes) -> Path:
    root = Path(os.environ.get("CASCADE_KERNEL_CACHE") or Path.home() / ".cache" / "cascade" / "kernels")
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    key = hashlib.sha256(f"{platform.machine()}|{flags}".encode() + source).hexdigest()[:12]
    return root / f"{platform.machine()}-{key}"
