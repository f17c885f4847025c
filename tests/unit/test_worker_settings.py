"""The settings `cascade cloud serve` hands the workers it starts (`python -m cloud_tier.worker`)."""

import pytest

from cloud_tier.config import CloudConfig, GatewayConfig
from cloud_tier.engine_config import EngineConfig
from cloud_tier.worker.__main__ import main
from cloud_tier.worker.settings import read_settings, worker_settings


def test_the_whole_configuration_goes_through_and_is_checked_again():
    config = CloudConfig(engine=EngineConfig(ttft_slo_s=2.0, reservations="gold=0.3", num_kv_blocks=64),
                         gateway=GatewayConfig(both=1, prefill=0, decode=0, class_slos="batch=60:1"))
    back, level = read_settings(worker_settings(config, "DEBUG"))
    assert back == config and level == "DEBUG"
    assert back.engine.scheduler.default_ttft_s == 2.0 and back.engine.scheduler.reservations == "gold=0.3"
    bad = worker_settings(config, "INFO").replace('"reservations": "gold=0.3"', '"reservations": "gold=2"')
    with pytest.raises(ValueError, match="reservations"):
        read_settings(bad)


@pytest.mark.parametrize("argv", [[], ["not json"], ['{"config": {}}'], ["{}", "{}"]])
def test_bad_settings_exit_2_with_one_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cloud_tier.worker: bad settings") and "\n" not in err
