"""The engine's configuration: ``EngineConfig`` (the ``[engine]`` section of cloud.toml, the
``CASCADE_CLOUD_ENGINE_*`` variables and the worker's flags) and the ``SchedulerConfig`` it
carries, built once from its keys. Plain data, beside the engine but outside its package, so the
gateway reads it (what its workers run) without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cloud_tier.config_values import named_values

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
WEIGHT_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: the decoder's linear layers weight-only INT8
PREEMPTION_MODES = ("auto", "swap", "recompute")
SPECULATIVE_METHODS = ("", "ngram")  # "": the engine proposes nothing itself (a device's draft is still verified)


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


def has_amx() -> bool:
    """Whether this CPU has AMX's bfloat16 tiles (where oneDNN multiplies in 16-row tiles)."""
    return "amx_bf16" in _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:  # not Linux: no flags known, the safe float32
        return set()
    return set(line.partition(":")[2].split())


def parse_reservations(text: str) -> dict[str, float]:
    """``[engine] reservations`` ("gold=0.3,silver=0.1": the share of the KV blocks and of the running
    slots kept for each tenant) as {tenant: share}; the shares must add up to less than 1."""
    shares: dict[str, float] = {}
    for item, name, values in named_values(text):
        if not name or len(values) != 1 or not 0 < values[0] < 1:
            raise ValueError(f"reservations: {item!r} is not tenant=SHARE with 0 < SHARE < 1")
        shares[name] = values[0]
    if sum(shares.values()) >= 1:
        raise ValueError(f"reservations: the shares add up to {sum(shares.values()):g}; they must stay under 1")
    return shares



