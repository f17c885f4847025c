"""The systemd unit that runs the edge agent as a service (``cascade edge install-service``).

``Type=notify``: systemd counts the agent started when it says ``READY=1`` (model loaded, port
listening; edge_agent/sd_notify.py), restarts it when its watchdog pings stop or it fails, and
reloads it with SIGHUP. It runs as an unprivileged user with its state (queue, keys, model
cache) in one writable directory and the rest of the file system read-only.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import PurePosixPath

DEFAULT_UNIT_PATH = "/etc/systemd/system/cascade-edge.service"
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
_PATH = re.compile(r"/[A-Za-z0-9._+:@/-]*")  # no spaces, quotes, %, $ or \: nothing to escape


@dataclass
class ServiceSpec:
    """What the unit says. Paths absolute; ``command`` is the ``cascade`` executable, or an
    interpreter followed by ``-m cascade_cli``."""

    command: list[str]
    config: str = "/etc/cascade/edge.toml"
    user: str = "cascade"
    group: str = ""  # "": the user's name (useradd --user-group)
    state_dir: str = "/var/lib/cascade"
    drain_timeout_s: float = 30.0  # [server] drain_timeout_s: the stop timeout leaves room beyond it
    watchdog_s: int = 30
    start_timeout_s: int = 300  # a first start may unpack a packaged model

    def __post_init__(self):
        self.group = self.group or self.user
        for what, name in (("user", self.user), ("group", self.group)):
            if not _USER.fullmatch(name):
                raise ValueError(f"--{what} {name!r} is not a valid name (lower-case letters, digits, _ and -)")
        if self.user == "root" or self.group == "root":
            raise ValueError("the agent must not run as root: name an unprivileged --user")
        paths = [("--state-dir", self.state_dir), ("--config", self.config), ("the executable", self.command[0])]
        for what, path in paths:
            if not _PATH.fullmatch(path) or "/../" in f"{path}/":
                raise ValueError(f"{what} must be an absolute path without spaces, quotes, '%', '$' or '..', "
                                 f"got {path!r}")
        if PurePosixPath(self.state_dir) == PurePosixPath("/"):
            raise ValueError("--state-dir must not be /")
        if self.watchdog_s < 1:
            raise ValueError(f"--watchdog-sec must be >= 1, got {self.watchdog_s}")

    @property
    def state_directory(self) -> str | None:
        """``StateDirectory=`` (systemd creates it, owned by the user) when the state lives under
        /var/lib, where that directive puts it; elsewhere the directory must exist already."""
        p = PurePosixPath(self.state_dir)
        if p.parts[:3] == ("/", "var", "lib") and len(p.parts) > 3:
            return str(p.relative_to("/var/lib"))
        return None

    @property
    def stop_timeout_s(self) -> int:
        """Longer than the drain, so systemd's SIGKILL never cuts a drain the agent would finish;
        the margin covers the queue's close and the model's unload."""
        return int(self.drain_timeout_s) + 30


def unit_text(spec: ServiceSpec) -> str:
    """The unit file's text."""
    exec_start = " ".join([*spec.command, "edge", "run", "--config", spec.config])
    protect_home = "read-only" if _under_home(spec.command[0]) else "yes"  # a venv in a home must stay readable
    state = [f"StateDirectory={spec.state_directory}", "StateDirectoryMode=0750"] if spec.state_directory else []
    lines = [
        "[Unit]",
        "Description=cascade edge agent (local OpenAI-compatible API with cloud escalation)",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={exec_start}",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "KillSignal=SIGTERM",
        f"TimeoutStartSec={spec.start_timeout_s}",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        f"WatchdogSec={spec.watchdog_s}",
        "Restart=on-failure",
        "RestartSec=5",
        "RestartPreventExitStatus=2",  # a bad config or flag: restarting will not fix it
        f"User={spec.user}",
        f"Group={spec.group}",
        f"Environment=CASCADE_HOME={spec.state_dir}",
        "Environment=PYTHONUNBUFFERED=1",
        *state,
        f"WorkingDirectory={spec.state_dir}",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ReadWritePaths={spec.state_dir}",
        f"ProtectHome={protect_home}",
        "PrivateTmp=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectControlGroups=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "LockPersonality=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


def next_steps(spec: ServiceSpec, unit_path: str, config_exists: bool) -> list[str]:
    """The commands that install and start the unit, as the operator runs them."""
    name = PurePosixPath(unit_path).name if unit_path != "-" else PurePosixPath(DEFAULT_UNIT_PATH).name
    steps = [f"sudo useradd --system --user-group --home-dir {spec.state_dir} --shell /usr/sbin/nologin {spec.user}"]
    if spec.state_directory is None:
        steps.append(f"sudo install -d -m 0750 -o {spec.user} -g {spec.group} {spec.state_dir}")
    if not config_exists:
        steps.append(f"sudo install -D -m 0640 -o root -g {spec.group or spec.user} edge.toml {spec.config}"
                     "   # the agent's config: it holds the device's secrets, so its group reads it, nobody else")
    if unit_path == "-":
        steps.append(f"sudo tee /etc/systemd/system/{name} < the-unit-printed-above")
    steps += ["sudo systemctl daemon-reload", f"sudo systemctl enable --now {name}",
              f"journalctl -u {name} -f", f"sudo systemctl reload {name}   # after editing {spec.config}"]
    return steps


def _under_home(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return parts[1:2] in (("home",), ("root",)) or parts[1:3] == ("run", "user")


def exposed_secrets(path: str | None, config) -> list[str]:
    """The secrets an edge config file holds while every user may read it (mode o+r): the keys
    to name in a warning. Empty for no file, a private file, or a file without secrets."""
    if not path:
        return []
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return []
    except OSError:
        return []
    held = {"[fleet] secret": config.fleet.secret, "[upstream] api_key": config.upstream.api_key,
            "[server] api_key": config.server.api_key, "[mqtt] password": config.mqtt.password}
    return [name for name, value in held.items() if value]
