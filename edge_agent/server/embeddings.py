"""``POST /v1/embeddings`` on the edge agent: on the device's own model (llama.cpp's embedding mode,
``backends.embed``), or in the cloud when the request asks for it (``cascade: {"mode": "cloud"}``,
or the agent's mode is cloud) and only when the cloud's model computes the same embeddings (its
/v1/models card states the same ``meta.embedding`` identity): vectors of two models are not
comparable, so anything else is a 409 saying why."""

from __future__ import annotations

import asyncio
import logging
import math

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from cascade import errors
from cascade.embedding_identity import cloud_mismatch, embedding_identity, served_name
from cascade.embeddings import EmbeddingRequest, check_dimensions, decode_base64, embedding_response, token_lists
from cascade.web import parse_body, read_json
from cascade.web.tier_header import TIER_HEADER
from edge_agent.backends.embed import LlamaEmbedder, stated_pooling
from edge_agent.backends.llamacpp import LlamaCppConfig
from edge_agent.cloud_embeddings import CloudEmbeddings
from edge_agent.config import EdgeConfig

log = logging.getLogger(__name__)
# the most tokens one request embeds here (its inputs together, or one input of the whole context):
# about 35 s of a 2-core CPU with SmolLM2-135M (240 tokens/s)
MAX_REQUEST_TOKENS = 8192


class EdgeEmbeddings:
    """The agent's embedder, opened at the first embedding request on the model the agent serves
    then (a fleet switch to another file opens a new one), and its embedding identity."""

    def __init__(self, config: EdgeConfig):
        self.config = config
        self._embedder: LlamaEmbedder | None = None
        self._identities: dict[str, str] = {}  # weights path -> identity
        self._switch = asyncio.Lock()
        self._one = asyncio.Lock()  # one request embeds at a time (the embedder runs one input at a time anyway)
        self._cloud: CloudEmbeddings | None = None

    async def embedder(self, description) -> LlamaEmbedder:
        """The embedder of the served model (``EdgeService.description``); 400 for a model that is not a GGUF."""
        if description.format != "gguf":
            raise errors.bad_request(f"This agent's {description.format} backend does not compute embeddings; "
                                     "serve a GGUF model (llama.cpp) for /v1/embeddings.", "model", "unsupported_model")
        async with self._switch:
            old = self._embedder
            if old is None or old.config.path != description.path:
                m = self.config.model
                self._embedder = LlamaEmbedder(LlamaCppConfig(
                    path=description.path, name=description.name, n_ctx=m.n_ctx, n_batch=m.n_batch,
                    n_threads=m.threads, n_threads_batch=m.threads_batch, flash_attn=m.flash_attn))
                if old is not None:
                    await asyncio.to_thread(old.close)  # waits for the embedding it runs, if any
            return self._embedder

    async def identity(self, description) -> str:
        """The served model's embedding identity ("" for a model without embeddings here)."""
        if description.format != "gguf":
            return ""
        if description.path not in self._identities:
            try:
                pooling = await asyncio.to_thread(stated_pooling, description.path)
                identity = await asyncio.to_thread(embedding_identity, description.path, pooling)
            except (OSError, ValueError, RuntimeError) as e:  # unknown: the card states none, the cloud is refused
                log.warning("no embedding identity for %s (%s)", description.path, e)
                identity = ""
            self._identities[description.path] = identity
        return self._identities[description.path]

    async def local(self, req: EmbeddingRequest, description) -> dict:
        async with self._one:  # the others wait here, not in the event loop's threads (healthz needs one)
            return await self._local(req, description)

    async def _local(self, req: EmbeddingRequest, description) -> dict:
        emb = await self.embedder(description)
        identity = await self.identity(description)
        _, n_embd, n_vocab, n_ctx = await asyncio.to_thread(emb.describe)
        check_dimensions(req, n_embd)
        ids = await asyncio.to_thread(token_lists, req, emb.tokenize, n_vocab, n_ctx, max(n_ctx, MAX_REQUEST_TOKENS))
        vectors = await asyncio.to_thread(emb.embed, ids)
        return embedding_response(served_name(description.name, identity), vectors, req.encoding_format,
                                  sum(len(t) for t in ids))

    async def cloud(self, upstream, req: EmbeddingRequest, body: dict, description) -> JSONResponse:
        """The cloud's answer, when its model's embedding identity is this one's (else a 409). The
        cloud is asked for base64 (a quarter of the JSON floats' size) and its vectors passed on as asked."""
        if self._cloud is None or self._cloud.upstream is not upstream:  # a reload may swap the upstream
            self._cloud = CloudEmbeddings(upstream)
        local = await self.identity(description)
        model = await self._cloud.model() or req.model
        refusal = cloud_mismatch(local, await self._cloud.identity(model), model)
        if refusal is not None:
            raise refusal
        payload = {k: v for k, v in body.items() if k != "cascade"} | {"model": model, "encoding_format": "base64"}
        try:
            status, answer = await self._cloud.embed(payload)
        except httpx.HTTPError as e:
            raise errors.APIError(503, f"The cloud cannot be reached: {e}", "server_error", None,
                                  "upstream_unavailable") from e
        if status == 200:
            try:
                answer = checked_cloud_answer(answer, req, served_name(model, local))
            except errors.APIError as e:
                if e.status == 409:
                    self._cloud.forget(model)  # its card is read again before the next one
                raise
        return JSONResponse(answer, status_code=status, headers={TIER_HEADER: "cloud"})

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None


