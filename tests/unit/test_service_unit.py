"""The systemd unit `cascade edge install-service` writes (edge_agent/service_unit.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from edge_agent.service_unit import ServiceSpec, next_steps, unit_text


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_the_unit_is_a_notify_service_with_a_watchdog_run_by_an_unprivileged_user():
    d = directives(unit_text(ServiceSpec(["/opt/cascade/bin/cascade"])))
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"] and d["WatchdogSec"] == ["30"]
    assert d["Restart"] == ["on-failure"] and d["KillSignal"] == ["SIGTERM"]
    assert d["User"] == ["cascade"] and d["Group"] == ["cascade"]
    assert d["ExecStart"] == ["/opt/cascade/bin/cascade edge run --config /etc/cascade/edge.toml"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert "CASCADE_HOME=/var/lib/cascade" in d["Environment"]
    assert d["StateDirectory"] == ["cascade"] and d["WorkingDirectory"] == ["/var/lib/cascade"]
    assert d["NoNewPrivileges"] == ["yes"] and d["PrivateTmp"] == ["yes"]
    assert d["ProtectSystem"] == ["strict"] and d["ReadWritePaths"] == ["/var/lib/cascade"]
    assert d["WantedBy"] == ["multi-user.target"]


def test_the_stop_timeout_outlasts_the_drain():
    assert int(directives(unit_text(ServiceSpec(["/usr/bin/cascade"], drain_timeout_s=90)))["TimeoutStopSec"][0]) > 90
    assert int(directives(unit_text(ServiceSpec(["/usr/bin/cascade"])))["TimeoutStopSec"][0]) > 30


def test_state_outside_var_lib_has_no_state_directory_and_must_be_made_first():
    spec = ServiceSpec(["/usr/bin/python3", "-m", "cascade_cli"], state_dir="/srv/cascade", user="kiosk",
                       group="edge")
    d = directives(unit_text(spec))
    assert "StateDirectory" not in d and d["ReadWritePaths"] == ["/srv/cascade"]
    assert d["ExecStart"][0].startswith("/usr/bin/python3 -m cascade_cli edge run")
    assert d["User"] == ["kiosk"] and d["Group"] == ["edge"]
    steps = next_steps(spec, "/etc/systemd/system/cascade-edge.service", config_exists=False)
    assert any(s.startswith("sudo install -d") and "/srv/cascade" in s for s in steps)
    assert "sudo systemctl enable --now cascade-edge.service" in steps


def test_an_executable_under_home_keeps_home_readable():
    assert directives(unit_text(ServiceSpec(["/home/pi/venv/bin/cascade"])))["ProtectHome"] == ["read-only"]
    assert directives(unit_text(ServiceSpec(["/usr/bin/cascade"])))["ProtectHome"] == ["yes"]


@pytest.mark.parametrize("kwargs, says", [
    ({"user": "root"}, "root"),
    ({"group": "root"}, "root"),
    ({"user": "Kiosk User"}, "--user"),
    ({"state_dir": "var/lib/cascade"}, "--state-dir"),
    ({"state_dir": "/"}, "--state-dir"),
    ({"state_dir": "/var/lib/../etc"}, "--state-dir"),
    ({"config": "/etc/cascade/edge 1.toml"}, "--config"),
    ({"config": "/etc/%h.toml"}, "--config"),
    ({"command": ["cascade"]}, "executable"),
    ({"watchdog_s": 0}, "--watchdog-sec"),
])
def test_bad_settings_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says.replace("-", r"\-")):
        ServiceSpec(**{"command": ["/usr/bin/cascade"], **kwargs})


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    unit = tmp_path / "cascade-edge.service"
    unit.write_text(unit_text(ServiceSpec([sys.executable, "-m", "cascade_cli"])))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "cascade-edge.service" not in r.stderr, r.stderr
