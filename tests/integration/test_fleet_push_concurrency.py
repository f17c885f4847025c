"""Concurrent publishes on one fleet home never lose a signed target (issue 36, item 8).

`cascade fleet push` processes started together, and the control plane re-signing the timestamp
in another process while pushes run: every pushed version is listed and signed, a device
verifies each one, and the metadata versions on disk only ever go up, one per write."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from cascade_cli.spawn import cascade_command
from model_distribution.registry.signing import Repository, SigningError
from model_distribution.registry.tuf_client import verified_target
from tests.conftest import REPO
from tests.unit.test_registry import make_gguf
from tests.unit.test_signing import Quiet

PAIRS = 6


@pytest.fixture
def home(tmp_path):
    """A fleet home with its keys made (a push into a home without keys makes them itself)."""
    home = tmp_path / "home"
    Repository(home / "fleet").init()
    return home


def start_push(home: Path, model: Path, version: str) -> subprocess.Popen:
    return subprocess.Popen(cascade_command("fleet", "push", str(model), "--name", "tiny", "--version", version),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CASCADE_HOME": str(home)})


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def versions_on_disk(repo: Repository, role: str) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in repo.metadata_dir.glob(f"*.{role}.json"))


def newest_targets(repo: Repository) -> set[str]:
    newest = versions_on_disk(repo, "targets")[-1]
    return set(json.loads((repo.metadata_dir / f"{newest}.targets.json").read_bytes())["signed"]["targets"])


@pytest.fixture
def metadata_server(home):
    tuf = home / "fleet" / "tuf"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tuf)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def test_parallel_pushes_are_each_listed_signed_and_verified_by_a_device(home, tmp_path, metadata_server):
    models = {f"1.{i // 2}.{i % 2}": make_gguf(tmp_path / f"m{i}.gguf", float(i + 1)) for i in range(2 * PAIRS)}
    procs = {v: start_push(home, m, v) for v, m in models.items()}  # six pairs, all at once
    results = {v: finished(p) for v, p in procs.items()}
    for version, (rc, err) in results.items():
        assert rc == 0 and "Traceback" not in err, (version, rc, err)

    listed = subprocess.run(cascade_command("fleet", "models", "--json"), cwd=REPO, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "CASCADE_HOME": str(home)}, check=True)
    assert {m["version"] for m in json.loads(listed.stdout)} == set(models)
    repo = Repository(home / "fleet")
    assert newest_targets(repo) == {f"tiny/{v}" for v in models}
    # one new targets, snapshot and timestamp version per push, none written twice over
    assert versions_on_disk(repo, "targets") == list(range(1, 2 * PAIRS + 2))
    assert versions_on_disk(repo, "snapshot") == list(range(1, 2 * PAIRS + 2))
    assert repo._load("timestamp").signed.version == 2 * PAIRS + 1
    for version in models:
        info = verified_target(tmp_path / "device", metadata_server, repo.root_bytes(), "tiny", version)
        assert info.length == models[version].stat().st_size


REFRESHER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from model_distribution.registry.signing import Repository

    repo, stop = Repository(sys.argv[1]), Path(sys.argv[2])
    refreshes = 0
    while not stop.exists():
        repo.refresh_timestamp()
        refreshes += 1
    print(refreshes)
""")


def read_versions(repo: Repository) -> tuple[int, int] | None:
    """The timestamp's version and the snapshot version it names, as a device would read them."""
    try:
        signed = json.loads((repo.metadata_dir / "timestamp.json").read_bytes())["signed"]
    except (FileNotFoundError, ValueError):  # ValueError: a torn write, itself a failure
        return None
    return signed["version"], signed["meta"]["snapshot.json"]["version"]


def test_timestamp_refreshes_in_another_process_never_roll_versions_back_or_lose_a_push(home, tmp_path):
    repo = Repository(home / "fleet")
    stop = tmp_path / "stop"
    refresher = subprocess.Popen([sys.executable, "-c", REFRESHER, str(repo.root), str(stop)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    versions = [f"2.0.{i}" for i in range(4)]
    models = {v: make_gguf(tmp_path / f"r{i}.gguf", float(i + 100)) for i, v in enumerate(versions)}
    pushes: list[tuple[int, str]] = []

    def push_one_after_another():
        for v in versions:
            pushes.append(finished(start_push(home, models[v], v)))

    pusher = threading.Thread(target=push_one_after_another)
    pusher.start()
    seen = []
    while pusher.is_alive():
        seen.append(read_versions(repo))
        time.sleep(0.002)
    pusher.join()
    stop.touch()
    out, err = refresher.communicate(timeout=60)
    assert refresher.returncode == 0, err
    refreshes = int(out)

    assert all(rc == 0 and "Traceback" not in e for rc, e in pushes), pushes
    assert None not in seen
    for before, after in zip(seen, seen[1:], strict=False):
        assert after[0] >= before[0] and after[1] >= before[1], (before, after)
    assert refreshes > 0
    # every refresh and every push wrote its own timestamp version, every push its own snapshot
    assert read_versions(repo) == (1 + len(versions) + refreshes, 1 + len(versions))
    assert versions_on_disk(repo, "snapshot") == list(range(1, len(versions) + 2))
    assert newest_targets(repo) == {f"tiny/{v}" for v in versions}


def test_a_writer_that_cannot_get_the_lock_in_time_says_so(home):
    holder, waiter = Repository(home / "fleet"), Repository(home / "fleet", lock_timeout_s=0.2)
    with holder.writing():
        with pytest.raises(SigningError, match="lock"):
            waiter.refresh_timestamp()
    waiter.refresh_timestamp()
    assert waiter._load("timestamp").signed.version == 2
