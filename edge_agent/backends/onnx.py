"""The ONNX Runtime backend (onnxruntime-genai), for devices whose GPU or NPU ONNX Runtime drives.

It sits on onnxruntime-genai the way llamacpp.py sits on llama-cpp-python: we drive the decode
loop and sample each step's logits ourselves (sampling.py), so logprob, entropy and the top
alternatives come from the model's own distribution exactly as on llama.cpp, and a seed
reproduces a completion. One ``og.Model`` per process is shared by every slot (its weights and
sessions); each backend (slot) keeps one ``og.Generator`` whose ``max_length`` is the slot's
context, and a new prompt that shares a prefix with what the generator holds rewinds to that
prefix instead of starting again (on providers whose KV cache can rewind).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

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
from edge_agent.backends.onnx_vocab import token_pieces
from edge_agent.backends.sampling import LogitsSampler, StepStats
from edge_agent.hardware import choose_providers
from model_distribution.artifacts.onnx_model import describe_onnx_dir

log = logging.getLogger(__name__)

# Providers whose generator can rewind its KV cache (continuous decoding); on the others a new
# prompt starts a fresh generator.
REWINDABLE = ("cpu", "cuda")


class ContextOverflow(ValueError):
    """The prompt does not fit the context window."""


@dataclass(frozen=True)
class OnnxConfig:
    path: str  # an export directory (genai_config.json, model.onnx, tokenizer)
    name: str
    n_ctx: int = 2048
    providers: tuple[str, ...] = ()  # in order of preference; (): what loads here
    prompt_chunk: int = 32  # prompt tokens per append: a call holds the GIL until it returns (32: ~235 ms
    # longest hold and the fastest 256-token prefill measured on 2 cores; 128 held it ~0.9 s)
    threads: int = 0  # ONNX Runtime intra-op threads; 0: its default

    def __post_init__(self):
        if self.n_ctx < 16:
            raise ValueError("n_ctx must be >= 16")
        if self.prompt_chunk < 1:
            raise ValueError("prompt_chunk must be >= 1")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")


# -- one og.Model per process ------------------------------------------------------------------

@dataclass
class _Text:
    """What the export's tokenizer files say, read once per model (tokenizer.json is megabytes)."""

    n_vocab: int
    pieces: list[bytes]
    bos: int
    adds_bos: bool
    eos: set[int]
    template: ChatTemplate


@dataclass
class _SharedModel:
    model: og.Model
    tokenizer: og.Tokenizer
    provider: str
    text: _Text
    users: int = 0


_models: dict[tuple, _SharedModel] = {}
_models_lock = threading.Lock()


def _acquire_model(config: OnnxConfig) -> tuple[tuple, _SharedModel]:
    key = (os.path.realpath(config.path), config.providers, config.threads)
    with _models_lock:
        shared = _models.get(key)
        if shared is None:
            model, provider = _load_model(config)
            tokenizer = og.Tokenizer(model)
            shared = _models[key] = _SharedModel(model, tokenizer, provider, _read_text(Path(config.path), tokenizer))
        shared.users += 1
        return key, shared


def _release_model(key: tuple) -> None:
    with _models_lock:
        shared = _models[key]
        shared.users -= 1
        if shared.users == 0:
            del _models[key]


