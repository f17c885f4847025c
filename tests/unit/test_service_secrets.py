"""Issue 37 item 16: the service's config holds the device's secrets, so the documented install
keeps it from other users, the agent warns when it is readable by everyone, and
`install-service` says where it writes and never replaces another unit unasked."""

from __future__ import annotations

import os
import subprocess
import sys

from edge_agent.config import EdgeConfig
from edge_agent.service_unit import ServiceSpec, exposed_secrets, next_steps
from tests.conftest import REPO


def cascade(*args, home):
    return subprocess.run([sys.executable, "-m", "cascade_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**{k: v for k, v in os.environ.items()
                                                         if k != "CASCADE_EDGE_MODEL_NAME"},  # files name it here
                                                      "CASCADE_HOME": str(home)})


def test_the_documented_install_of_the_config_is_readable_by_the_agents_group_only():
    steps = next_steps(ServiceSpec(["/opt/cascade/bin/cascade"], user="kiosk"), "-", config_exists=False)
    install = next(s for s in steps if "edge.toml" in s and "install" in s)
    assert "-m 0640" in install and "-o root -g kiosk" in install and "0644" not in install


def test_a_world_readable_config_with_a_secret_is_named_and_a_private_one_is_not(tmp_path):
    path = tmp_path / "edge.toml"
    path.write_text('[fleet]\nsecret = "s3cret"\n[upstream]\napi_key = "csk-1"\n')
    config = EdgeConfig.load(path, environ={})
    os.chmod(path, 0o644)
    assert exposed_secrets(str(path), config) == ["[fleet] secret", "[upstream] api_key"]
    os.chmod(path, 0o640)
    assert exposed_secrets(str(path), config) == []
    plain = tmp_path / "plain.toml"
    plain.write_text("[server]\nport = 8081\n")
    os.chmod(plain, 0o644)
    assert exposed_secrets(str(plain), EdgeConfig.load(plain, environ={})) == []
    assert exposed_secrets(None, config) == []


def test_install_service_never_replaces_another_unit_unasked(tmp_path):
    unit = tmp_path / "cascade-edge.service"
    unit.write_text("[Unit]\nDescription=someone else's unit\n")
    r = cascade("edge", "install-service", "--output", str(unit), "--config", "/etc/cascade/edge.toml", home=tmp_path)
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert "someone else's" in unit.read_text()
    r = cascade("edge", "install-service", "--output", str(unit), "--force", home=tmp_path)
    assert r.returncode == 0 and unit.read_text().startswith("[Unit]") and "Type=notify" in unit.read_text()
    again = cascade("edge", "install-service", "--output", str(unit), home=tmp_path)  # the same unit: no --force
    assert again.returncode == 0, again.stderr


def test_install_service_help_names_the_default_unit_path_and_force(tmp_path):
    help_text = cascade("edge", "install-service", "--help", home=tmp_path).stdout
    assert "/etc/systemd/system/cascade-edge.service" in help_text and "--force" in help_text


def test_edge_run_warns_when_its_config_file_shows_a_secret_to_every_user(tmp_path):
    path = tmp_path / "edge.toml"
    path.write_text('[model]\nname = "/nonexistent/model.gguf"\n[fleet]\nsecret = "s3cret"\n')
    os.chmod(path, 0o644)
    r = cascade("edge", "run", "--config", str(path), home=tmp_path)  # refused for its model, after the warning
    assert r.returncode == 2 and "[fleet] secret" in r.stderr and "chmod 0640" in r.stderr, r.stderr
    assert "s3cret" not in r.stderr
