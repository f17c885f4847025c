"""The layer contract at run time: what importing a deployable actually loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_gateway_loads_neither_torch_nor_the_engine():
    mods = loaded_after("import cloud_tier.gateway.http.app, cloud_tier.serve")
    assert "torch" not in mods
    # cloud_tier.engine_config (the engine's settings, plain dataclasses) is not the engine
    assert not {m for m in mods if m == "cloud_tier.engine" or m.startswith((
        "cloud_tier.engine.", "cloud_tier.worker.app", "cloud_tier.disagg.transport", "transformers"))}


@pytest.mark.parametrize("module", ["edge_agent.server.app", "cascade_cli.edge_queue", "sync.delivery", "sync.mqtt"])
def test_the_edge_agent_and_sync_never_load_torch(module):
    assert "torch" not in loaded_after(f"import {module}")


def test_the_cascade_command_loads_no_deployable_until_a_subcommand_runs():
    mods = loaded_after("import cascade_cli.main as m; m.build_parser()")
    assert "torch" not in mods and "llama_cpp" not in mods and "fastapi" not in mods


def test_the_contract_package_imports_no_deployable():
    mods = loaded_after("import cascade, cascade.protocol, cascade.policy, cascade.web, cascade.eval.calibration, "
                        "cascade.config, cascade.processes")
    assert not {m for m in mods if m.split(".")[0] in ("edge_agent", "cloud_tier", "model_distribution", "sync",
                                                       "cascade_cli")}


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    import cascade

    assert cascade.__version__ == version("cascade-serve")
    out = subprocess.run([sys.executable, "-m", "cascade_cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"cascade {cascade.__version__}"