def _load_model(config: OnnxConfig) -> tuple[og.Model, str]:
    """The model on the first provider of the choice that loads; CPU last, never silently."""
    choice = choose_providers(config.providers)
    for warning in choice.warnings:
        log.warning("onnx: %s", warning)
    reason = choice.reason
    for provider in choice.providers:
        cfg = og.Config(config.path)
        cfg.clear_providers()
        if provider != "cpu":
            cfg.append_provider(provider)
        if config.threads:
            cfg.overlay(json.dumps(
                {"model": {"decoder": {"session_options": {"intra_op_num_threads": config.threads}}}}))
        try:
            model = og.Model(cfg)
        except Exception as e:
            if provider == "cpu":
                raise
            log.warning("onnx: provider %s failed to load (%s); trying the next one", provider,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            reason = f"{provider} failed to load"
            continue
        log.info("onnx: provider %s (%s)", provider, reason)
        return model, provider
    raise RuntimeError(f"onnx: no provider loaded {config.path}")  # choose_providers ends with cpu


class OnnxBackend(Backend):
    """One slot on an ONNX export: a generator of its own on the process's shared model."""

    def __init__(self, config: OnnxConfig, quantization: str = ""):
        self.config = config
        self._quantization = quantization
        self._key: tuple | None = None
        self._model: og.Model | None = None
        self._generator: og.Generator | None = None
        self._kv_tokens: list[int] = []  # tokens the generator holds, in order
        self.provider = ""

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        if self._model is not None:
            return
        root = Path(self.config.path)
        genai = json.loads((root / "genai_config.json").read_text())["model"]
        self._key, shared = _acquire_model(self.config)
        self._model, self._tokenizer, self.provider = shared.model, shared.tokenizer, shared.provider
        t = shared.text
        self._n_vocab, self._pieces, self._bos, self._adds_bos, self._eos, self._template = \
            t.n_vocab, t.pieces, t.bos, t.adds_bos, t.eos, t.template
        try:
            n_ctx = self.config.n_ctx
            if genai.get("context_length") and n_ctx > genai["context_length"]:
                log.info("onnx: n_ctx %d is above the model's context length; using %d", n_ctx,
                         genai["context_length"])
                n_ctx = genai["context_length"]
            self.description = ModelDescription(
                name=self.config.name, path=self.config.path, architecture=genai.get("type", "unknown"),
                n_ctx=n_ctx, n_vocab=self._n_vocab, chat_template=not self._template.is_transcript,
                quantization=self._quantization or describe_onnx_dir(root)["quantization"], format="onnx",
                tokenizer=identity_of(root))
            self._stats = StepStats(self._n_vocab)
            self._grammar_cache = None
            self._warm_up()
        except BaseException:
            self.unload()
            raise
        log.info("loaded %s (%s, n_ctx=%d, provider %s)", self.config.name, self.config.path,
                 self.description.n_ctx, self.provider)

    def _new_generator(self) -> None:
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=self.description.n_ctx, batch_size=1)
        self._generator = og.Generator(self._model, params)
        self._kv_tokens = []

    def _warm_up(self) -> None:
        """One step so the first request does not pay for first-touch of the weights."""
        self._new_generator()
        self._append([self._bos if self._bos >= 0 else 0])
        self._generator.get_logits()
        self._new_generator()

    def unload(self) -> None:
        self._generator = None
        self._kv_tokens = []
        if self._key is not None:
            self._model = self._tokenizer = None
            _release_model(self._key)
            self._key = None

    @property
    def n_ctx(self) -> int:
        return self.description.n_ctx

    # -- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        tokens = self._tokenizer.encode(text).tolist()
        if not add_special and self._adds_bos and tokens and tokens[0] == self._bos:
            tokens = tokens[1:]
        return tokens

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return b"".join(self._pieces[t] for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        return self._template.render(messages, tools)

    def chat_stop_strings(self) -> tuple[str, ...]:
        return self._template.stop_strings()

    def chat_prompt_tokens(self, prompt: str) -> list[int]:
        """Tokens of a rendered chat prompt: the template writes BOS itself when it wants one."""
        tokens = self.tokenize(prompt, add_special=False)
        if self._adds_bos and (not tokens or tokens[0] != self._bos):
            tokens.insert(0, self._bos)
        return tokens

    def grammars(self):
        """Compiled grammars over the export's own tokenizer.json (built on first use, ~1 s)."""
        if self._grammar_cache is None:
            from llguidance import LLTokenizer

            from cascade.structured.matcher import GrammarCache

            text = (Path(self.config.path) / "tokenizer.json").read_text()
            tok = LLTokenizer(text, n_vocab=self._n_vocab, eos_token=sorted(self._eos))
            self._grammar_cache = GrammarCache(tok, self._n_vocab)
        return self._grammar_cache

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
        sampler = LogitsSampler(options, tokens, self._n_vocab)
        releaser = TextReleaser(tuple(options.stop))
        n_generated = 0
        reason = "length"
        while n_generated < options.max_tokens:
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            logits = self._generator.get_logits()[0, -1]
            if matcher is not None:
                logits = np.array(logits, dtype=np.float32)
                matcher.mask(logits)
            log_z, entropy = self._stats(logits, masked=matcher is not None)
            token = sampler.sample(logits)
            if token in self._eos:
                reason = "stop"
                break
            if matcher is not None and not matcher.accept(token):
                raise RuntimeError(f"a token outside the grammar was sampled: {matcher.error[:200]}")
            sampler.accept(token)
            n_generated += 1
            piece = self._pieces[token]
            text = releaser.push(piece)
            yield TokenEvent(token_id=token, text=text, piece=piece,
                             logprob=float(logits[token]) - log_z, entropy=entropy,
                             top=self._top(options.top_logprobs))
            if releaser.stopped or (matcher is not None and matcher.done):
                reason = "stop"
                break
            if len(self._kv_tokens) + 1 >= self.n_ctx:
                break  # context full: "length"
            self._append([token])
        yield Finish(finish_reason=reason, prompt_tokens=len(tokens), completion_tokens=n_generated,
                     cached_tokens=cached, text=releaser.flush() if reason != "cancelled" else "")

    def _evaluate_prompt(self, tokens: list[int]) -> int:
        """Bring the generator to ``tokens``, reusing the longest common prefix; returns how many
        prompt tokens were reused."""
        common = min(common_prefix(self._kv_tokens, tokens), len(tokens) - 1)  # the last prompt token is
        # appended for its logits
        if common == 0 or self.provider not in REWINDABLE:
            common = 0
            if self._kv_tokens:
                self._new_generator()
        elif common < len(self._kv_tokens):
            self._generator.rewind_to(common)
            self._kv_tokens = self._kv_tokens[:common]
        # The last prompt token goes alone: int4 MatMulNBits computes one row differently from
        # several (logits differ by up to ~1 on SmolLM2), so a prompt's first-token logits must
        # not depend on how much of it was cached, or a seed would not reproduce a completion.
        rest = tokens[common:-1]
        for start in range(0, len(rest), self.config.prompt_chunk):
            self._append(rest[start:start + self.config.prompt_chunk])
        self._append(tokens[-1:])
        return common

    def _append(self, chunk: list[int]) -> None:
        try:
            self._generator.append_tokens(np.asarray(chunk, dtype=np.int32))
        except BaseException:
            self._new_generator()  # its state is unknown: the next request starts afresh
            raise
        self._kv_tokens.extend(chunk)

    def _top(self, k: int) -> tuple[TopToken, ...]:
        if k <= 0:
            return ()
        return tuple(TopToken(t, self._pieces[t].decode("utf-8", errors="replace"), lp, self._pieces[t])
                     for t, lp in self._stats.top(k))


# -- the export's files ------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_text(root: Path, tokenizer: og.Tokenizer) -> _Text:
    genai = json.loads((root / "genai_config.json").read_text())["model"]
    tok_json = json.loads((root / "tokenizer.json").read_text())
    tok_config = _read_json(root / "tokenizer_config.json")
    n_vocab = int(genai.get("vocab_size") or len(tok_json["model"]["vocab"]))
    bos = int(genai.get("bos_token_id", -1))
    first = tokenizer.encode("a").tolist()
    # EOS: the export's list, the tokenizer's end-of-turn token and its configured eos token
    eos = genai.get("eos_token_id", [])
    eos = set(eos if isinstance(eos, list) else [eos])
    try:
        eos.add(int(tokenizer.eot_token_id))
    except Exception:  # the tokenizer defines none for this model
        pass
    added = {t["content"]: t["id"] for t in tok_json.get("added_tokens", [])}
    eos_text = _token_text(tok_config.get("eos_token"))
    if eos_text in added:
        eos.add(added[eos_text])
    template_file = root / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
    return _Text(n_vocab, token_pieces(tok_json, n_vocab), bos, bos >= 0 and bool(first) and first[0] == bos, eos,
                 ChatTemplate(template, bos_token=_token_text(tok_config.get("bos_token")), eos_token=eos_text))


def _token_text(value) -> str:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""
