"""A gateway told to stop while it still waits for its workers stops at once: uvicorn only notes a
SIGTERM until the application's startup ends, and the gateway waits up to startup_timeout_s (10 min)
for a worker to give the model's tokenizer."""

import os
import signal
import subprocess
import time

from cascade.processes import free_port
from cascade_cli.spawn import cascade_command
from tests.conftest import REPO


def test_a_sigterm_while_the_gateway_waits_for_its_workers_ends_it_at_once(tmp_path):
    nobody = f"http://127.0.0.1:{free_port()}"  # no worker will ever answer there
    log = tmp_path / "gateway.log"
    env = {**os.environ, "CASCADE_HOME": str(tmp_path)}
    with log.open("w") as out:
        gateway = subprocess.Popen(cascade_command("cloud", "serve", "--workers", nobody, "--port", str(free_port()),
                                                   log_level="INFO"), cwd=REPO, env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while "Waiting for application startup" not in log.read_text():  # uvicorn, as the lifespan begins
            assert gateway.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        asked = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        rc = gateway.wait(timeout=30)
        assert time.monotonic() - asked < 10, log.read_text()
        assert rc == 128 + signal.SIGTERM, log.read_text()  # ended by the signal, as after a served run
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
