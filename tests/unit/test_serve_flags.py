"""`cascade cloud serve`'s engine flags: they reach the configuration and the workers it starts
(a flag is in no config file a started worker reads), and a bad value is refused in one line."""

import pytest

from cascade_cli.main import build_parser
from cloud_tier.config import CloudConfig
from cloud_tier.worker.processes import worker_command


def served_config(monkeypatch, *flags: str) -> CloudConfig:
    from cloud_tier import serve

    seen = []
    monkeypatch.setattr(serve, "run", lambda config, path=None: seen.append(config))
    args = build_parser().parse_args(["cloud", "serve", "--both", "1", *flags])
    assert args.func(args) == 0
    return seen[0]


def test_the_targets_dtype_reservations_and_class_targets_reach_the_configuration(monkeypatch):
    config = served_config(monkeypatch, "--ttft-slo-s", "2", "--tpot-slo-s", "0.25", "--dtype", "bfloat16",
                           "--reservations", "gold=0.3", "--class-slos", "interactive=2:0.2,batch=60:1")
    assert (config.engine.ttft_slo_s, config.engine.tpot_slo_s, config.engine.dtype) == (2.0, 0.25, "bfloat16")
    assert config.engine.reservations == "gold=0.3"
    assert config.gateway.class_slos == "interactive=2:0.2,batch=60:1"


def test_a_started_worker_gets_them_as_flags_and_none_it_was_not_given(monkeypatch):
    config = served_config(monkeypatch, "--ttft-slo-s", "2", "--tpot-slo-s", "0.25", "--reservations", "gold=0.3")
    cmd = worker_command(config, "both", "127.0.0.1", 9000, 2, "/etc/cloud.toml")
    pairs = dict(zip(cmd, cmd[1:], strict=False))
    assert pairs["--ttft-slo-s"] == "2.0" and pairs["--tpot-slo-s"] == "0.25" and pairs["--reservations"] == "gold=0.3"
    assert pairs["--role"] == "both" and pairs["--port"] == "9000" and pairs["--config"] == "/etc/cloud.toml"
    plain = worker_command(served_config(monkeypatch), "both", "127.0.0.1", 9000, 2)
    assert not {"--ttft-slo-s", "--tpot-slo-s", "--reservations", "--config"} & set(plain)


@pytest.mark.parametrize("flags", [["--ttft-slo-s", "-1"], ["--tpot-slo-s", "nan"], ["--class-slos", "fast"],
                                   ["--reservations", "gold=2"]])
def test_a_bad_value_exits_2_with_one_line(monkeypatch, capsys, flags):
    from cloud_tier import serve

    monkeypatch.setattr(serve, "run", lambda *a: pytest.fail("nothing may start"))
    args = build_parser().parse_args(["cloud", "serve", "--both", "1", *flags])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cascade: ") and "\n" not in err
