"""The `cascade` command as a device integrator runs it."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def cascade(*args, home, env=None):
    return subprocess.run([sys.executable, "-m", "cascade.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "CASCADE_HOME": str(home), **(env or {})})


def test_models_list_table_and_json(tmp_path):
    table = cascade("models", "list", home=tmp_path)
    assert table.returncode == 0
    header, *rows = table.stdout.splitlines()
    assert header.split()[:6] == ["NAME", "FORMAT", "QUANT", "SIZE", "KIND", "STATE"]
    assert any(r.startswith("smollm2-135m") and "Q4_1" in r and ".gguf" in r for r in rows)
    models = json.loads(cascade("models", "list", "--json", home=tmp_path).stdout)
    smol = next(m for m in models if m["name"] == "smollm2-135m")
    assert smol["format"] == "gguf" and smol["size_bytes"] > 90_000_000 and os.path.isfile(smol["path"])
    assert {m["name"] for m in models} >= {"smollm2-135m", "gemma3-270m"}


def test_edge_run_refuses_an_unknown_model_or_bad_config(tmp_path):
    r = cascade("edge", "run", "--model", "nope", home=tmp_path)
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr and "smollm2-135m" in r.stderr
    r = cascade("edge", "run", home=tmp_path, env={"CASCADE_EDGE_SERVER_PORT": "eighty"})
    assert r.returncode == 2 and "server.port" in r.stderr
    bad = tmp_path / "edge.toml"
    bad.write_text("[server]\nprot = 1\n")
    r = cascade("edge", "run", "--config", str(bad), home=tmp_path)
    assert r.returncode == 2 and "prot" in r.stderr
