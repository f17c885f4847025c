"""Issue 37 item 2: every number of the edge agent's configuration is checked (finite, within
sane bounds) where it is read, at start (one line naming the variable, exit 2) and on SIGHUP
("reload refused", the agent keeps what it runs on)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from cascade.config import ConfigError
from cascade_cli.main import main
from edge_agent.config import EdgeConfig
from edge_agent.server.reload import ConfigSource, Reloader

BAD = [
    ("upstream", "timeout_s", "-1"), ("upstream", "timeout_s", "0"), ("upstream", "max_backoff_s", "nan"),
    ("upstream", "refused_backoff_s", "nan"), ("upstream", "max_retry_after_s", "inf"),
    ("sync", "request_ttl_s", "1e999"), ("sync", "base_backoff_s", "nan"), ("sync", "max_backoff_s", "-3"),
    ("sync", "poll_s", "0"), ("sync", "telemetry_ttl_s", "-1"), ("sync", "keep_s", "nan"),
    ("sync", "max_attempts", "0"), ("sync", "max_items", "1" + "0" * 30), ("sync", "batch_size", "10000000"),
    ("server", "drain_timeout_s", "nan"), ("model", "n_batch", "0"), ("queue", "default_max_tokens", "-5"),
    ("mqtt", "telemetry_interval_s", "nan"), ("mqtt", "port", "0"), ("fleet", "disk_budget_bytes", "-1"),
]


@pytest.mark.parametrize("section, key, value", BAD)
def test_the_loader_refuses_each_bad_number_naming_its_variable(section, key, value):
    name = f"CASCADE_EDGE_{section}_{key}".upper()
    with pytest.raises(ConfigError, match=rf"^{name}={value}: \[{section}\] {key} must be a finite number in"):
        EdgeConfig.load(environ={name: value})


@pytest.mark.parametrize("section, key, value", BAD[:4])
def test_a_file_with_a_bad_number_is_refused(tmp_path, section, key, value):
    f = tmp_path / "edge.toml"
    f.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"^\[{section}\]: {key} must be"):
        EdgeConfig.load(f, environ={})


def test_sane_values_still_load():
    c = EdgeConfig.load(environ={"CASCADE_EDGE_UPSTREAM_TIMEOUT_S": "0.5", "CASCADE_EDGE_SYNC_BASE_BACKOFF_S": "0",
                                 "CASCADE_EDGE_SYNC_MAX_ATTEMPTS": "3", "CASCADE_EDGE_SYNC_KEEP_S": "0"})
    assert (c.upstream.timeout_s, c.sync.base_backoff_s, c.sync.max_attempts) == (0.5, 0.0, 3)


def test_edge_run_exits_2_with_one_line_naming_the_variable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    monkeypatch.setenv("CASCADE_EDGE_UPSTREAM_TIMEOUT_S", "-1")
    assert main(["edge", "run", "--no-config"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err  # the error is one line (after the line saying which file, if any, is read)
    assert err.strip().split("\n")[-1].startswith("cascade: CASCADE_EDGE_UPSTREAM_TIMEOUT_S=-1: [upstream] timeout_s")


def test_a_sighup_with_a_bad_number_is_refused_and_changes_nothing(tmp_path, caplog):
    f = tmp_path / "edge.toml"
    f.write_text('[upstream]\nurl = "http://cloud:8080"\ntimeout_s = 60\n')
    source = ConfigSource(str(f))
    running = source.load()
    escalator = SimpleNamespace(config=running.cascade, policy=object(), upstream=object())
    reloader = Reloader(source, running, escalator, outbox=SimpleNamespace())
    f.write_text('[upstream]\nurl = "http://cloud:8080"\ntimeout_s = -1\n')
    with caplog.at_level(logging.ERROR, logger="edge_agent.server.reload"):
        assert asyncio.run(reloader.reload()) is False
    assert "reload refused" in caplog.text and "timeout_s must be a finite number" in caplog.text
    assert reloader.config.upstream.timeout_s == 60.0
