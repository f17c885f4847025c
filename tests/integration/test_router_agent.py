"""The agent with a router (SmolLM2 on llama.cpp, a synthetic OpenAI worker as its cloud): a router
whose stage 1 is always sure escalates "hard" before generating; one never sure before generating
whose stage 2 escalates gives "low_confidence" after the hold-back; one calibrated for another
model (or another GGUF) falls back to the configured thresholds and says so in its log and
/healthz; a bad router file refuses to start, one line naming the key, exit 2."""

from __future__ import annotations

import json
import subprocess

import pytest

from cascade.policy.router import Router, Stage
from cascade_cli.spawn import cascade_command
from tests import loopback
from tests.conftest import REPO, Agent
from tests.integration.faulty_openai import FaultyOpenAIWorker

MODEL = "smollm2-135m"
WINDOW = 4


def router_file(path, stage1_bias: float, stage2_bias: float, model: str = MODEL, sha256: str = "") -> str:
    def stage(bias):  # no weights: the stage's score is sigmoid(bias) whatever the request
        return Stage({}, {}, {}, bias)
    path.write_text(json.dumps(Router(model, sha256, WINDOW, stage(stage1_bias), stage(stage2_bias), 0.5, 0.5,
                                      0.3).to_json()))
    return str(path)


@pytest.fixture(scope="module")
def cloud():
    w = FaultyOpenAIWorker().start()
    yield w
    w.stop()


def start(home, cloud, router: str, **cascade) -> Agent:
    env = {"CASCADE_EDGE_UPSTREAM_URL": cloud.url, "CASCADE_EDGE_CASCADE_ROUTER": router,
           "CASCADE_EDGE_CASCADE_HOLD_TOKENS": str(WINDOW)}
    env.update({f"CASCADE_EDGE_CASCADE_{k.upper()}": str(v) for k, v in cascade.items()})
    return Agent(home, "--n-ctx", "512", "--threads", "1", env=env).wait_healthy()


def ask(agent) -> tuple[dict, dict]:
    r = loopback.post(f"{agent.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
        "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.headers), r.json()


def hold_backs(agent) -> str:
    text = loopback.get(f"{agent.url}/metrics").text
    return next((line for line in text.splitlines() if line.startswith("cascade_edge_hold_back_seconds_count")), "")


def test_stage_one_sure_escalates_hard_before_generating(tmp_path, cloud):
    a = start(tmp_path, cloud, router_file(tmp_path / "r.json", stage1_bias=10.0, stage2_bias=-10.0))
    try:
        headers, body = ask(a)
        assert (headers["x-cascade-tier"], headers["x-cascade-reason"]) == ("cloud", "hard")
        assert "confidence" not in body["cascade"]  # nothing was generated here
        assert hold_backs(a) in ("", "cascade_edge_hold_back_seconds_count 0.0")
        health = loopback.get(f"{a.url}/healthz").json()
        assert health["router"]["active"] is True and health["router"]["edge_model"] == MODEL
    finally:
        a.stop()


def test_stage_two_escalates_low_confidence_after_the_hold_back(tmp_path, cloud):
    a = start(tmp_path, cloud, router_file(tmp_path / "r.json", stage1_bias=-10.0, stage2_bias=10.0))
    try:
        headers, body = ask(a)
        assert (headers["x-cascade-tier"], headers["x-cascade-reason"]) == ("cloud", "low_confidence")
        conf = body["cascade"]["confidence"]
        assert conf["tokens"] == WINDOW and len(conf["logprobs"]) == len(conf["entropies"]) == WINDOW
        assert hold_backs(a) == "cascade_edge_hold_back_seconds_count 1.0"
    finally:
        a.stop()


def test_a_router_that_never_escalates_keeps_the_answer_local_whatever_the_thresholds_say(tmp_path, cloud):
    # the thresholds alone would escalate every answer (every logprob < 0): the router replaces them
    a = start(tmp_path, cloud, router_file(tmp_path / "r.json", stage1_bias=-10.0, stage2_bias=-10.0),
              min_mean_logprob="0.0")
    try:
        headers, body = ask(a)
        assert (headers["x-cascade-tier"], headers["x-cascade-reason"]) == ("edge", "easy")
        assert body["cascade"]["confidence"]["tokens"] >= 1
    finally:
        a.stop()


@pytest.mark.parametrize("model,sha256", [("qwen2.5-coder-0.5b", ""), (MODEL, "00" * 32)])
def test_a_router_calibrated_for_another_model_falls_back_and_says_so(tmp_path, cloud, model, sha256):
    a = start(tmp_path, cloud, router_file(tmp_path / "r.json", 10.0, 10.0, model=model, sha256=sha256))
    try:
        headers, _ = ask(a)  # the router would escalate everything; the thresholds (off) keep it here
        assert (headers["x-cascade-tier"], headers["x-cascade-reason"]) == ("edge", "easy")
        health = loopback.get(f"{a.url}/healthz").json()
        assert health["router"]["active"] is False and "router off" in health["router"]["reason"]
        assert "router off" in a.log.read_text()
    finally:
        a.stop()


def test_a_bad_router_file_refuses_to_start_naming_the_key(tmp_path):
    bad = tmp_path / "router.json"
    data = json.loads(_read(router_file(tmp_path / "good.json", 0.0, 0.0)))
    data["stage2"]["weights"] = {"bogus_feature": 1.0}
    data["stage2"]["mean"], data["stage2"]["scale"] = {"bogus_feature": 0.0}, {"bogus_feature": 1.0}
    bad.write_text(json.dumps(data))
    proc = subprocess.run(cascade_command("edge", "run", "--port", "0"), cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**_env(tmp_path), "CASCADE_EDGE_CASCADE_ROUTER": str(bad)})
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "router" in last and "bogus_feature" in last


def _read(path: str) -> str:
    from pathlib import Path

    return Path(path).read_text()


def _env(home) -> dict:
    import os

    return {**os.environ, "CASCADE_HOME": str(home)}