def checked_cloud_answer(answer: dict, req: EmbeddingRequest, expected_model: str) -> dict:
    """The cloud's 200 rebuilt from what was checked: one finite vector per input, each index once, all
    of one size, from the model it should be (``expected_model``: this device's model id and identity:
    a cloud that switched weights since its card was read answers another, a 409); a 502 otherwise."""
    if answer.get("model") != expected_model:
        raise errors.APIError(409, f"The cloud answered with embeddings of {str(answer.get('model'))[:120]!r}, not "
                              f"{expected_model!r}: its vectors would not be comparable with this device's.",
                              "invalid_request_error", "cascade", "embedding_model_mismatch")
    try:
        data, n = answer["data"], len(req.inputs())
        if not isinstance(data, list) or len(data) != n:
            raise ValueError(f"{n} inputs but {len(data) if isinstance(data, list) else 'no'} vectors")
        vectors: list = [None] * n
        for item in data:
            index = item["index"]
            if type(index) is not int or not 0 <= index < n or vectors[index] is not None:
                raise ValueError(f"a bad or repeated index {str(index)[:20]}")
            vectors[index] = decode_base64(item["embedding"])
        if len({len(v) for v in vectors}) != 1 or not 0 < len(vectors[0]) <= MAX_DIMENSIONS or not all(
                math.isfinite(x) for v in vectors for x in v):
            raise ValueError("vectors of different sizes, empty or not finite")
        usage = answer.get("usage") or {}
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        tokens = min(max(tokens, 0), 2**31 - 1) if type(tokens) is int else 0
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise errors.APIError(502, f"The cloud's embeddings are malformed: {str(e)[:200]}", "server_error", None,
                              "bad_upstream") from e
    return embedding_response(expected_model, vectors, req.encoding_format, tokens)


MAX_DIMENSIONS = 1 << 16


async def serve(request: Request) -> JSONResponse:
    """Parse one embedding request and answer it here or in the cloud."""
    app = request.app
    svc, esc, emb = app.state.service, app.state.escalator, app.state.embeddings
    body = await read_json(request, app.state.config.server.max_body_bytes)
    req = parse_body(EmbeddingRequest, body)
    svc.check_model(req.model)
    mode = req.cascade.mode if req.cascade is not None and req.cascade.mode else esc.config.mode
    if mode != "cloud":
        return JSONResponse(await emb.local(req, svc.description))
    if esc.upstream is None:
        raise errors.APIError(503, "This agent has no cloud to send the request to ([upstream] url is not set).",
                              "server_error", "cascade", "no_upstream")
    return await emb.cloud(esc.upstream, req, body, svc.description)
