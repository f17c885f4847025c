"""What this device has (CPU features, memory, GPUs, NPUs, the ONNX Runtime builds and the
execution providers that load here), and which provider the ONNX backend runs on.

Everything is optional: a device without onnxruntime (llama.cpp only) still gets its CPU and GPU
facts, so onnxruntime is imported lazily, inside the functions that need it.

"Loadable" is stronger than ``onnxruntime.get_available_providers()``: that lists the providers
compiled into the installed build (onnxruntime-gpu lists CUDA on a machine without CUDA), and an
InferenceSession asked for a provider whose libraries are missing silently runs on CPU. So a
provider loads here only if a tiny session created with it still names it in get_providers().
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import glob
import importlib.metadata
import importlib.util
import io
import os
import platform
import re
import shutil
import subprocess
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# onnxruntime-genai's provider names (what [model] providers and --providers take) -> ORT's.
# onnxruntime-genai 0.18 has no ROCm provider: og.Config.append_provider("rocm") then og.Model
# fails with "Unknown provider name 'rocm'" (measured), so rocm is refused like any unknown name.
ORT_PROVIDER = {
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
AUTO_ORDER = ("cuda", "dml", "qnn", "openvino", "cpu")  # best first; webgpu only when asked for
# The onnxruntime distribution that brings each provider (what to install when it is missing).
PROVIDER_DIST = {"cuda": "onnxruntime-gpu", "dml": "onnxruntime-directml", "qnn": "onnxruntime-qnn",
                 "openvino": "onnxruntime-openvino", "webgpu": "an onnxruntime build with WebGPU"}
# onnxruntime-genai runs CUDA only through its CUDA build's library, DirectML only in its DirectML build.
GENAI_DIST = {"cuda": "onnxruntime-genai-cuda", "dml": "onnxruntime-genai-directml"}

# A one-node ONNX model (Identity on a float[1]; opset 13, IR 8), made once with the onnx package,
# which a device does not have.
_PROBE_MODEL = base64.b64decode(
    "CAgSB2Nhc2NhZGU6OwoQCgF4EgF5IghJZGVudGl0eRIFcHJvYmVaDwoBeBIKCggIARIECgIIAWIPCgF5EgoKCAgBEgQKAggBQgQKABAN")

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "asimddp", "i8mm", "bf16", "sve", "sve2")  # the last six: ARM's Features line
_PCI_VENDOR = {"0x10de": "nvidia", "0x1002": "amd", "0x8086": "intel"}


class MixedOnnxRuntime(RuntimeError):
    """More than one onnxruntime (or onnxruntime-genai) distribution is installed: they write the
    same package folder, so which one's files are there depends on install order."""


@dataclass
class ProviderChoice:
    providers: list[str]  # onnxruntime-genai names, best first, always ending with "cpu"
    reason: str  # why providers[0] runs
    warnings: list[str] = field(default_factory=list)  # one per provider asked for and dropped


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> tuple[list[dict], list[dict]]:
    """(onnxruntime builds, onnxruntime-genai builds) installed on sys.path, as {name, version}."""
    ort, genai, seen = [], [], set()
    for dist in importlib.metadata.distributions():
        name = _norm(dist.metadata["Name"] or "")
        if name in seen:
            continue
        seen.add(name)
        row = {"name": name, "version": dist.version}
        if name == "onnxruntime-genai" or name.startswith("onnxruntime-genai-"):
            genai.append(row)
        elif name == "onnxruntime" or (name.startswith("onnxruntime-")
                                       and name not in ("onnxruntime-extensions", "onnxruntime-tools")):
            ort.append(row)
    return sorted(ort, key=lambda r: r["name"]), sorted(genai, key=lambda r: r["name"])


def check_onnxruntime_install() -> None:
    """Raise MixedOnnxRuntime (one line: both names and the fix) when more than one onnxruntime
    build, or more than one onnxruntime-genai build, is installed."""
    for dists, folder in zip(installed_distributions(), ("onnxruntime", "onnxruntime_genai"), strict=True):
        if len(dists) > 1:
            names = [d["name"] for d in dists]
            listed = " and ".join(f"{d['name']} {d['version']}" for d in dists)
            owner = _folder_owner() if folder == "onnxruntime" else None
            now = f" (its files now are {owner}'s)" if owner else ""
            raise MixedOnnxRuntime(
                f"{listed} are installed together: they install into the same {folder}/ folder and the last "
                f"one installed wins{now}. Keep one: pip uninstall -y {' '.join(names)}, then pip install "
                f"--force-reinstall the one this device needs ({' or '.join(names)}).")


