"""The cloud tier's configuration: ``cloud.toml``, overridden by ``CASCADE_CLOUD_<SECTION>_<KEY>``."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from cascade.config import load_config
from cascade.protocol import PRIORITY_CLASSES
from cloud_tier.config_values import named_values
from cloud_tier.engine_config import EngineConfig

ROLES = ("both", "prefill", "decode")


@dataclass
class CloudServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str = ""  # a worker may require a bearer key of its callers (the gateway)
    max_body_bytes: int = 4 << 20
    log_level: str = "info"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


@dataclass
class WorkerConfig:
    role: str = "both"  # both: co-located prefill and decode; prefill | decode: one half of a pair
    kv_host: str = ""  # where the KV receiver listens (decode, both); "": the server's host
    kv_port: int = 0  # 0: any free port (reported in /healthz and /internal/load)
    prefill_timeout_s: float = 120.0  # a decode worker's wait for a prefill and its KV

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        check_seconds(self, ("prefill_timeout_s",))


# the gateway's timers: each a finite number of seconds > 0 (a NaN or an infinity would hang or spin a wait)
GATEWAY_TIMERS = ("connect_timeout_s", "first_token_timeout_s", "metrics_interval_s", "stale_after_s",
                  "breaker_open_s", "health_interval_s", "startup_timeout_s", "request_timeout_s",
                  "idempotency_ttl_s", "idempotency_lease_s", "ttft_slo_s", "tpot_slo_s")


def check_seconds(section, names: tuple[str, ...], zero: bool = False) -> None:
    """ValueError naming the first of ``names`` that is not a finite number of seconds > 0 (>= 0 with ``zero``)."""
    for name in names:
        value = getattr(section, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 <= value < math.inf if zero else 0 < value < math.inf):
            raise ValueError(f"{name} must be a finite number of seconds {'>=' if zero else '>'} 0, got {value!r}")


@dataclass
class GatewayConfig:
    """``cascade cloud serve``: the gateway, and the workers it starts (or finds at ``workers``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: str = ""  # comma-separated worker URLs started elsewhere; "": start our own
    # what they are: auto (detected: /internal/load -> cascade, else /metrics names vllm: / sglang:, else openai)
    worker_type: str = "auto"
    prefill_workers: str = ""  # vLLM prefill/decode pairs: comma-separated URLs by role ...
    decode_workers: str = ""
    kv_connector: str = ""  # ... and how their KV moves: "nixl" (vLLM's NixlConnector two-step flow)
    pd_min_prompt_chars: int = 1024  # shorter prompts skip the prefill step
    pd_skip_hit_share: float = 0.8  # ... as do prompts the decode worker holds this share of
    # foreign workers' health, failures and load (see cloud_tier/gateway/foreign/routing.py, proxy.py)
    metrics_interval_s: float = 1.0  # scrape of a foreign worker's /metrics and /health
    stale_after_s: float = 3.0  # load numbers older than this: the worker counts as saturated
    # the most health/load GETs a second to all workers together (polls are spread further apart beyond
    # it, so polling costs a bounded share of a core whatever the number of workers: docs/scale.md)
    max_polls_per_s: float = 20.0
    worker_max_waiting: int = 8  # a foreign worker with this many requests waiting is saturated
    shed_step: float = 0.1  # priority p > 0 is shed from pressure 1 - shed_step * p (floor 0.5)
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
    # a worker's answer, bounded while read: one SSE event or NDJSON line, and a whole non-streamed body;
    # past either the answer is a 502 (or, once started, the stream ends with an error event and [DONE])
    worker_max_event_bytes: int = 1 << 20
    worker_max_body_bytes: int = 32 << 20
    retries: int = 2  # further attempts on another worker, before the first byte only
    retry_backoff_s: float = 0.1
    breaker_threshold: int = 3  # failures in a row that open a worker's circuit breaker ...
    breaker_open_s: float = 5.0  # ... for this long (doubling while the trial fails)
    route_prefix_weight: float = 2.0  # foreign routing: prefix share, queue and KV use weights
    route_queue_weight: float = 1.0
    route_kv_weight: float = 1.0
    default_max_tokens: int = 512  # a request's predicted output (quota) when it names no max_tokens
    prefill: int = 1  # workers to start, by role (when ``workers`` is empty)
    decode: int = 1
    both: int = 0
    worker_threads: int = 0  # torch threads per started worker; 0: the cores shared out
    kv_transport: str = "auto"  # tcp | shm | auto (shm when a pair is on this host)
    # keys, budgets and idempotency: a path (SQLite; "": $CASCADE_HOME/cloud/gateway.db) or a postgresql:// DSN
    # shared by several gateway replicas; redis: a redis:// URL for quotas, the result cache and spend
    # counters shared by the replicas ("": in this process, spend in the db)
    db: str = ""
    redis: str = ""
    model_prices: str = ""  # USD per million prompt:completion tokens: "model=0.15:0.60,other=1:2" ("*": any)
    # service-level objectives: admission rejects early what would miss the TTFT one
    ttft_slo_s: float = 10.0
    tpot_slo_s: float = 0.25
    # the tightest ttft_slo_s / tpot_slo_s a request may ask (400 below, naming the parameter); a tenant's own
    # floors (`cascade cloud keys limits`) replace these; our workers serve a TPOT target no tighter than
    # [engine] min_tpot_slo_s and tpot_min_batch allow whatever a gateway lets through
    min_ttft_slo_s: float = 0.1
    min_tpot_slo_s: float = 0.02
    # the TTFT:TPOT targets (seconds) our workers' schedulers get, by priority class, for requests that
    # name none ("interactive=2:0.2,escalation=5:0.5"; a class not named: no target, as ""): the engine then
    # refuses early (429, reason slo) what would miss its TTFT target and keeps decodes within the TPOT one
    class_slos: str = ""
    # admission control on the decode pool's KV blocks
    kv_high_watermark: float = 0.9
    max_queue: int = 64  # requests waiting for KV room; beyond it, 429
    # fair shares of that KV between tenants (cloud_tier/gateway/tenants/tenant_share.py): the room a tenant
    # active in the last tenant_kv_window_s wanted (up to an equal share) is kept from the others; off: first
    # come, first served
    tenant_kv_fair: bool = True
    tenant_kv_window_s: float = 10.0
    # routing (see cloud_tier/gateway/workers/placement.py)
    route_alpha: float = 1.0
    route_beta: float = 1.0
    prefill_ms_per_token: float = 1.0
    overload_percentile: float = 75.0
    overload_min_tokens: int = 512
    # caches
    result_cache_entries: int = 4096
    result_cache_bytes: int = 64 << 20
    result_cache_ttl_s: float = 600.0
    # with redis: each tenant's entries (count, bytes), its oldest evicted past either, so no tenant evicts another's
    result_cache_tenant_entries: int = 1024
    result_cache_tenant_bytes: int = 16 << 20
    idempotency_ttl_s: float = 86400.0
    idempotency_lease_s: float = 600.0  # a claim not renewed for this long was left by a crashed gateway
    health_interval_s: float = 0.5
    startup_timeout_s: float = 600.0  # for a worker to give the model's tokenizer
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 << 20
    # /metrics: open unless a key is set (then "Authorization: Bearer <metrics_key>"); per tenant unless off
    metrics_key: str = ""
    metrics_tenant_labels: bool = True
    # workers found through the Kubernetes API (cloud_tier/gateway/workers/discovery.py): on when a selector is set;
    # namespace "": the gateway pod's own; a pod's port: its container port named http, else k8s_port
    k8s_namespace: str = ""
    k8s_selector: str = ""  # label selector of worker pods; role: their cascade.dev/role label, else both
    k8s_prefill_selector: str = ""  # pods with the prefill role, whatever their label says
    k8s_decode_selector: str = ""  # ... the decode role
    k8s_port: int = 8000
    # a request's priority class as vLLM's integer priority (interactive 0, escalation 1, batch 2), for vLLM
    # workers started with --scheduling-policy priority (others reject the field)
    foreign_priority: bool = False
    # the Batch API (cloud_tier/gateway/batch/): its files and batches in SQLite ("": batches.db beside
    # the key store's file, or under $CASCADE_HOME/cloud with a PostgreSQL key store)
    batch_db: str = ""
    batch_max_file_bytes: int = 100 << 20  # an uploaded file over this is a 400
    batch_max_lines: int = 50_000  # a batch over this many requests is a 400
    batch_concurrency: int = 4  # lines in flight at once, per gateway
    batch_kv_share: float = 0.5  # new lines start only while the decode pool's KV use is under this share ...
    batch_online_busy: int = 0  # ... and while fewer online requests are in flight (0: no such limit; CPU hosts)
    # a line refused for a reason that passes (429: a quota, a budget, its SLO; 503) runs again after a back-off
    # of its tenant's (doubling from batch_backoff_s up to batch_backoff_max_s), at most batch_max_refusals
    # times: then it ends in the error file with that refusal
    batch_max_refusals: int = 10
    batch_backoff_s: float = 1.0
    batch_backoff_max_s: float = 60.0
    # stored files (uploads and batch outputs), per tenant: a cap on their bytes and their number (an upload
    # past either is refused), and how long one is kept (0: until deleted; an upload's expires_after wins);
    # a batch's stored lines count against the bytes until its files are written (a batch past it is a 403)
    batch_tenant_max_bytes: int = 1 << 30
    batch_tenant_max_files: int = 1000
    batch_file_ttl_s: int = 30 * 86400
    batch_tenant_max_active: int = 16  # a tenant's batches not yet ended; one more is a 429

    @property
    def k8s_discovery(self) -> bool:
        return bool(self.k8s_selector or self.k8s_prefill_selector or self.k8s_decode_selector)

    def __post_init__(self):
        if self.worker_type not in ("auto", "cascade", "vllm", "sglang", "openai"):
            raise ValueError(f"worker_type must be auto, cascade, vllm, sglang or openai, got {self.worker_type!r}")
        if self.kv_connector not in ("", "nixl"):
            raise ValueError(f"kv_connector must be nixl (or empty), got {self.kv_connector!r}")
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError("prefill and decode worker URLs go together: give both")
        if self.worker_max_waiting < 1 or self.retries < 0 or self.breaker_threshold < 1:
            raise ValueError("worker_max_waiting and breaker_threshold must be >= 1, retries >= 0")
        check_seconds(self, GATEWAY_TIMERS)
        check_seconds(self, ("retry_backoff_s", "result_cache_ttl_s"), zero=True)
        if not 1024 <= self.worker_max_event_bytes <= self.worker_max_body_bytes:
            raise ValueError("worker_max_event_bytes must be >= 1024 and <= worker_max_body_bytes")
        if self.kv_transport not in ("tcp", "shm", "auto"):
            raise ValueError(f"kv_transport must be tcp, shm or auto, got {self.kv_transport!r}")
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError("worker counts must be >= 0")
        if not (self.workers or self.prefill_workers or self.k8s_discovery) and not (
                self.both or (self.prefill and self.decode)):
            raise ValueError("start at least one prefill and one decode worker, or one 'both' worker")
        if not 0 <= self.tenant_kv_window_s < math.inf:
            raise ValueError(f"tenant_kv_window_s must be a number of seconds >= 0, got {self.tenant_kv_window_s}")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError("kv_high_watermark must be in (0, 1]")
        if not 0.1 <= self.max_polls_per_s <= 10000:
            raise ValueError(f"max_polls_per_s must be in [0.1, 10000], got {self.max_polls_per_s}")
        if not (0 <= self.min_ttft_slo_s < math.inf and 0 <= self.min_tpot_slo_s < math.inf):
            raise ValueError("min_ttft_slo_s and min_tpot_slo_s must be numbers of seconds >= 0 (0: no floor)")
        if not 0 < self.idempotency_lease_s <= self.idempotency_ttl_s:
            raise ValueError("idempotency_lease_s must be > 0 and at most idempotency_ttl_s")
        if not 0 < self.k8s_port <= 65535:
            raise ValueError(f"k8s_port must be in 1..65535, got {self.k8s_port}")
        if self.redis and not self.redis.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis must be a redis://, rediss:// or unix:// URL (or empty), not {self.redis!r}")
        if self.batch_max_file_bytes < 1 or self.batch_max_lines < 1 or self.batch_concurrency < 1:
            raise ValueError("batch_max_file_bytes, batch_max_lines and batch_concurrency must be >= 1")
        if self.result_cache_tenant_entries < 1 or self.result_cache_tenant_bytes < 1:
            raise ValueError("result_cache_tenant_entries and result_cache_tenant_bytes must be >= 1")
        if self.batch_online_busy < 0:
            raise ValueError("batch_online_busy must be >= 0 (0: no limit)")
        if not 0 < self.batch_kv_share <= 1:
            raise ValueError("batch_kv_share must be in (0, 1]")
        if min(self.batch_max_refusals, self.batch_tenant_max_bytes, self.batch_tenant_max_files,
               self.batch_tenant_max_active) < 1:
            raise ValueError("batch_max_refusals, batch_tenant_max_bytes, batch_tenant_max_files and "
                             "batch_tenant_max_active must be >= 1")
        if not 0 < self.batch_backoff_s <= self.batch_backoff_max_s <= 86400:
            raise ValueError("batch_backoff_s must be > 0 and at most batch_backoff_max_s (at most 86400)")
        if self.batch_file_ttl_s < 0:
            raise ValueError("batch_file_ttl_s must be >= 0 (0: files are kept until deleted)")
        parse_model_prices(self.model_prices)
        for klass, (ttft, tpot) in parse_class_slos(self.class_slos).items():
            if ttft < self.min_ttft_slo_s or tpot < self.min_tpot_slo_s:
                raise ValueError(f"class_slos: {klass}'s targets {ttft:g}:{tpot:g} are under the floors min_ttft_slo_s "
                                 f"{self.min_ttft_slo_s:g} / min_tpot_slo_s {self.min_tpot_slo_s:g}")


def parse_class_slos(text: str) -> dict[str, tuple[float, float]]:
    """``[gateway] class_slos`` ("interactive=2:0.2,escalation=5:0.5": TTFT and TPOT targets in
    seconds by priority class) as {class: (ttft, tpot)}."""
    targets = {}
    for item, name, values in named_values(text):
        if name not in PRIORITY_CLASSES or len(values) != 2 or not all(0 < v < math.inf for v in values):
            raise ValueError(f"class_slos: {item!r} is not CLASS=TTFT:TPOT (a class of {', '.join(PRIORITY_CLASSES)}; "
                             "seconds > 0)")
        targets[name] = (values[0], values[1])
    return targets


def parse_model_prices(text: str) -> dict[str, tuple[float, float]]:
    """``[gateway] model_prices`` ("smollm2-135m=0.15:0.60,other=1:2": USD per million prompt and
    completion tokens, by model; "*" prices any model not named) as {model: (prompt, completion)}."""
    prices = {}
    for item, name, values in named_values(text):
        if not name or len(values) != 2 or not all(0 <= x < math.inf for x in values):
            raise ValueError(f"model_prices: {item!r} is not model=PROMPT:COMPLETION (USD per million tokens, "
                             "numbers >= 0)")
        prices[name] = (values[0], values[1])
    return prices


@dataclass
class CloudConfig:
    server: CloudServerConfig = field(default_factory=CloudServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> CloudConfig:
        return load_config(cls, "cloud", path, overrides, environ)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every key of every section, as set (for a child process: ``from_dict`` there)."""
        return {section.name: {f.name: getattr(getattr(self, section.name), f.name)
                               for f in dataclasses.fields(getattr(self, section.name)) if f.init}
                for section in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> CloudConfig:
        """The config ``to_dict`` gave, each section checked again as it is built."""
        sections = typing.get_type_hints(cls)
        return cls(**{f.name: sections[f.name](**data[f.name]) for f in dataclasses.fields(cls)})
