"""The edge agent's configuration: ``edge.toml``, overridden by ``CASCADE_EDGE_<SECTION>_<KEY>``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cascade.calibration import CascadeConfig
from cascade.config import cascade_home, check_range, load_config
from edge_agent.hardware import ORT_PROVIDER

DAY_S = 86400.0


@dataclass
class AgentServerConfig:
    host: str = "127.0.0.1"
    port: int = 8081
    api_key: str = ""  # when set, the local API needs "Authorization: Bearer <api_key>"
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    log_level: str = "info"
    log_format: str = "text"  # text | json (one object per line); under systemd, text lines carry no timestamp
    drain_timeout_s: float = 30.0  # on SIGTERM, in-flight requests (streams too) get this long to finish

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        check_range(self, {"drain_timeout_s": (0, 3600)})


BACKENDS = ("llama.cpp", "onnx")
PROVIDERS = tuple(ORT_PROVIDER)  # onnxruntime-genai's names for the execution providers we can run on


@dataclass
class ModelConfig:
    name: str = "qwen2.5-coder-0.5b"  # a catalogue name, or a path to a .gguf file (backend onnx: an export directory)
    backend: str = "llama.cpp"  # llama.cpp | onnx (ONNX Runtime GenAI)
    providers: list[str] = field(default_factory=list)  # onnx: execution providers in order; []: what loads here
    n_ctx: int = 2048
    n_batch: int = 256
    flash_attn: bool = False  # llama.cpp: flash attention (its "auto" halved CPU decode at long contexts here)
    threads: int = 0  # decode threads per slot; 0: cores - 1 on machines of up to 4 cores, else all
    threads_batch: int = 0  # prompt threads per slot; 0: one per core
    parallel: int = 1  # slots: requests generated at the same time, each with its own context
    search_paths: list[Path] = field(default_factory=list)  # more folders with .gguf files

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r} (available: {', '.join(BACKENDS)})")
        self.providers = [p.strip().lower() for p in self.providers if p.strip()]
        unknown = [p for p in self.providers if p not in PROVIDERS]
        if unknown:
            raise ValueError(f"unknown provider(s) {', '.join(map(repr, unknown))} (known: {', '.join(PROVIDERS)})")
        if self.parallel < 1:
            raise ValueError("parallel must be >= 1")
        if self.n_ctx < 16:
            raise ValueError("n_ctx must be >= 16")
        check_range(self, {"n_ctx": (16, 1 << 24), "n_batch": (1, 1 << 24), "threads": (0, 4096),
                           "threads_batch": (0, 4096), "parallel": (1, 4096)})


@dataclass
class QueueConfig:
    max_waiting: int = 16  # requests waiting for a slot; beyond it, 429 + Retry-After
    default_max_tokens: int = 512  # when a chat request names no max_tokens

    def __post_init__(self):
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        check_range(self, {"max_waiting": (0, 1 << 20), "default_max_tokens": (1, 1 << 24)})


@dataclass
class UpstreamConfig:
    url: str = ""  # the cloud tier (any OpenAI-compatible base URL); empty: edge only
    api_key: str = ""
    model: str = ""  # the model to ask for upstream; "": the cloud's first model (GET /v1/models)
    timeout_s: float = 60.0
    max_backoff_s: float = 60.0  # the longest the circuit stays open after failures (a 429's Retry-After aside)
    refused_backoff_s: float = 30.0  # after a 401/403 (key wrong or revoked) ask again after this, doubling to 600 s
    max_retry_after_s: float = 3600.0  # a cloud's Retry-After is honoured up to this

    def __post_init__(self):
        check_range(self, {"timeout_s": (0.1, DAY_S), "max_backoff_s": (0.01, DAY_S),
                           "refused_backoff_s": (0.01, DAY_S), "max_retry_after_s": (0, 7 * DAY_S)})


@dataclass
class SyncConfig:
    """The offline queue (sync/queue.py) and its delivery loop (sync/delivery.py)."""

    path: str = ""  # the queue's SQLite file; "": $CASCADE_HOME/edge/queue.db
    max_items: int = 10_000  # pending items (queued + sending); beyond: telemetry dropped, requests refused
    max_bytes: int = 64 << 20  # pending payload bytes, the same policy
    request_ttl_s: float = 7 * 24 * 3600.0  # a queued request not delivered by then expires
    telemetry_ttl_s: float = 24 * 3600.0
    keep_s: float = 24 * 3600.0  # finished items (and their results) are kept this long
    synchronous: str = "FULL"  # SQLite synchronous: FULL survives power loss, NORMAL only a crash
    batch_size: int = 16
    base_backoff_s: float = 0.5
    max_backoff_s: float = 60.0
    poll_s: float = 5.0
    max_attempts: int = 8  # tries a request may fail for a reason of its own (a 500, a 404), then failed
    callback_hosts: list[str] = field(default_factory=lambda: ["127.0.0.1", "localhost", "::1"])  # "*": any

    def __post_init__(self):
        if self.synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {self.synchronous!r}")
        self.synchronous = self.synchronous.upper()
        if self.max_items < 1 or self.max_bytes < 1 or self.batch_size < 1:
            raise ValueError("max_items, max_bytes and batch_size must be >= 1")
        check_range(self, {"max_items": (1, 1 << 40), "max_bytes": (1, 1 << 50), "request_ttl_s": (1, 366 * DAY_S),
                           "telemetry_ttl_s": (1, 366 * DAY_S), "keep_s": (0, 366 * DAY_S),
                           "batch_size": (1, 10_000), "base_backoff_s": (0, DAY_S), "max_backoff_s": (0, DAY_S),
                           "poll_s": (0.01, 3600), "max_attempts": (1, 1000)})


@dataclass
class MQTTSection:
    """Telemetry over MQTT (sync/mqtt.py). Off unless ``host`` is set."""

    host: str = ""
    port: int = 1883
    fleet: str = "default"
    client_id: str = ""  # "": cascade-<fleet>-<device>
    username: str = ""
    password: str = ""
    tls: bool = False  # mqtts: the broker's certificate checked against ca_file ("": the system's CAs)
    ca_file: str = ""
    keepalive_s: int = 30
    telemetry_interval_s: float = 30.0  # how often a telemetry record is spooled

    def __post_init__(self):
        if self.telemetry_interval_s <= 0:
            raise ValueError("telemetry_interval_s must be > 0")
        check_range(self, {"port": (1, 65535), "keepalive_s": (0, 65535), "telemetry_interval_s": (0.01, DAY_S)})


@dataclass
class FleetSection:
    """Following the fleet's desired state (model_distribution): with ``broker`` set the agent
    installs and switches to the model version the control plane assigns it."""

    broker: str = ""  # mqtt://host:1883 or mqtts://host:8883 ("": not in a fleet)
    broker_ca: str = ""  # with mqtts://: the CA file the broker's certificate is checked against ("": the system's)
    fleet: str = "default"
    device_id: str = ""  # as enrolled (cascade fleet devices add); also the MQTT user
    secret: str = ""  # the credentials `devices add` printed
    control_plane: str = ""  # http://host:8090 (or a mirror of /v1/tuf and /v1/artifacts)
    artifact_url: str = ""  # a mirror (CDN, static store) of /v1/artifacts ("": the control plane's)
    metadata_url: str = ""  # a mirror of /v1/tuf ("": the control plane's); mirrors get no secret
    trust_root: str = ""  # the provisioned 1.root.json
    desired_key: str = ""  # the control plane's desired-state public key (hex file, `cascade fleet keys init`)
    state_dir: str = ""  # staging and installed versions ("": $CASCADE_HOME/edge/fleet)
    disk_budget_bytes: int = 8 << 30  # for installed versions (older ones are dropped to fit a new one)
    memory_budget_bytes: int = 0  # a version larger than this is refused (0: the memory the OS has available)

    def __post_init__(self):
        check_range(self, {"disk_budget_bytes": (0, 1 << 60), "memory_budget_bytes": (0, 1 << 60)})


@dataclass
class EdgeConfig:
    server: AgentServerConfig = field(default_factory=AgentServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    cascade: CascadeConfig = field(default_factory=CascadeConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    mqtt: MQTTSection = field(default_factory=MQTTSection)
    fleet: FleetSection = field(default_factory=FleetSection)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> EdgeConfig:
        return load_config(cls, "edge", path, overrides, environ)


def default_config_path() -> Path | None:
    """The file the agent and its commands read when none is named: ``$CASCADE_HOME/edge.toml``
    (what `cascade calibrate` writes), if it exists."""
    path = cascade_home() / "edge.toml"
    return path if path.is_file() else None