def _folder_owner() -> str | None:
    """The distribution whose build sits in onnxruntime/ now, read from its build info without
    importing it (a mixed folder may not import)."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    info = _read(os.path.join(list(spec.submodule_search_locations)[0], "capi", "build_and_package_info.py"))
    m = re.search(r"package_name\s*=\s*['\"]([^'\"]+)", info or "")
    return m.group(1) if m else None


def cpu_facts(cpuinfo: str) -> dict:
    """Model name and the flags that matter for inference, from /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    model = fields.get("model name") or fields.get("Model") or fields.get("Hardware") or fields.get("cpu model")
    if model is None and "CPU part" in fields:
        model = f"ARM implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    return {"model": model or platform.processor() or None, "flags": [f for f in CPU_FLAGS if f in flags]}


def _cpu() -> dict:
    try:
        facts = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        facts = {"model": platform.processor() or None, "flags": []}
        if platform.system() == "Darwin":
            facts["model"] = _command(["sysctl", "-n", "machdep.cpu.brand_string"]) or facts["model"]
            if platform.machine() == "arm64":
                facts["flags"] = ["asimd"]  # every Apple silicon core has NEON
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {**facts, "arch": platform.machine(), "cores": os.cpu_count(),
            "usable_cores": len(affinity) if affinity else os.cpu_count()}


def _memory() -> dict:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return {"total_bytes": int(info["MemTotal"].split()[0]) * 1024,
                "available_bytes": int(info["MemAvailable"].split()[0]) * 1024}
    except (OSError, KeyError, ValueError):
        total = _command(["sysctl", "-n", "hw.memsize"]) if platform.system() == "Darwin" else None
        return {"total_bytes": int(total) if total and total.isdigit() else None, "available_bytes": None}


