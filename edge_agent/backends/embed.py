"""llama.cpp's embedding mode (llama-cpp-python's low-level bindings) for the edge agent.

An ``LlamaEmbedder`` opens its own model handle and context on the served GGUF with
``embeddings = True`` at its first request (the agent's start is not slowed), apart from the
generation slots: those keep their contexts and caches, and a fleet switch that unloads them never
frees what an embedding is using. The model is memory-mapped, so the weights' pages are shared
with the slots'. Pooling is the GGUF's ``<arch>.pooling_type`` when it states one, else mean
pooling (our causal LMs state none); vectors are L2-normalised. Inputs run one by one under a lock
(the same vectors a batch would give), in the caller's thread: never call it on an event loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from edge_agent.backends.llamacpp import LlamaCppConfig, _init_backend, _internals, llama_cpp

log = logging.getLogger(__name__)

POOLING_NAMES = {llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean", llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
                 llama_cpp.LLAMA_POOLING_TYPE_LAST: "last"}


class LlamaEmbedder:
    """Embeddings of one GGUF model; ``embed`` and ``tokenize`` are thread-safe (one lock)."""

    def __init__(self, config: LlamaCppConfig):
        self.config = config
        self._lock = threading.Lock()
        self._model: _internals.LlamaModel | None = None
        self._ctx: _internals.LlamaContext | None = None
        self._batch: _internals.LlamaBatch | None = None
        self.pooling = "mean"
        self.n_embd = 0
        self.n_vocab = 0
        self.n_ctx = config.n_ctx

    def _open(self) -> None:
        if self._ctx is not None:
            return
        _init_backend()
        verbose = log.isEnabledFor(logging.DEBUG)
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_mmap = True
        model = _internals.LlamaModel(path_model=self.config.path, params=mparams, verbose=verbose)
        try:
            pooling = _gguf_pooling(model.metadata())
            cparams = llama_cpp.llama_context_default_params()
            cparams.embeddings = True
            cparams.pooling_type = pooling
            cparams.n_ctx = self.config.n_ctx
            # one input is one ubatch: pooling needs a sequence's tokens in one decode
            cparams.n_batch = cparams.n_ubatch = self.config.n_ctx
            cparams.n_seq_max = 1
            cparams.flash_attn_type = 1 if self.config.flash_attn else 0
            cparams.n_threads = cparams.n_threads_batch = self.config.threads()[1]
            ctx = _internals.LlamaContext(model=model, params=cparams, verbose=verbose)
            self._batch = _internals.LlamaBatch(n_tokens=self.config.n_ctx, embd=0, n_seq_max=1, verbose=verbose)
        except BaseException:
            model.close()
            raise
        self._model, self._ctx = model, ctx
        self.pooling = POOLING_NAMES[pooling]
        self.n_embd = model.n_embd()
        self.n_vocab = model.n_vocab()
        self.n_ctx = ctx.n_ctx()
        log.info("embedding context open on %s (%s pooling, %d dimensions)", self.config.path, self.pooling,
                 self.n_embd)

    def describe(self) -> tuple[str, int, int, int]:
        """(pooling, dimensions, vocabulary size, context length), opening the context if needed."""
        with self._lock:
            self._open()
            return self.pooling, self.n_embd, self.n_vocab, self.n_ctx

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            self._open()
            return self._model.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One L2-normalised float32 vector per input (token ids, each at most ``n_ctx`` of them,
        within the vocabulary: the caller checked)."""
        with self._lock:
            self._open()
            return [self._embed_one(list(ids)) for ids in inputs]

    def _embed_one(self, ids: list[int]) -> np.ndarray:
        self._ctx.kv_cache_clear()
        self._batch.set_batch(ids, n_past=0, logits_all=True)  # every token an output: pooling reads them all
        self._ctx.decode(self._batch)
        ptr = self._ctx.get_embeddings_seq(0)
        if not ptr:
            raise RuntimeError("llama.cpp returned no pooled embedding")
        vec = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float32)
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def close(self) -> None:
        with self._lock:
            for part in (self._batch, self._ctx, self._model):
                if part is not None:
                    part.close()
            self._batch = self._ctx = self._model = None


def stated_pooling(path: str) -> str:
    """The pooling an embedder of the GGUF at ``path`` uses (its metadata only: the vocabulary-only load)."""
    _init_backend()
    mparams = llama_cpp.llama_model_default_params()
    mparams.vocab_only = True
    model = _internals.LlamaModel(path_model=path, params=mparams, verbose=log.isEnabledFor(logging.DEBUG))
    try:
        return POOLING_NAMES[_gguf_pooling(model.metadata())]
    finally:
        model.close()


def _gguf_pooling(meta: dict[str, str]) -> int:
    """The GGUF's ``<arch>.pooling_type`` when it names mean, cls or last pooling, else mean."""
    arch = meta.get("general.architecture", "")
    try:
        stated = int(meta.get(f"{arch}.pooling_type", ""))
    except ValueError:
        stated = -1
    return stated if stated in POOLING_NAMES else llama_cpp.LLAMA_POOLING_TYPE_MEAN
