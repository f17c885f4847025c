"""`cascade cloud serve` waits for the workers it starts: one that exits while another is still
starting (killed for memory, a model it cannot load) fails the start at once, naming it; the
demo's gateway waited 600 s for the first worker while the second was already dead."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cloud_tier.config import CloudConfig
from cloud_tier.worker import processes


def test_a_worker_that_dies_while_another_starts_fails_the_start_at_once(monkeypatch):
    started: list[subprocess.Popen] = []

    def spawn(cmd, env=None, die_with_parent=False):
        # the first never becomes healthy (a slow load); the second dies as the OOM killer leaves one
        code = "import time; time.sleep(60)" if not started else "import os, signal; os.kill(os.getpid(), 9)"
        started.append(subprocess.Popen([sys.executable, "-c", code]))
        return started[-1]

    monkeypatch.setattr(processes, "spawn", spawn)
    monkeypatch.setattr("model_distribution.artifacts.model_dirs.resolve_model_dir", lambda model: model)
    config = CloudConfig()
    workers = processes.WorkerProcesses(config)
    begin = time.monotonic()
    try:
        with pytest.raises(processes.StartupError, match=r"decode worker .* killed by signal 9"):
            workers.start(timeout_s=60)
    finally:
        workers.stop()
    assert time.monotonic() - begin < 10
    assert all(p.poll() is not None for p in started)  # the one still starting is stopped too