def _command(argv: list[str]) -> str | None:
    """A tool's standard output, or None when it is missing, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _nvidia_gpus() -> list[dict]:
    out = _command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"])
    if out:
        gpus = []
        for line in out.splitlines():
            name, driver, mib = (part.strip() for part in (line.split(",") + ["", ""])[:3])
            gpus.append({"vendor": "nvidia", "name": name, "driver": driver or None,
                         "memory_bytes": int(mib) * 2**20 if mib.isdigit() else None, "source": "nvidia-smi"})
        return gpus
    # the driver is loaded but nvidia-smi is not installed (a slim container)
    version = _read("/proc/driver/nvidia/version") or ""
    driver = m.group(1) if (m := re.search(r"Kernel Module\s+(\S+)", version)) else None
    gpus = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        model = re.search(r"Model:\s*(.+)", _read(info) or "")
        gpus.append({"vendor": "nvidia", "name": model.group(1).strip() if model else None, "driver": driver,
                     "memory_bytes": None, "source": "/proc/driver/nvidia"})
    return gpus


def _render_nodes() -> list[dict]:
    """/dev/dri render nodes with their PCI vendor: Intel and AMD GPUs (and NVIDIA's, counted above)."""
    nodes = []
    for dev in sorted(glob.glob("/dev/dri/renderD*")):
        sysfs = f"/sys/class/drm/{os.path.basename(dev)}/device"
        vendor_id = _read(f"{sysfs}/vendor")
        nodes.append({"device": dev, "vendor": _PCI_VENDOR.get(vendor_id or "", vendor_id or "unknown"),
                      "pci_device": _read(f"{sysfs}/device")})
    return nodes


def _gpus() -> list[dict]:
    gpus = _nvidia_gpus()
    rocm = os.path.exists("/dev/kfd")
    amd_names = []
    if rocm and (out := _command(["rocm-smi", "--showproductname", "--csv"])):
        amd_names = [line.split(",")[1] for line in out.splitlines()[1:] if line.count(",") >= 1]
    for node in _render_nodes():
        if node["vendor"] == "amd":
            name = amd_names.pop(0) if amd_names else None
            gpus.append({"vendor": "amd", "name": name, "device": node["device"], "rocm": rocm,
                         "source": "rocm-smi" if name else "/dev/dri"})
        elif node["vendor"] == "intel":
            gpus.append({"vendor": "intel", "name": f"Intel GPU {node['pci_device'] or ''}".strip(),
                         "device": node["device"], "source": "/dev/dri"})
    if rocm and not any(g["vendor"] == "amd" for g in gpus):
        gpus.append({"vendor": "amd", "name": None, "device": "/dev/kfd", "rocm": True, "source": "/dev/kfd"})
    return gpus


def _npus() -> list[dict]:
    npus = []
    for dev in sorted(glob.glob("/dev/accel/accel*")):
        driver = os.path.realpath(f"/sys/class/accel/{os.path.basename(dev)}/device/driver")
        npus.append({"kind": "intel-npu" if driver.endswith("intel_vpu") else "accel", "device": dev,
                     "driver": os.path.basename(driver) if os.path.exists(driver) else None})
    npus += [{"kind": "ascend", "device": dev} for dev in sorted(glob.glob("/dev/davinci[0-9]*"))]
    npus += [{"kind": "qualcomm-hexagon", "device": dev} for dev in sorted(glob.glob("/dev/fastrpc*"))]
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        npus.append({"kind": "apple-neural-engine", "device": None})
    return npus


def _why_provider_fails(ort, provider: str) -> str | None:
    """The missing library behind a provider that does not load: ORT only logs it, so load the
    provider's shared library ourselves and keep the loader's message."""
    short = provider.removesuffix("ExecutionProvider").lower()
    lib = Path(ort.__file__).parent / "capi" / f"libonnxruntime_providers_{short}.so"
    if not lib.exists():
        return None
    try:
        ctypes.CDLL(str(lib))
    except OSError as e:
        return str(e).removeprefix(f"{lib}: ")
    return None


def _probe(ort, provider: str) -> str | None:
    """None when `provider` loads here, else why not."""
    options = ort.SessionOptions()
    options.log_severity_level = 4  # the failure is ours to report, once
    ort.set_default_logger_severity(4)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # "not in available provider names"
            session = ort.InferenceSession(_PROBE_MODEL, options, providers=[provider, "CPUExecutionProvider"])
    except Exception as e:  # a provider that throws at session creation does not load either
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    finally:
        ort.set_default_logger_severity(2)  # ORT's default: warnings
    if provider in session.get_providers():
        return None
    return _why_provider_fails(ort, provider) or "its session fell back to CPU"


def onnxruntime_facts() -> dict:
    """The installed onnxruntime and onnxruntime-genai builds and which providers load here."""
    ort_dists, genai_dists = installed_distributions()
    facts = {"distributions": ort_dists, "genai_distributions": genai_dists, "mixed": None, "version": None,
             "package": None, "cuda_version": None, "available": [], "loadable": [], "not_loading": {},
             "genai_version": None, "genai_cuda": False, "error": None}
    try:
        check_onnxruntime_install()
    except MixedOnnxRuntime as e:
        facts["mixed"] = str(e)
    try:
        import onnxruntime as ort
        from onnxruntime.capi import build_and_package_info as build
    except ImportError as e:
        facts["error"] = f"onnxruntime is not importable: {e}"
        return facts
    facts.update(version=ort.__version__, package=getattr(build, "package_name", None),
                 cuda_version=getattr(build, "cuda_version", None) or None,
                 available=list(ort.get_available_providers()))
    for provider in facts["available"]:
        why = None if provider == "CPUExecutionProvider" else _probe(ort, provider)
        if why is None:
            facts["loadable"].append(provider)
        else:
            facts["not_loading"][provider] = why
    try:
        import onnxruntime_genai as og
    except ImportError:
        return facts
    facts["genai_version"] = og.__version__
    facts["genai_cuda"] = (Path(og.__file__).parent / "libonnxruntime-genai-cuda.so").exists() or \
        (Path(og.__file__).parent / "onnxruntime-genai-cuda.dll").exists()
    return facts


def detect() -> dict:
    """Everything above, as `cascade edge hardware --json` prints it."""
    return {"platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                         "python": platform.python_version()},
            "cpu": _cpu(), "memory": _memory(), "gpus": _gpus(), "npus": _npus(), "render_nodes": _render_nodes(),
            "onnxruntime": onnxruntime_facts(), "llama_cpp": llama_cpp_facts()}


def llama_cpp_facts() -> dict | None:
    """The llama.cpp build's version and features (its system info line), if llama-cpp-python is here."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info()
    return {"version": llama_cpp.__version__, "system_info": info.decode() if isinstance(info, bytes) else str(info)}


def _unavailable(name: str, facts: dict) -> str | None:
    """Why provider `name` cannot run here, or None when it can."""
    if name == "cpu":
        return None
    if facts["error"]:
        return f"{name} requested but {facts['error']}"
    installed = ", ".join(f"{d['name']} {d['version']}" for d in facts["distributions"]) or "none"
    ep = ORT_PROVIDER[name]
    if ep not in facts["available"]:
        return f"{name} requested but {PROVIDER_DIST[name]} is not installed (onnxruntime here: {installed})"
    if ep not in facts["loadable"]:
        hint = f"; {facts['package']} {facts['version']} needs CUDA {facts['cuda_version']} and cuDNN 9" \
            if name == "cuda" and facts["cuda_version"] else ""
        return f"{name} requested but {ep} does not load here ({facts['not_loading'].get(ep)}{hint})"
    genai = ", ".join(f"{d['name']} {d['version']}" for d in facts["genai_distributions"]) or "none"
    if name == "cuda" and not facts["genai_cuda"]:
        return f"cuda requested but onnxruntime-genai-cuda is not installed (onnxruntime-genai here: {genai})"
    if name == "dml" and not any(d["name"] == GENAI_DIST["dml"] for d in facts["genai_distributions"]):
        return f"dml requested but onnxruntime-genai-directml is not installed (onnxruntime-genai here: {genai})"
    return None


def choose_providers(requested: Sequence[str], facts: dict | None = None) -> ProviderChoice:
    """The providers to run on, best first and ending with "cpu". `requested` holds
    onnxruntime-genai names (config or --providers); empty means auto: the best one that loads.
    An unknown name is a configuration error (ValueError); a known one that cannot run here is
    dropped with a warning. `facts` is onnxruntime_facts() (measured now when not given)."""
    names = list(dict.fromkeys(n.strip().lower() for n in requested if n.strip()))
    ignored = names[names.index("cpu") + 1:] if "cpu" in names else []  # cpu always loads: never tried
    names = names[:len(names) - len(ignored)]
    for name in names:
        if name not in ORT_PROVIDER:
            extra = " (onnxruntime-genai has no ROCm provider)" if name == "rocm" else ""
            raise ValueError(f"unknown ONNX Runtime provider {name!r}{extra}: use {', '.join(ORT_PROVIDER)}")
    facts = onnxruntime_facts() if facts is None else facts
    if not names:
        return _auto(facts)
    chosen, dropped = [], []
    for name in names:
        why = _unavailable(name, facts)
        (dropped.append(why) if why else chosen.append(name))
    chosen = [n for n in chosen if n != "cpu"] + ["cpu"]
    first_asked = names[0]
    if chosen[0] == first_asked:
        reason = f"{first_asked} requested and loadable" if first_asked != "cpu" else "cpu requested"
    else:
        reason = f"{dropped[0]}: falling back to {chosen[0]}"
    return ProviderChoice(chosen, reason, [f"{why}: dropped" for why in dropped]
                          + [f"{name} comes after cpu, which always loads: never tried" for name in ignored])


def _auto(facts: dict) -> ProviderChoice:
    for name in AUTO_ORDER[:-1]:
        if _unavailable(name, facts) is None:
            return ProviderChoice([name, "cpu"], f"auto: {ORT_PROVIDER[name]} loads here"
                                  + (" (a CUDA GPU and its libraries)" if name == "cuda" else ""))
    notes = []
    for name in AUTO_ORDER[:-1]:  # an accelerator build is installed but cannot run: say why
        if ORT_PROVIDER[name] in facts["available"] or (name == "cuda" and facts["genai_cuda"]):
            notes.append(f"auto: {_unavailable(name, facts).removeprefix(name + ' requested but ')}")
    where = f"{facts['package'] or 'onnxruntime'} {facts['version']}" if facts["version"] else facts["error"]
    return ProviderChoice(["cpu"], f"auto: only the CPU provider loads here ({where})", notes)
