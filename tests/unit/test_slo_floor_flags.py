"""The floors on what a request's service-level targets may ask (issue 37 item 3) reach the
configuration from `cascade cloud serve` / `cloud worker`, and the workers it starts get the engine's."""

import pytest

from cloud_tier.config import GatewayConfig
from cloud_tier.engine_config import EngineConfig
from cloud_tier.worker.processes import worker_command
from cloud_tier.worker.settings import SETTINGS_ENV, read_settings
from tests.unit.test_serve_flags import served_config


def test_the_floors_reach_the_gateway_the_engine_and_the_started_workers(monkeypatch):
    config = served_config(monkeypatch, "--request-min-ttft-slo-s", "0.5", "--request-min-tpot-slo-s", "0.05",
                           "--tpot-min-batch", "12", "--min-tpot-slo-s", "0.08")
    assert (config.gateway.min_ttft_slo_s, config.gateway.min_tpot_slo_s) == (0.5, 0.05)
    assert (config.engine.tpot_min_batch, config.engine.min_tpot_slo_s) == (12, 0.08)
    worker, _ = read_settings(worker_command(config, "both", "127.0.0.1", 9000, 2)[1][SETTINGS_ENV])
    assert (worker.engine.tpot_min_batch, worker.engine.min_tpot_slo_s) == (12, 0.08)


def test_bad_floors_and_class_targets_under_them_are_refused():
    for bad in ({"tpot_min_batch": 0}, {"min_tpot_slo_s": -1.0}, {"min_tpot_slo_s": float("inf")}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="min_tpot_slo_s"):
        GatewayConfig(both=1, class_slos="interactive=2:0.001")
    assert GatewayConfig(both=1, class_slos="interactive=2:0.001", min_tpot_slo_s=0).class_slos
