"""The worker's ``POST /v1/embeddings``: inputs tokenized by the engine's tokenizer, embedded on the
engine thread between steps (``engine.embed``) in batches of their own, answered with the model's
embedding identity (the sha256 of the GGUF it was loaded from, mean pooling, L2)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cascade.embedding_identity import embedding_identity, served_name
from cascade.embeddings import EmbeddingRequest, check_dimensions, embedding_response, token_lists
from cloud_tier.engine.async_engine import AsyncLLMEngine
from cloud_tier.engine.embed import POOLING, batches, embed_tokens

MAX_REQUEST_TOKENS = 65_536  # the most tokens one request embeds (its inputs together, or one whole context)
BATCH_TOKENS = 512  # tokens per embedding forward (a longer input goes alone): the engine steps between two


class WorkerEmbeddings:
    def __init__(self, engine: AsyncLLMEngine, model_id: str):
        self.engine = engine
        self.model_id = model_id
        self._identity: str | None = None

    def identity(self) -> str:
        """The model's embedding identity (hashes its weights the first time: call it in a thread)."""
        if self._identity is None:
            try:
                self._identity = embedding_identity(source_weights(self.engine.engine.config.model), POOLING)
            except (OSError, ValueError, KeyError):
                self._identity = ""
        return self._identity

    async def serve(self, req: EmbeddingRequest) -> dict:
        eng = self.engine.engine
        check_dimensions(req, eng.model.config["hidden_size"])
        ids = await asyncio.to_thread(token_lists, req, eng.tokenizer.encode, eng.model.config["vocab_size"],
                                      eng.max_model_len, max(eng.max_model_len, MAX_REQUEST_TOKENS))
        vectors: list[list[float]] = []
        for group in batches(ids, BATCH_TOKENS):
            started = time.monotonic()
            vectors += await self.engine.call(lambda e, g=group: embed_tokens(e, g))
            if eng.has_unfinished_requests():  # generations wait meanwhile: they get at least as long next
                await asyncio.sleep(time.monotonic() - started)
        identity = await asyncio.to_thread(self.identity)
        return embedding_response(served_name(self.model_id, identity), vectors, req.encoding_format,
                                  sum(len(t) for t in ids))


def source_weights(model: str) -> Path:
    """The file (or HF directory) a model named as the engine names one was loaded from: a path, or
    a catalogue name's GGUF (the file the edge agent loads for the same name)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    from cascade.config import cascade_home
    from model_distribution.artifacts.catalog import Catalog

    catalog = Catalog(cascade_home())
    return catalog.ensure_ready(catalog.get(model))
