"""The gateway's reading of a real vLLM /metrics scrape (data/vllm_metrics.txt: vLLM CPU 0.32.0 on
SmolLM2 with 16 KV blocks of 128 tokens, taken while 2 requests ran and 6 waited)."""

from pathlib import Path

from cloud_tier.gateway.workers.metrics_scrape import detect_kind, parse_load

SCRAPE = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


def test_a_real_vllm_scrape_is_detected_as_vllm():
    assert detect_kind(SCRAPE) == "vllm"


def test_a_real_vllm_scrape_gives_its_queue_kv_use_and_block_geometry():
    load = parse_load("vllm", SCRAPE)
    assert (load.running, load.waiting) == (2, 6)
    assert abs(load.kv_usage - 14 / 15) < 1e-9  # vLLM counts the 15 blocks it can hand out
    assert load.block_size == 128
    assert load.kv_tokens == 16 * 128  # num_gpu_blocks (the override) x block_size
