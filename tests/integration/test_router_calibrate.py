"""`cascade calibrate` fits and writes the router: against a real edge agent (SmolLM2 on llama.cpp)
and a synthetic OpenAI worker as the cloud, it reports the router beside each signal, writes
``[cascade] router`` (a valid router for the agent's model and GGUF sha256) into the edge config,
and an agent started with that config has the router on."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from cascade.calibration import load_router
from tests import loopback
from tests.conftest import REPO, Agent
from tests.integration.faulty_openai import FaultyOpenAIWorker


def test_calibrate_writes_a_router_the_agent_then_uses(tmp_path):
    cloud = FaultyOpenAIWorker().start()
    edge = Agent(tmp_path, "--n-ctx", "512", "--threads", "1").wait_healthy()
    try:
        config = tmp_path / "edge.toml"
        config.write_text('[server]\nport = 8081\n')
        out = subprocess.run(
            [sys.executable, "-m", "cascade_cli", "calibrate", "-n", "24", "--target-escalation", "0.3",
             "--edge", edge.url, "--cloud", cloud.url, "--config", str(config), "--plot", str(tmp_path / "c.png"),
             "--max-tokens", "6"],
            env={**os.environ, "CASCADE_HOME": str(tmp_path)}, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "router" in out.stdout and "kept@30%" in out.stdout and "prompt-only" in out.stdout
        from edge_agent.config import EdgeConfig

        cfg = EdgeConfig.load(config)
        router = load_router(Path(cfg.cascade.router))
        served = loopback.get(f"{edge.url}/healthz").json()
        with open(edge_model_path(tmp_path), "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        assert router.edge_model == served["model"] and router.edge_sha256 == served["model_sha256"] == digest
    finally:
        edge.stop()
    again = Agent(tmp_path, "--config", str(config), "--n-ctx", "512", "--threads", "1",
                  env={"CASCADE_EDGE_UPSTREAM_URL": cloud.url}).wait_healthy()
    try:
        health = loopback.get(f"{again.url}/healthz").json()
        assert health["router"]["active"] is True and health["model_sha256"] == digest
    finally:
        again.stop()
        cloud.stop()


def edge_model_path(home: Path) -> Path:
    from model_distribution.artifacts.catalog import Catalog

    return Catalog(home).get("smollm2-135m").path
