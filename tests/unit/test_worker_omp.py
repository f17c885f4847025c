"""The OpenMP wait policy a worker process starts with: a bounded spin for a worker of two or more
threads (passive threads cost a wake-up per parallel region), passive otherwise or when asked,
and spawn() dropping what is given as None."""

import subprocess
import sys

from cascade.processes import spawn
from cloud_tier.worker.processes import worker_omp_env


def test_a_multi_threaded_worker_spins_a_bounded_while(monkeypatch):
    monkeypatch.delenv("CASCADE_ENGINE_OMP_SPINCOUNT", raising=False)
    assert worker_omp_env(2) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "30000"}
    assert worker_omp_env(1) == {}  # no helper threads to wake
    monkeypatch.setenv("CASCADE_ENGINE_OMP_SPINCOUNT", "0")
    assert worker_omp_env(2) == {}
    monkeypatch.setenv("CASCADE_ENGINE_OMP_SPINCOUNT", "5000")
    assert worker_omp_env(4)["GOMP_SPINCOUNT"] == "5000"


def test_spawn_removes_variables_given_as_none_and_sets_passive_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    show = [sys.executable, "-c",
            "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"]
    for env, expected in (({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "30000"}, "None 30000"), (None, "passive None")):
        log = tmp_path / f"{expected.replace(' ', '_')}.log"
        proc = spawn(show, env=env, log=log)
        assert proc.wait(30) == 0
        assert log.read_text().strip() == expected


def test_the_cli_keeps_a_bounded_spin_it_was_given():
    code = ("import os; os.environ.pop('OMP_WAIT_POLICY', None); os.environ['GOMP_SPINCOUNT'] = '30000'; "
            "import cascade_cli.main; print(os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "None"
