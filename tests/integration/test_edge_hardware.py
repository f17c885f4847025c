"""`cascade edge hardware` as a device integrator runs it."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def hardware(*args, pythonpath: str | None = None):
    env = {**os.environ}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "cascade_cli", "edge", "hardware", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)


def test_hardware_reports_cpu_onnxruntime_providers_and_the_auto_choice():
    r = hardware()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for heading in ("cpu ", "cpu flags", "memory", "onnxruntime  onnxruntime ", "providers that load:",
                    "--backend onnx in auto mode runs on:", "llama.cpp"):
        assert heading in out
    assert "CPUExecutionProvider" in out and "MIXED INSTALL" not in out


def test_hardware_json_is_detect_plus_the_auto_choice():
    r = hardware("--json")
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["cpu"]["cores"] >= 1 and isinstance(facts["cpu"]["flags"], list)
    assert facts["memory"]["total_bytes"] > 0 and isinstance(facts["gpus"], list)
    assert "CPUExecutionProvider" in facts["onnxruntime"]["loadable"]
    assert facts["auto_choice"]["providers"][-1] == "cpu" and facts["auto_choice"]["reason"].startswith("auto:")


def test_hardware_still_reports_on_a_mixed_install_and_says_how_to_fix_it(tmp_path):
    info = tmp_path / "onnxruntime_gpu-1.32.0.dist-info"  # as `pip install onnxruntime-gpu` beside it leaves
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.32.0\n")
    r = hardware(pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stderr
    mixed = next(line for line in r.stdout.splitlines() if "MIXED INSTALL" in line)
    assert "onnxruntime 1.32.0" in mixed and "onnxruntime-gpu 1.32.0" in mixed
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in mixed and "pip install --force-reinstall" in mixed
    assert "providers that load:" in r.stdout  # the rest of the report is still there
    facts = json.loads(hardware("--json", pythonpath=str(tmp_path)).stdout)
    assert "onnxruntime-gpu" in facts["onnxruntime"]["mixed"]
