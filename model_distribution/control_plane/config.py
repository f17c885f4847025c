"""``cascade fleet serve``'s configuration: ``fleet.toml``, every key overridable by
``CASCADE_FLEET_<SECTION>_<KEY>`` and by the command's flags (cascade/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cascade.config import cascade_home, load_config


@dataclass
class ControlPlaneServerConfig:
    """``[server]``: the control plane's HTTP side."""

    host: str = "127.0.0.1"
    port: int = 8090
    admin_key: str = ""  # bearer key of the operator's endpoints ("" leaves them to loopback callers only)
    public_downloads: bool = False  # /v1/artifacts and /v1/tuf without credentials (a mirror or CDN in front)
    credential_cache_s: float = 60.0  # a verified device secret is not checked again for this long
    timestamp_refresh_s: float = 3600.0  # re-sign the TUF timestamp this often (it expires after a day)
    metrics_key: str = ""  # bearer key for /metrics ("": open, as a Prometheus scrape expects)
    rollout_tick_s: float = 0.5  # how often the rollout controller looks at the rollouts under way
    device_rate: float = 2.0  # messages a second one device may send (MQTT and HTTP), after device_burst
    device_burst: float = 120.0
    forwarded_allow_ips: str = ""  # proxies whose X-Forwarded-For names the client ("": none, the peer is the client)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.credential_cache_s < 0:
            raise ValueError("credential_cache_s must be >= 0")
        if not (self.rollout_tick_s > 0 and self.device_rate > 0 and self.device_burst >= 1):
            raise ValueError("rollout_tick_s and device_rate must be > 0, device_burst >= 1")


@dataclass
class FleetBrokerConfig:
    """``[mqtt]``: the broker the control plane uses, or the one it starts (not sync.mqtt's
    ``MQTTConfig``, a device's telemetry connection)."""

    broker: str = ""  # mqtt://host:port of a broker to use ("": start the fleet's own, see `start`)
    username: str = ""
    password: str = ""
    start: bool = True  # with no broker given: start one (Mosquitto when installed, else embedded)
    listen_host: str = "127.0.0.1"  # where the started broker listens
    listen_port: int = 1883
    prefer: str = "auto"  # auto | mosquitto | embedded
    ca_file: str = ""  # with broker = "mqtts://...": the CA its certificate is checked against ("": the system's)
    tls_port: int = 0  # the started broker also listens with TLS here (0: no TLS listener); devices use mqtts://
    tls_host: str = ""  # where that listener binds ("": listen_host)
    certfile: str = ""  # the TLS listener's certificate chain (PEM) and its key
    keyfile: str = ""

    def __post_init__(self):
        if self.prefer not in ("auto", "mosquitto", "embedded"):
            raise ValueError(f"prefer must be auto, mosquitto or embedded, not {self.prefer!r}")
        if not 0 <= self.listen_port <= 65535 or not 0 <= self.tls_port <= 65535:
            raise ValueError(f"listen_port and tls_port must be in 0..65535, got {self.listen_port}, {self.tls_port}")
        if self.tls_port and not (self.certfile and self.keyfile):
            raise ValueError("a TLS listener (tls_port) needs certfile and keyfile")
        for name in ("certfile", "keyfile", "ca_file"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"{name} {path!r} is not a file")


@dataclass
class StateConfig:
    path: str = ""  # the control plane's state ("": $CASCADE_HOME/fleet)


@dataclass
class FleetConfig:
    server: ControlPlaneServerConfig = field(default_factory=ControlPlaneServerConfig)
    state: StateConfig = field(default_factory=StateConfig)
    mqtt: FleetBrokerConfig = field(default_factory=FleetBrokerConfig)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> FleetConfig:
        return load_config(cls, "fleet", path, overrides, environ)

    @property
    def root(self) -> Path:
        return Path(self.state.path).expanduser() if self.state.path else cascade_home() / "fleet"
