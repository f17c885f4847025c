"""The cloud tier's configuration: ``cloud.toml``, overridden by ``CASCADE_CLOUD_<SECTION>_<KEY>``."""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.config import load_config

ROLES = ("both", "prefill", "decode")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str = ""  # a worker may require a bearer key of its callers (the gateway)
    max_body_bytes: int = 4 << 20
    log_level: str = "info"

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype ``"auto"`` stands for on ``device``: bfloat16 on CUDA and on CPUs that compute in
    it natively (AVX512_BF16 or AMX), float32 on other CPUs, where bfloat16 GEMMs are emulated and
    slower than float32. Any other name is returned as it is. Reads /proc/cpuinfo, not torch, so
    the gateway can tell what its workers will run."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cpu"):
        return "bfloat16"
    return "bfloat16" if _cpu_flags() & {"avx512_bf16", "amx_bf16"} else "float32"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:  # not Linux: no flags known, the safe float32
        return set()
    return set(line.partition(":")[2].split())


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration (``LLMEngine(config)``) and the ``[engine]`` section of cloud.toml.
    Plain data: the gateway reads it without loading torch."""

    model: str = "smollm2-135m"  # catalogue name, .gguf path or HF directory
    # "auto" (resolve_dtype) is not the default: bfloat16 greedy output drifts from the float32
    # reference (the parity prompts: logits 0.25-0.84 apart, 2 of 8 diverge within 32 tokens)
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30  # budget for K/V blocks ...
    num_kv_blocks: int | None = None  # ... or an exact number of blocks
    max_model_len: int = 2048
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # token budget of one step
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    seed: int = 0
    threads: int = 0  # torch intra-op threads on CPU; 0: torch's default

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass
class WorkerConfig:
    role: str = "both"  # both: co-located prefill and decode; prefill | decode: one half of a pair
    kv_host: str = ""  # where the KV receiver listens (decode, both); "": the server's host
    kv_port: int = 0  # 0: any free port (reported in /healthz and /internal/load)
    prefill_timeout_s: float = 120.0  # a decode worker's wait for a prefill and its KV

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")


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
    # foreign workers' health, failures and load (see cloud_tier/gateway/openai_route.py, openai_proxy.py)
    metrics_interval_s: float = 1.0  # scrape of a foreign worker's /metrics and /health
    stale_after_s: float = 3.0  # load numbers older than this: the worker counts as saturated
    worker_max_waiting: int = 8  # a foreign worker with this many requests waiting is saturated
    shed_step: float = 0.1  # priority p > 0 is shed from pressure 1 - shed_step * p (floor 0.5)
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
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
    # admission control on the decode pool's KV blocks
    kv_high_watermark: float = 0.9
    max_queue: int = 64  # requests waiting for KV room; beyond it, 429
    # routing (see cloud_tier/gateway/placement.py)
    route_alpha: float = 1.0
    route_beta: float = 1.0
    prefill_ms_per_token: float = 1.0
    overload_percentile: float = 75.0
    overload_min_tokens: int = 512
    # caches
    result_cache_entries: int = 4096
    result_cache_bytes: int = 64 << 20
    result_cache_ttl_s: float = 600.0
    idempotency_ttl_s: float = 86400.0
    idempotency_lease_s: float = 600.0  # a claim not renewed for this long was left by a crashed gateway
    health_interval_s: float = 0.5
    startup_timeout_s: float = 600.0  # for a worker to give the model's tokenizer
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 << 20
    # /metrics: open unless a key is set (then "Authorization: Bearer <metrics_key>"); per tenant unless off
    metrics_key: str = ""
    metrics_tenant_labels: bool = True
    # workers found through the Kubernetes API (cloud_tier/gateway/discovery.py): on when a selector is set;
    # namespace "": the gateway pod's own; a pod's port: its container port named http, else k8s_port
    k8s_namespace: str = ""
    k8s_selector: str = ""  # label selector of worker pods; role: their cascade.dev/role label, else both
    k8s_prefill_selector: str = ""  # pods with the prefill role, whatever their label says
    k8s_decode_selector: str = ""  # ... the decode role
    k8s_port: int = 8000

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
        if min(self.connect_timeout_s, self.first_token_timeout_s, self.metrics_interval_s, self.stale_after_s,
               self.breaker_open_s) <= 0:
            raise ValueError("timeouts and intervals must be > 0")
        if self.kv_transport not in ("tcp", "shm", "auto"):
            raise ValueError(f"kv_transport must be tcp, shm or auto, got {self.kv_transport!r}")
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError("worker counts must be >= 0")
        if not (self.workers or self.prefill_workers or self.k8s_discovery) and not (
                self.both or (self.prefill and self.decode)):
            raise ValueError("start at least one prefill and one decode worker, or one 'both' worker")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError("kv_high_watermark must be in (0, 1]")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("SLOs must be positive")
        if not 0 < self.idempotency_lease_s <= self.idempotency_ttl_s:
            raise ValueError("idempotency_lease_s must be > 0 and at most idempotency_ttl_s")
        if not 0 < self.k8s_port <= 65535:
            raise ValueError(f"k8s_port must be in 1..65535, got {self.k8s_port}")
        if self.redis and not self.redis.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis must be a redis://, rediss:// or unix:// URL (or empty), not {self.redis!r}")
        parse_model_prices(self.model_prices)


def parse_model_prices(text: str) -> dict[str, tuple[float, float]]:
    """``[gateway] model_prices`` ("smollm2-135m=0.15:0.60,other=1:2": USD per million prompt and
    completion tokens, by model; "*" prices any model not named) as {model: (prompt, completion)}."""
    prices = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, _, rates = item.partition("=")
        prompt, _, completion = rates.partition(":")
        try:
            pair = (float(prompt), float(completion))
        except ValueError:
            pair = (-1.0, -1.0)
        if not name.strip() or not all(0 <= x < float("inf") for x in pair):
            raise ValueError(f"model_prices: {item!r} is not model=PROMPT:COMPLETION (USD per million tokens, "
                             "numbers >= 0)")
        prices[name.strip()] = pair
    return prices


@dataclass
class CloudConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> CloudConfig:
        return load_config(cls, "cloud", path, overrides, environ)
