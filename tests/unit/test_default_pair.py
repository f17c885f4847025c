"""The default cascade is the Qwen tier pair: the agent's model and the cloud engine's, with nothing
configured (the suite's own servers name SmolLM2 through the environment: tests/conftest.py)."""

from cloud_tier.engine_config import EngineConfig
from edge_agent.config import EdgeConfig
from model_distribution.artifacts.catalog import DEFAULT_MODEL, Catalog, served_names


def test_the_defaults_are_the_qwen_pair(tmp_path):
    assert EdgeConfig.load(environ={}).model.name == "qwen2.5-coder-0.5b" == DEFAULT_MODEL
    assert EngineConfig().model == "qwen2.5-coder-1.5b"
    catalog = Catalog(tmp_path)
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        info = catalog.get(name)
        assert (info.architecture, info.quantization, info.kind) == ("qwen2", "Q4_K_M", "instruct")
        assert served_names(f"{name}-instruct")[0] == name
