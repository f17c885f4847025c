"""Gemma 3 270M: shipped in chunk packages, assembled on first use, served as a base model."""

import openai

from model_distribution.artifacts.catalog import Catalog
from tests import loopback
from tests.conftest import Agent


def test_base_model_is_assembled_then_served_with_a_transcript(tmp_path):
    assert not Catalog(tmp_path).get("gemma3-270m").ready
    a = Agent(tmp_path, "--model", "gemma3-270m", "--n-ctx", "512").wait_healthy(timeout_s=180)
    try:
        info = Catalog(tmp_path).get("gemma3-270m")
        assert info.ready and info.path.parent == tmp_path / "models"
        card = loopback.get(f"{a.url}/v1/models").json()["data"][0]
        assert card["id"] == "gemma3-270m"
        assert card["meta"]["chat_template"] is False and card["meta"]["quantization"] == "Q4_K_M"
        client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="gemma3-270m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=40, temperature=0)
        text = reply.choices[0].message.content
        assert text.strip() and "User:" not in text  # the transcript stops at the next turn
        assert reply.choices[0].finish_reason == "stop"
        done = client.completions.create(model="gemma3-270m", prompt="The capital of France is",
                                         max_tokens=5, temperature=0)
        assert done.choices[0].text
    finally:
        a.stop()
