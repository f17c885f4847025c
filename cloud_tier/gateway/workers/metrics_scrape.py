"""What a foreign worker's own ``/metrics`` says about its load, and what kind of server it is.

vLLM names its series ``vllm:*`` and SGLang ``sglang:*`` (both Prometheus text); the gateway reads
the waiting and running requests, the KV cache's use (a fraction, 0..1, in both) and how many
tokens the KV cache holds (vLLM: ``vllm:cache_config_info``'s ``num_gpu_blocks`` x ``block_size``
labels; SGLang: ``sglang:max_total_num_tokens``). Series carry a model label; a server with
several models is summed. Every number read goes through ``workers.load.count``: NaN, an infinity,
a negative or text that is no number refuses the scrape (``LoadRefused``); one past what any worker
has is clamped."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from cloud_tier.gateway.workers.load import (
    MAX_BLOCK_SIZE,
    MAX_KV_BLOCKS,
    MAX_KV_TOKENS,
    MAX_REQUESTS,
    LoadRefused,
    count,
    whole,
)

KINDS = ("cascade", "vllm", "sglang", "openai")


@dataclass(frozen=True)
class ForeignLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # 0..1 of the KV cache in use
    kv_tokens: int = 0  # tokens the KV cache holds when full (0: unknown)
    block_size: int = 16


def detect_kind(metrics_text: str) -> str:
    """``vllm`` or ``sglang`` from the names a worker's /metrics exposes, else ``openai``."""
    if "\nvllm:" in metrics_text or metrics_text.startswith("vllm:") or "# TYPE vllm:" in metrics_text:
        return "vllm"
    if "\nsglang:" in metrics_text or metrics_text.startswith("sglang:") or "# TYPE sglang:" in metrics_text:
        return "sglang"
    return "openai"


_NAMES = {
    "vllm": {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
             "kv_usage": "vllm:kv_cache_usage_perc"},
    "sglang": {"waiting": "sglang:num_queue_reqs", "running": "sglang:num_running_reqs",
               "kv_usage": "sglang:token_usage"},
}


def parse_load(kind: str, metrics_text: str) -> ForeignLoad:
    """The load a ``vllm`` or ``sglang`` worker reports (LoadRefused, a ValueError, on text that is
    not Prometheus' format or a number that is not a finite one >= 0). Other kinds report nothing:
    all zeros, the gateway's own counts are all it has."""
    names = _NAMES.get(kind)
    if names is None:
        return ForeignLoad()
    wanted = {v: k for k, v in names.items()}
    # a vLLM scrape is ~600 lines (50 KB): parse only the few series read here (~60x less work); lines
    # end at "\n" only (Prometheus' format), never at the other breaks str.splitlines knows
    keep = (*wanted, "vllm:cache_config_info", "sglang:max_total_num_tokens")
    metrics_text = "\n".join(line for line in metrics_text.split("\n") if line.startswith(keep)) + "\n"
    sums = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    kv_tokens, block_size = 0, 16
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise LoadRefused("not_prometheus", f"not Prometheus' text format: {str(e)[:200]}") from None
    for family in families:
        for s in family.samples:
            field = wanted.get(s.name)
            if field == "kv_usage":  # one cache per server: several models share it; a share or a percentage
                sums[field] = max(sums[field], count(s.value, s.name, 100.0))
            elif field is not None:
                sums[field] = min(sums[field] + count(s.value, s.name, MAX_REQUESTS), MAX_REQUESTS)
            elif s.name == "vllm:cache_config_info":
                blocks = (_label(s.labels, "num_gpu_blocks", MAX_KV_BLOCKS)
                          or _label(s.labels, "num_cpu_blocks", MAX_KV_BLOCKS))
                block_size = _label(s.labels, "block_size", MAX_BLOCK_SIZE) or block_size
                kv_tokens = max(kv_tokens, min(blocks * block_size, MAX_KV_TOKENS))
            elif s.name == "sglang:max_total_num_tokens":
                kv_tokens, block_size = max(kv_tokens, whole(s.value, s.name, MAX_KV_TOKENS)), 1
    usage = sums["kv_usage"]
    return ForeignLoad(waiting=sums["waiting"], running=sums["running"],
                       kv_usage=min(usage / 100.0 if usage > 1.0 else usage, 1.0),
                       kv_tokens=kv_tokens, block_size=block_size)


def _label(labels: dict, name: str, most: int) -> int:
    """A label's number (0 when absent or "None"; LoadRefused when it is not a number >= 0)."""
    text = labels.get(name)
    return 0 if text in (None, "", "None") else whole(text, f"{name} label", most)
