"""The `cascade` command as a device integrator runs it."""

import json
import os
import shutil
import subprocess
import sys

import pytest

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
    said = [ln for ln in r.stderr.splitlines() if not ln.startswith("cascade: config") and "no config file" not in ln]
    assert r.returncode == 2 and len(said) == 1 and "CASCADE_EDGE_SERVER_PORT" in said[0], r.stderr
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


def test_edge_queue_reads_the_agents_default_config_in_cascade_home(tmp_path):
    """Issue 37 item 14: with no --config, `cascade edge queue` reads $CASCADE_HOME/edge.toml, as the agent does."""
    from sync.queue import Kind, NewItem, OfflineQueue

    db = tmp_path / "elsewhere" / "outbox.db"
    q = OfflineQueue(db)
    (item,) = q.enqueue_many([NewItem(Kind.REQUEST, {"q": 1}, endpoint="chat", session="s")])
    q.close()
    (tmp_path / "edge.toml").write_text(f'[sync]\npath = "{db}"\n')
    listed = cascade("edge", "queue", "list", home=tmp_path)
    assert listed.returncode == 0 and item in listed.stdout, listed.stderr


def test_calibrate_with_nothing_running_says_what_it_tried_and_how_to_start_it(tmp_path):
    """Issue 37 item 17: not only "Connection refused"."""
    from cascade.processes import free_port

    edge = f"http://127.0.0.1:{free_port()}"
    r = cascade("calibrate", "--edge", edge, "--cloud", f"http://127.0.0.1:{free_port()}", "-n", "2", home=tmp_path)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"{edge}/v1/models" in r.stderr and "the edge agent" in r.stderr and "cascade edge run" in r.stderr


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


def test_fleet_push_and_models_on_a_real_gguf(tmp_path, smollm2_path):
    import hashlib

    pushed = cascade("fleet", "push", smollm2_path, "--name", "smollm2-135m", "--version", "1.1.0", "--json",
                     home=tmp_path)
    assert pushed.returncode == 0, pushed.stderr
    m = json.loads(pushed.stdout)
    with open(smollm2_path, "rb") as f:
        assert m["sha256"] == hashlib.file_digest(f, "sha256").hexdigest()
    assert (m["format"], m["quantization"], m["architecture"], m["created"]) == ("gguf", "Q4_1", "llama", True)
    from model_distribution.registry.signing import Repository

    assert Repository(tmp_path / "fleet").has_target("smollm2-135m", "1.1.0")  # signed (keys made on first push)
    again = cascade("fleet", "push", smollm2_path, "--name", "smollm2-135m", "--version", "1.1.0", home=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    other = tmp_path / "other.gguf"
    shutil.copyfile(smollm2_path, other)
    with open(other, "r+b") as f:  # the same header, other weights
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    refused = cascade("fleet", "push", str(other), "--name", "smollm2-135m", "--version", "1.1.0", home=tmp_path)
    assert refused.returncode == 2 and "immutable" in refused.stderr and len(refused.stderr.splitlines()) == 1
    listed = json.loads(cascade("fleet", "models", "--json", home=tmp_path).stdout)
    assert [(x["name"], x["version"], x["sha256"]) for x in listed] == [("smollm2-135m", "1.1.0", m["sha256"])]
    table = cascade("fleet", "models", home=tmp_path).stdout.splitlines()
    assert table[0].split() == ["NAME", "VERSION", "FORMAT", "QUANT", "SIZE", "SHA256", "PUSHED"]


@pytest.mark.parametrize("args, says", [(["push", "README.md", "--name", "x", "--version", "1.0.0"], "GGUF magic"),
                                        (["push", "nope.gguf", "--name", "x", "--version", "1.0.0"], "not a file"),
                                        (["push", "README.md", "--name", "x", "--version", "one"], "semantic"),
                                        (["push", "README.md", "--version", "1.0.0"], "--name")])
def test_fleet_push_refuses_bad_files_and_flags_with_exit_2(tmp_path, args, says):
    r = cascade("fleet", *args, home=tmp_path)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_fleet_keys_init_once(tmp_path):
    first = cascade("fleet", "keys", "init", home=tmp_path)
    assert first.returncode == 0 and "1.root.json" in first.stdout
    second = cascade("fleet", "keys", "init", home=tmp_path)
    assert second.returncode == 2 and "exist already" in second.stderr


def test_fleet_devices_and_assign(tmp_path, smollm2_path):
    assert cascade("fleet", "push", smollm2_path, "--name", "smollm2-135m", "--version", "1.1.0",
                   home=tmp_path).returncode == 0
    added = cascade("fleet", "devices", "add", "kiosk-7", "--group", "kiosks", "--json", home=tmp_path)
    assert added.returncode == 0 and json.loads(added.stdout)["secret"]
    assert cascade("fleet", "devices", "add", "kiosk-8", "--group", "kiosks", home=tmp_path).returncode == 0
    again = cascade("fleet", "devices", "add", "kiosk-7", home=tmp_path)
    assert again.returncode == 2 and "enrolled already" in again.stderr
    r = cascade("fleet", "assign", "--group", "kiosks", "smollm2-135m@1.1.0", home=tmp_path)
    assert r.returncode == 0 and "2 device(s)" in r.stdout
    listed = json.loads(cascade("fleet", "devices", "--group", "kiosks", "--json", home=tmp_path).stdout)
    assert [(d["device"], d["desired"], d["desired_rev"]) for d in listed] == [
        ("kiosk-7", "smollm2-135m@1.1.0", 1), ("kiosk-8", "smollm2-135m@1.1.0", 1)]
    for bad, says in [(["assign", "kiosk-7", "smollm2-135m@9.9.9"], "not published"),
                      (["assign", "smollm2-135m@1.1.0"], "one device or --group"),
                      (["assign", "nobody", "smollm2-135m@1.1.0"], "no device")]:
        r = cascade("fleet", *bad, home=tmp_path)
        assert r.returncode == 2 and says in r.stderr, (bad, r.stderr)
    table = cascade("fleet", "devices", home=tmp_path).stdout.splitlines()
    assert table[0].split() == ["DEVICE", "GROUPS", "ONLINE", "DESIRED", "REPORTED", "STATE", "ROLLOUT", "LAST",
                                "SEEN", "REQUESTS", "ESCALATED", "ERRORS", "BACKLOG"] and len(table) == 3
    assert table[1].split()[:5] == ["kiosk-7", "kiosks", "-", "smollm2-135m@1.1.0", "-"]  # never connected yet


@pytest.mark.parametrize("args, env", [
    (("cloud", "worker", "--kv-cache-dtype", "fp8"), {}),
    (("cloud", "serve", "--kv-cache-dtype", "fp8"), {}),
    (("cloud", "worker",), {"CASCADE_CLOUD_ENGINE_KV_CACHE_DTYPE": "fp8"}),
])
def test_a_bad_kv_cache_dtype_exits_2_with_one_line_naming_the_choices(tmp_path, args, env):
    r = cascade(*args, home=tmp_path, env=env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "kv_cache_dtype" in r.stderr and "auto, int8" in r.stderr and "'fp8'" in r.stderr
