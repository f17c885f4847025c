"""The llama.cpp backend (llama-cpp-python's low-level bindings).

We drive llama.cpp's decode loop ourselves rather than the high-level ``Llama`` class so that
each step's logprobs come from that step's logits only: ``Llama(logits_all=True)`` would keep
n_ctx x vocab floats (400 MB for SmolLM2, 2 GiB for Gemma). Sampling is llama.cpp's own
sampler chain. The KV cache of the previous request is kept, and a new prompt that shares its
prefix (a growing chat) evaluates only the new tokens, from the last whole prompt chunk on.

A row's logits depend on the shape of the batch it was computed in (llama.cpp's repacked
K-quant kernels take a different path for a few rows than for many), so a prompt is always
evaluated in the same pieces whatever was cached: chunks of ``prompt_chunk`` tokens at fixed
positions (0, c, 2c, ...), then the rest but its last token, then the last token alone. Only
positions computed in a whole chunk are reused. A seeded completion and its logprobs (which
decide escalation) are then the same cold, partly cached and fully cached.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cascade.chat_template import ChatTemplate
from cascade.stops import TextReleaser
from edge_agent.backends.base import (
    Backend,
    Finish,
    GenerationOptions,
    ModelDescription,
    TokenEvent,
    TopToken,
    common_prefix,
    identity_of,
)
from edge_agent.backends.grammars import ModelGrammars

log = logging.getLogger(__name__)

# OpenMP threads spin-wait by default; on a 2-core device anything else running makes them
# collapse throughput. This must be set before llama.cpp's shared library is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import llama_cpp  # noqa: E402
from llama_cpp import _internals  # noqa: E402
from llama_cpp import _logger as _llama_logger  # noqa: E402


class ContextOverflow(ValueError):
    """The prompt does not fit the context window."""


@dataclass(frozen=True)
class LlamaCppConfig:
    path: str
    name: str
    n_ctx: int = 2048
    n_batch: int = 256
    n_threads: int = 0  # decode threads; 0: see threads()
    n_threads_batch: int = 0  # prompt threads; 0: one per core
    use_mmap: bool = True
    # llama.cpp's "auto" turns flash attention on for CPUs, which halved decode at a 640-token
    # context on an AVX-512/AMX Xeon here (16-17 vs 30-32 tok/s at 1 thread, prompt 512: ~5%
    # faster); off is also what llama-cpp-python's Llama does
    flash_attn: bool = False
    prompt_chunk: int = 32  # prompt tokens per decode call and the granularity of cache reuse (at
    # most n_batch); 32 was as fast as 256 for a 520-token prompt on 2 cores

    def __post_init__(self):
        if self.n_ctx < 16:
            raise ValueError("n_ctx must be >= 16")
        if self.n_batch < 1:
            raise ValueError("n_batch must be >= 1")
        if self.prompt_chunk < 1:
            raise ValueError("prompt_chunk must be >= 1")

    @property
    def chunk(self) -> int:
        return min(self.prompt_chunk, self.n_batch)

    def threads(self) -> tuple[int, int]:
        """(decode threads, prompt threads). By default prompts use every core, while decoding
        leaves one core free on small machines: a decode step syncs its threads every layer,
        so one thread preempted by the HTTP server or another app stalls them all (measured on
        2 cores: 2 decode threads drop below 1 thread's speed as soon as anything else runs)."""
        cores = os.cpu_count() or 1
        decode = self.n_threads or (max(1, cores - 1) if cores <= 4 else cores)
        return decode, self.n_threads_batch or cores


_backend_init_lock = threading.Lock()
_backend_initialized = False


def _init_backend() -> None:
    global _backend_initialized
    with _backend_init_lock:
        if not _backend_initialized:
            # llama-cpp-python prints llama.cpp's log to stderr unless its logger says otherwise
            _llama_logger.set_verbose(log.isEnabledFor(logging.DEBUG))
            llama_cpp.llama_backend_init()
            _backend_initialized = True


class LlamaCppBackend(Backend):
    """One GGUF model and one llama.cpp context (one sequence at a time)."""

    def __init__(self, config: LlamaCppConfig, quantization: str = "unknown"):
        self.config = config
        self._quantization = quantization
        self._model: _internals.LlamaModel | None = None
        self._ctx: _internals.LlamaContext | None = None
        self._batch: _internals.LlamaBatch | None = None
        self._kv_tokens: list[int] = []  # tokens whose K/V are in the context, in order
        self._kv_whole = 0  # the leading positions of _kv_tokens computed in whole prompt chunks

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        if self._model is not None:
            return
        _init_backend()
        verbose = log.isEnabledFor(logging.DEBUG)
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_mmap = self.config.use_mmap
        self._model = _internals.LlamaModel(path_model=self.config.path, params=mparams, verbose=verbose)
        cparams = llama_cpp.llama_context_default_params()
        n_threads, n_threads_batch = self.config.threads()
        cparams.n_ctx = self.config.n_ctx
        cparams.n_batch = self.config.n_batch
        cparams.n_ubatch = self.config.n_batch
        cparams.flash_attn_type = 1 if self.config.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        cparams.n_seq_max = 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads_batch
        self._ctx = _internals.LlamaContext(model=self._model, params=cparams, verbose=verbose)
        self._batch = _internals.LlamaBatch(n_tokens=self.config.n_batch, embd=0, n_seq_max=1,
                                            verbose=verbose)
        meta = self._model.metadata()
        vocab = self._model.n_vocab()
        self._bos = self._model.token_bos()
        self._template = ChatTemplate(
            meta.get("tokenizer.chat_template"),
            bos_token=self._piece_text(self._bos),
            eos_token=self._piece_text(self._model.token_eos()),
        )
        self._n_vocab = vocab
        self._grammars = ModelGrammars(self._model.vocab, vocab)
        self.description = ModelDescription(
            name=self.config.name, path=self.config.path,
            architecture=meta.get("general.architecture", "unknown"),
            n_ctx=self._ctx.n_ctx(), n_vocab=vocab,
            chat_template=not self._template.is_transcript, quantization=self._quantization,
            tokenizer=identity_of(self.config.path),
        )
        self._warm_up()
        log.info("loaded %s (%s, n_ctx=%d, threads=%d/%d)", self.config.name, self.config.path,
                 self.description.n_ctx, n_threads, n_threads_batch)

    def _warm_up(self) -> None:
        """One decode so the first request does not pay for first-touch of the weights."""
        self._decode([self._bos if self._bos >= 0 else 0])
        self._clear_kv()

    def _clear_kv(self) -> None:
        self._ctx.kv_cache_clear()
        self._kv_tokens = []
        self._kv_whole = 0

    def unload(self) -> None:
        if getattr(self, "_grammars", None) is not None:
            self._grammars._ready.wait()  # it reads the model's vocabulary
        for part in (self._batch, self._ctx, self._model):
            if part is not None:
                part.close()
        self._batch = self._ctx = self._model = None
        self._kv_tokens = []
        self._kv_whole = 0

    @property
    def n_ctx(self) -> int:
        return self.description.n_ctx

    # -- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._model.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return b"".join(self._piece(t) for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        return self._template.render(messages, tools)

    def chat_stop_strings(self) -> tuple[str, ...]:
        return self._template.stop_strings()

    def chat_prompt_tokens(self, prompt: str) -> list[int]:
        """Tokens of a rendered chat prompt: the template writes BOS itself when it wants one."""
        tokens = self._model.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        if self._model.add_bos_token() and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        return tokens

    def grammars(self):
        return self._grammars.cache()

    @property
    def special_tool_tags(self) -> bool:
        self._grammars.cache()
        return self._grammars.special_tags

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def _piece_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._model.token_get_text(token)

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], options: GenerationOptions,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Finish]:
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ValueError("empty prompt")
        if len(tokens) >= self.n_ctx:
            raise ContextOverflow(
                f"prompt is {len(tokens)} tokens; the context window is {self.n_ctx}")
        if any(t < 0 or t >= self._n_vocab for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {self._n_vocab})")
        matcher = self.grammars().matcher(options.grammar) if options.grammar else None
        cached = self._evaluate_prompt(tokens)
        sampler = self._sampler(options)
        releaser = TextReleaser(tuple(options.stop))
        vocab = self._model.vocab
        n_generated = 0
        reason = "length"
        try:
            while n_generated < options.max_tokens:
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                logits = np.ctypeslib.as_array(self._ctx.get_logits_ith(-1), shape=(self._n_vocab,))
                if matcher is not None:  # in llama.cpp's own buffer, which its sampler reads next
                    matcher.mask(logits)
                logprobs, entropy = _log_softmax_entropy(logits, masked=matcher is not None)
                token = llama_cpp.llama_sampler_sample(sampler.sampler, self._ctx.ctx, -1)
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    reason = "stop"
                    break
                if matcher is not None and not matcher.accept(token):
                    raise RuntimeError(f"a token outside the grammar was sampled: {matcher.error[:200]}")
                n_generated += 1
                piece = self._piece(token)
                text = releaser.push(piece)
                yield TokenEvent(token_id=token, text=text, piece=piece,
                                 logprob=float(logprobs[token]), entropy=entropy,
                                 top=self._top(logprobs, options.top_logprobs))
                if releaser.stopped or (matcher is not None and matcher.done):
                    reason = "stop"
                    break
                if len(self._kv_tokens) + 1 >= self.n_ctx:
                    break  # context full: "length"
                self._decode([token])
        finally:
            sampler.close()
        yield Finish(finish_reason=reason, prompt_tokens=len(tokens), completion_tokens=n_generated,
                     cached_tokens=cached, text=releaser.flush() if reason != "cancelled" else "")

    def _evaluate_prompt(self, tokens: list[int]) -> int:
        """Bring the context to ``tokens`` in the fixed pieces the module docstring describes,
        reusing the cached prefix up to the last whole chunk it shares; returns how many prompt
        tokens were reused."""
        chunk = self.config.chunk
        shared = min(common_prefix(self._kv_tokens, tokens), self._kv_whole, len(tokens) - 1)
        reused = shared // chunk * chunk
        if not self._ctx.kv_cache_seq_rm(0, reused, -1):
            reused = 0
            self._ctx.kv_cache_clear()
        self._kv_tokens = self._kv_tokens[:reused]
        self._kv_whole = reused
        body = tokens[reused:-1]
        for start in range(0, len(body), chunk):
            piece = body[start:start + chunk]
            self._decode(piece)
            if len(piece) == chunk:
                self._kv_whole += chunk
        self._decode(tokens[-1:])
        return reused

    def _decode(self, chunk: list[int]) -> None:
        self._batch.set_batch(chunk, n_past=len(self._kv_tokens), logits_all=False)
        try:
            self._ctx.decode(self._batch)
        except RuntimeError:
            self._clear_kv()
            raise
        self._kv_tokens.extend(chunk)

    def _sampler(self, o: GenerationOptions) -> _internals.LlamaSampler:
        s = _internals.LlamaSampler()
        if o.repetition_penalty != 1.0 or o.presence_penalty or o.frequency_penalty:
            s.add_penalties(self._n_vocab, 64, o.repetition_penalty, o.frequency_penalty,
                            o.presence_penalty)
        if o.temperature == 0.0:
            s.add_greedy()
            return s
        if o.top_k > 0:
            s.add_top_k(o.top_k)
        if o.top_p < 1.0:
            s.add_top_p(o.top_p, 1)
        if o.min_p > 0.0:
            s.add_min_p(o.min_p, 1)
        s.add_temp(o.temperature)
        # llama.cpp's seed is a uint32 whose top value means "random": fold any int below it, so
        # every seed (-1 and 4294967295 included) is reproducible
        s.add_dist((o.seed if o.seed is not None else random.getrandbits(32)) % llama_cpp.LLAMA_DEFAULT_SEED)
        return s

    def _top(self, logprobs: np.ndarray, k: int) -> tuple[TopToken, ...]:
        if k <= 0:
            return ()
        idx = np.argpartition(logprobs, -k)[-k:]
        idx = idx[np.argsort(-logprobs[idx], kind="stable")]
        out = []
        for t in idx.tolist():
            piece = self._piece(t)
            out.append(TopToken(t, piece.decode("utf-8", errors="replace"), float(logprobs[t]), piece))
        return tuple(out)


def _log_softmax_entropy(logits: np.ndarray, masked: bool = False) -> tuple[np.ndarray, float]:
    """Log-probabilities of the model's distribution at this step (masked by a grammar: of the
    tokens it allows), and its entropy in nats."""
    shifted = logits - logits.max()
    exp = np.exp(shifted)
    total = exp.sum()
    logprobs = shifted - np.log(total)
    if masked:  # masked tokens: 0 * -inf is 0 here, not NaN
        with np.errstate(invalid="ignore"):
            terms = np.where(exp > 0, exp / total * logprobs, 0.0)
    else:
        terms = exp / total * logprobs
    entropy = float(-terms.sum())
    return logprobs, entropy
