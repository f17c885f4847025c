"""`cascade edge hardware`: what edge_agent.hardware found, for a person (or --json)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from cascade.units import format_size
from cascade_cli.parsing import add_command

if TYPE_CHECKING:
    from edge_agent.hardware import ProviderChoice


def summary(facts: dict, choice: ProviderChoice) -> list[str]:
    """The report's lines: CPU and flags, memory, GPUs, NPUs, ONNX Runtime, llama.cpp."""
    cpu, mem, ort = facts["cpu"], facts["memory"], facts["onnxruntime"]
    lines = [f"cpu          {cpu['model'] or 'unknown'} ({cpu['arch']}), {cpu['cores']} cores, "
             f"{cpu['usable_cores']} usable here",
             f"cpu flags    {' '.join(cpu['flags']) or 'none of ' + 'avx2/avx512/amx/neon/sve'}"]
    if mem["total_bytes"]:
        avail = f", {format_size(mem['available_bytes'])} available" if mem["available_bytes"] else ""
        lines.append(f"memory       {format_size(mem['total_bytes'])}{avail}")
    for gpu in facts["gpus"] or [None]:
        if gpu is None:
            lines.append("gpus         none found (nvidia-smi, /proc/driver/nvidia, /dev/kfd, /dev/dri)")
            continue
        detail = [f"driver {gpu['driver']}"] if gpu.get("driver") else []
        detail += [format_size(gpu["memory_bytes"])] if gpu.get("memory_bytes") else []
        detail += ["ROCm (/dev/kfd)"] if gpu.get("rocm") else []
        detail += [gpu["device"]] if gpu.get("device") else []
        lines.append(f"gpu          {gpu['vendor']}: {gpu['name'] or 'unnamed'}"
                     + (f" ({', '.join(detail)})" if detail else "") + f"  [{gpu['source']}]")
    for npu in facts["npus"] or [None]:
        lines.append("npus         none found (/dev/accel, /dev/davinci*, /dev/fastrpc*)" if npu is None else
                     f"npu          {npu['kind']}" + (f" ({npu['device']})" if npu["device"] else ""))
    dists = ", ".join(f"{d['name']} {d['version']}" for d in ort["distributions"] + ort["genai_distributions"])
    lines.append(f"onnxruntime  {dists or 'not installed'}")
    if ort["mixed"]:
        lines.append(f"  MIXED INSTALL: {ort['mixed']}")
    if ort["error"]:
        lines.append(f"  {ort['error']}")
    else:
        lines.append(f"  providers available: {', '.join(ort['available'])}")
        lines.append(f"  providers that load: {', '.join(ort['loadable'])}")
        for provider, why in ort["not_loading"].items():
            lines.append(f"  does not load: {provider}: {why}")
    lines.append(f"--backend onnx in auto mode runs on: {', '.join(choice.providers)} ({choice.reason})")
    lines += [f"  warning: {w}" for w in choice.warnings]
    llama = facts["llama_cpp"]
    lines.append(f"llama.cpp    {llama['version']}: {llama['system_info'].strip()}" if llama else
                 "llama.cpp    llama-cpp-python is not installed")
    return lines


def cmd_edge_hardware(args) -> int:
    from edge_agent.hardware import choose_providers, detect

    facts = detect()
    choice = choose_providers([], facts["onnxruntime"])
    if args.json:
        print(json.dumps({**facts, "auto_choice": {"providers": choice.providers, "reason": choice.reason,
                                                   "warnings": choice.warnings}}, indent=2))
    else:
        print("\n".join(summary(facts, choice)))
    return 0


def add_hardware_parser(edge) -> None:
    """``cascade edge hardware [--json]``."""
    hw = add_command(edge, "hardware", "what this device has: CPU features, memory, GPUs, NPUs, and the ONNX Runtime "
                                       "providers that load here (and which one --backend onnx would run on)")
    hw.add_argument("--json", action="store_true", help="print JSON")
    hw.set_defaults(func=cmd_edge_hardware)
