"""The cloud tier's inference engine: paged KV cache, continuous batching, prefix caching."""

from cloud_tier.engine.llm_engine import LLMEngine
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine_config import EngineConfig
from cloud_tier.sampling import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
