"""The `cascade` command as a device integrator runs it."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def cascade(*args, home, env=None):
    return subprocess.run([sys.executable, "-m", "cascade_cli", *args], cwd=REPO, capture_output=True,
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


def test_edge_run_reads_the_calibrated_config_in_cascade_home_by_default(tmp_path):
    (tmp_path / "edge.toml").write_text("[cascade]\nmin_mean_logprb = -1.0\n")  # what calibrate writes, with a typo
    r = cascade("edge", "run", home=tmp_path)
    assert r.returncode == 2 and "min_mean_logprb" in r.stderr  # it was read
    assert f"config {tmp_path / 'edge.toml'}" in r.stderr  # and it says which file
    r = cascade("edge", "run", "--no-config", "--model", "nope", home=tmp_path)
    assert r.returncode == 2 and "no config file" in r.stderr and "min_mean_logprb" not in r.stderr


def test_edge_queue_shows_the_backlog_and_retries_and_drops(tmp_path):
    from sync.queue import Kind, NewItem, OfflineQueue

    db = tmp_path / "edge" / "queue.db"
    q = OfflineQueue(db)
    ids = q.enqueue_many([NewItem(Kind.REQUEST, {"q": i}, endpoint="chat", session="s") for i in range(3)]
                         + [NewItem(Kind.TELEMETRY, {"t": 1})])
    q.claim(Kind.REQUEST, 1)
    q.complete(ids[0], 400, {"error": {"message": "no"}}, failed=True)
    q.close()

    status = cascade("edge", "queue", home=tmp_path)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[1].split() == ["kind", "queued", "sending", "done", "failed", "expired"]
    assert lines[2].split() == ["request", "2", "0", "0", "1", "0"] and lines[3].split()[1] == "1"
    assert "pending: 3 items" in status.stdout and "oldest pending" in status.stdout
    stats = json.loads(cascade("edge", "queue", "status", "--json", home=tmp_path).stdout)
    assert stats["by_kind"]["request"]["failed"] == 1 and stats["path"] == str(db)
    listed = cascade("edge", "queue", "list", "--state", "failed", home=tmp_path).stdout
    assert ids[0] in listed and ids[1] not in listed

    assert cascade("edge", "queue", "retry", home=tmp_path).stdout.strip() == "1 item(s) queued again"
    assert cascade("edge", "queue", "--db", str(db), "drop", "--kind", "telemetry", home=tmp_path).returncode == 0
    assert cascade("edge", "queue", "drop", "no-such-id", home=tmp_path).returncode == 1
    assert cascade("edge", "queue", "drop", home=tmp_path).returncode == 2  # names nothing
    final = json.loads(cascade("edge", "queue", "status", "--json", env={"CASCADE_EDGE_SYNC_PATH": str(db)},
                               home=tmp_path / "elsewhere").stdout)
    assert final["by_kind"]["request"]["queued"] == 3 and final["by_kind"]["telemetry"]["queued"] == 0
