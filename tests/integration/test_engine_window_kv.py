"""Gemma 3's sliding-window layers in their own KV group, on the real Gemma 3 270M: a generation
far longer than its window, in a window group too small to hold it without freeing, gives the
greedy tokens of the one-table engine.

The model's window (512) is set to 32 in a copy of its config, so a short generation crosses it
many times: both engines run that same model, so they must agree token for token.
"""

import json

import pytest

from cloud_tier.engine import LLMEngine, SamplingParams
from model_distribution.artifacts.model_dirs import resolve_model_dir
from tests.integration.test_engine import run_to_end

WINDOW = 32


@pytest.fixture(scope="module")
def gemma_window_32(engine_home, tmp_path_factory):
    src = resolve_model_dir("gemma3-270m")
    dst = tmp_path_factory.mktemp("gemma3-window") / src.name
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["sliding_window"] = WINDOW
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_freeing_blocks_that_left_the_window_gives_the_one_table_outputs(gemma_window_32):
    prompts = ["The history of the river port begins with", "A recipe for bread: first,"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=32, threads=1)
    reference = run_to_end(LLMEngine.from_model(str(gemma_window_32), num_kv_blocks=24, **common), prompts, params)
    # the two reach ~115 tokens (8 blocks, each past the 32-token window); 6 window blocks hold
    # them only because they are freed
    windowed = LLMEngine.from_model(str(gemma_window_32), num_kv_blocks=24, kv_window_blocks=6, **common)
    assert windowed.model.config["sliding_window"] == WINDOW and windowed.kv.window is not None
    outs = run_to_end(windowed, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs) > 6 * 16
    assert windowed.kv.window.num_free_blocks == 6 and windowed.kv.num_free_blocks == 24


def test_a_window_group_too_small_for_one_request_is_refused_at_start(gemma_window_32):
    with pytest.raises(ValueError, match="kv_window_blocks"):
        LLMEngine.from_model(str(gemma_window_32), dtype="float32", max_model_len=256, num_kv_blocks=24,
                             max_num_batched_tokens=32, kv_window_blocks=2)