@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # requests in one batch
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk; 0: the budget
    # service levels: targets for requests that name none (None: no target), and what to do about them
    default_ttft_s: float | None = None
    default_tpot_s: float | None = None
    slo_reject: bool = True  # refuse what would miss its TTFT target (only requests that have one)
    untargeted_slack_s: float = 60.0  # a request without a TTFT target is due this long after arrival
    # an admission promises the first token within (1 - this) of the TTFT target: the rest is for the
    # answer's way to the client (the server's own work on the same cores) and the estimate's error
    slo_headroom: float = 0.25
    short_prompt_tokens: int = 256  # a prompt (left to compute) this short is in the short lane ...
    short_lane_share: float = 0.25  # ... which keeps this share of a step's prefill tokens while one waits
    min_prefill_chunk: int = 32  # the least prefill a step takes under a TPOT cap, so prompts progress
    reservations: str = ""  # "tenant=share,...": KV blocks and running slots kept for each tenant
    # what a TPOT target may ask (scheduling.tenants.TpotPolicy): never a batch under this many, nor a step shorter than
    # theirs or than min_tpot_s; a tighter target is served best-effort at that floor
    tpot_min_batch: int = 8
    min_tpot_s: float = 0.0

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens >= 1 and max_model_len >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill the token budget must cover max_model_len")
        for name in ("default_ttft_s", "default_tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 (or None: no target), got {v!r}")
        if not 0 <= self.short_lane_share < 1 or self.min_prefill_chunk < 1 or self.short_prompt_tokens < 1:
            raise ValueError("short_lane_share must be in [0, 1), min_prefill_chunk and short_prompt_tokens >= 1")
        if not 0 <= self.slo_headroom < 1:
            raise ValueError(f"slo_headroom must be in [0, 1), got {self.slo_headroom!r}")
        parse_reservations(self.reservations)
        if self.tpot_min_batch < 1 or not 0 <= self.min_tpot_s < math.inf:
            raise ValueError(f"tpot_min_batch must be >= 1 and min_tpot_s a number >= 0, got "
                             f"{self.tpot_min_batch!r}, {self.min_tpot_s!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration (``LLMEngine(config)``) and the ``[engine]`` section of cloud.toml.
    Its keys stay flat (the TOML keys, variables and flags users know); the scheduler's part of
    them is ``scheduler``, a ``SchedulerConfig`` built once here and checked by it."""

    model: str = "qwen2.5-coder-1.5b"  # catalogue name, .gguf path or HF directory (the cloud half of the pair)
    # "auto" (resolve_dtype) is not the default: bfloat16 greedy output drifts from the float32
    # reference (the parity prompts: logits 0.25-0.84 apart, 2 of 8 diverge within 32 tokens)
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # auto: K/V in ``dtype``; int8: quantized, ~2x (bf16) / ~4x (fp32) the blocks
    # auto: weights in ``dtype``; int8: the decoder's linear layers per-channel INT8, activations in ``dtype``
    # (cloud_tier/engine/models/quantize.py): half (bf16) or a quarter (fp32) of their bytes read per step
    weight_dtype: str = "auto"
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
    # service levels (cloud_tier/engine/scheduling/): targets of requests that name none (0: none),
    # refusing early what would miss its TTFT target, the short-prompt lane, tenants' reservations
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    slo_reject: bool = True
    # admission promises a first token within (1 - this) of its TTFT target: the rest is for the
    # answer's way to the client, which shares the cores (measured on 2 cores, a burst of 160 from the
    # openai client in threads: the first token reached the client 0.35-0.6 s after the engine had it)
    slo_headroom: float = 0.25
    short_prompt_tokens: int = 256
    short_lane_share: float = 0.25
    reservations: str = ""  # "tenant=share,...": KV blocks and running slots kept free for each tenant
    # what a request's TPOT target may ask of an engine that serves everyone: a batch of at least this many
    # decodes, and a step no shorter than theirs nor than min_tpot_slo_s (0: the step's only); a tighter
    # target is served best-effort at that floor, and a tenant's targets bound only its own requests' slots
    tpot_min_batch: int = 8
    min_tpot_slo_s: float = 0.0
    # a preempted request's KV: swapped to host memory or recomputed, "auto": whichever costs less
    preemption_mode: str = "auto"
    swap_space_bytes: int = 1 << 30  # host memory for swapped-out KV
    # the prefix cache's second tier: evicted blocks kept in a memory-mapped file (0: off) ...
    kv_tier_bytes: int = 0
    kv_tier_path: str = ""  # ... in this directory ("": $CASCADE_HOME/engine)
    # Gemma 3: its sliding-window layers get their own pool of this many blocks, freed as they leave
    # the window (0: one block table for all layers). Then no prefix caching, tier, swap or KV handoff.
    kv_window_blocks: int = 0
    # speculative decoding of its own: "ngram" proposes up to num_speculative_tokens per decode by prompt
    # lookup (the last ngram_max..ngram_min tokens matched in the request's own tokens), verified in the step
    speculative: str = ""
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    scheduler: SchedulerConfig = field(init=False, repr=False, compare=False)  # built from the keys above

    def __post_init__(self):
        for name in ("ttft_slo_s", "tpot_slo_s"):  # 0 in cloud.toml (which has no None) means no target
            if getattr(self, name) == 0:
                object.__setattr__(self, name, None)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if any(v is not None and not v > 0 for v in (self.ttft_slo_s, self.tpot_slo_s)):
            raise ValueError("ttft_slo_s and tpot_slo_s must be > 0 (0: no target)")
        if self.tpot_min_batch < 1 or not 0 <= self.min_tpot_slo_s < math.inf:
            raise ValueError("tpot_min_batch must be >= 1 and min_tpot_slo_s a number of seconds >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.swap_space_bytes < 0 or self.kv_tier_bytes < 0 or self.kv_window_blocks < 0:
            raise ValueError("swap_space_bytes, kv_tier_bytes and kv_window_blocks must be >= 0")
        if self.kv_window_blocks and (self.kv_tier_bytes or self.preemption_mode == "swap"):
            raise ValueError("kv_window_blocks works with neither kv_tier_bytes nor preemption_mode 'swap'")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be 'ngram' or '' (off), got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 64 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("num_speculative_tokens must be in [1, 64] and 1 <= ngram_min <= ngram_max")
        object.__setattr__(self, "scheduler", self._scheduler_config())

    def _scheduler_config(self) -> SchedulerConfig:
        """The scheduler's keys under its own names (``[engine] ttft_slo_s`` is its ``default_ttft_s``)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold, default_ttft_s=self.ttft_slo_s,
            default_tpot_s=self.tpot_slo_s, slo_reject=self.slo_reject, slo_headroom=self.slo_headroom,
            short_prompt_tokens=self.short_prompt_tokens, short_lane_share=self.short_lane_share,
            reservations=self.reservations, tpot_min_batch=self.tpot_min_batch, min_tpot_s=self.min_tpot_slo_s)
