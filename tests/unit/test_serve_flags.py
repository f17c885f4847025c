"""`cascade cloud serve`'s engine flags: they reach the configuration and the workers it starts
(a flag is in no config file a started worker reads), and a bad value is refused in one line."""

import sys

import pytest

from cascade_cli.main import build_parser
from cloud_tier.config import CloudConfig
from cloud_tier.worker.processes import worker_command
from cloud_tier.worker.settings import SETTINGS_ENV, read_settings


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


def test_a_started_worker_gets_them_and_none_it_was_not_given(monkeypatch):
    config = served_config(monkeypatch, "--ttft-slo-s", "2", "--tpot-slo-s", "0.25", "--reservations", "gold=0.3")
    cmd, env = worker_command(config, "both", "127.0.0.1", 9000, 2)
    assert cmd[:3] == [sys.executable, "-m", "cloud_tier.worker"]
    worker, _ = read_settings(env[SETTINGS_ENV])
    e = worker.engine
    assert (e.ttft_slo_s, e.tpot_slo_s, e.reservations) == (2.0, 0.25, "gold=0.3")
    assert (worker.worker.role, worker.server.host, worker.server.port, e.threads) == ("both", "127.0.0.1", 9000, 2)
    plain, _ = read_settings(worker_command(served_config(monkeypatch), "both", "127.0.0.1", 9000, 2)[1][SETTINGS_ENV])
    assert (plain.engine.ttft_slo_s, plain.engine.tpot_slo_s, plain.engine.reservations) == (None, None, "")


def test_a_started_workers_keys_and_database_urls_stay_out_of_its_command_line(monkeypatch):
    """``ps`` shows every process's command line to every user of the host; the environment is the user's."""
    monkeypatch.setenv("CASCADE_CLOUD_SERVER_API_KEY", "worker-secret-1")
    monkeypatch.setenv("CASCADE_CLOUD_GATEWAY_DB", "postgresql://cascade:db-secret-2@db/cascade")
    cmd, env = worker_command(served_config(monkeypatch), "both", "127.0.0.1", 9000, 2)
    assert cmd == [sys.executable, "-m", "cloud_tier.worker"]
    worker, _ = read_settings(env[SETTINGS_ENV])
    assert worker.server.api_key == "worker-secret-1"
    assert "db-secret-2" in env[SETTINGS_ENV]  # the setting was there to leak, and stays in the environment


@pytest.mark.parametrize("flags", [["--ttft-slo-s", "-1"], ["--tpot-slo-s", "nan"], ["--class-slos", "fast"],
                                   ["--reservations", "gold=2"]])
def test_a_bad_value_exits_2_with_one_line(monkeypatch, capsys, flags):
    from cloud_tier import serve

    monkeypatch.setattr(serve, "run", lambda *a: pytest.fail("nothing may start"))
    args = build_parser().parse_args(["cloud", "serve", "--both", "1", *flags])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cascade: ") and "\n" not in err


def test_the_speculation_flags_reach_the_workers_it_starts(monkeypatch):
    config = served_config(monkeypatch, "--speculative", "ngram", "--num-speculative-tokens", "6")
    worker, _ = read_settings(worker_command(config, "both", "127.0.0.1", 9000, 2)[1][SETTINGS_ENV])
    assert (worker.engine.speculative, worker.engine.num_speculative_tokens) == ("ngram", 6)
    assert served_config(monkeypatch, "--speculative", "none").engine.speculative == ""
    assert served_config(monkeypatch).engine.speculative == ""  # off unless asked


@pytest.mark.parametrize("flags", [["--speculative", "eagle"], ["--num-speculative-tokens", "0"],
                                   ["--num-speculative-tokens", "65"]])
def test_a_bad_speculation_flag_is_one_line_and_exit_2(flags, capsys):
    with pytest.raises(SystemExit) as e:
        args = build_parser().parse_args(["cloud", "worker", *flags])
        sys.exit(args.func(args))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "speculative" in err[-1]
