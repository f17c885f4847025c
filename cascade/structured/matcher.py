"""Grammars compiled for one tokenizer, and one request's matcher: the token mask each step.

``GrammarCache(tokenizer)`` keeps compiled grammars by their digest (a tokenizer has its own
cache, so the key is (tokenizer, grammar)); ``matcher(grammar)`` gives a fresh ``Matcher`` copied
from the compiled one. A grammar whose compile exceeds llguidance's fuel limits (``grammar.limits``)
or ``max_compile_s`` is refused (``GrammarRefused``) and remembered as refused.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import numpy as np

from cascade.structured.grammar import limits


class GrammarRefused(ValueError):
    """The grammar cannot be compiled within the bounds (or at all)."""


class Matcher:
    """One request's position in its grammar. ``mask(logits)`` sets every token the grammar does not
    allow next to -inf (in place); ``accept(token)`` advances; ``done``: the grammar ended (only EOS
    may follow, or it stopped); ``failed``: a token outside the grammar was accepted."""

    def __init__(self, matcher, n_vocab: int):
        self._m = matcher
        self.n_vocab = n_vocab
        self._bits = np.zeros(-(-n_vocab // 32), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, as a bool array of ``n_vocab``."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)

    def bitmask_into(self, row: np.ndarray) -> None:
        """The allowed tokens as llguidance's packed int32 bitmask, into ``row`` (C-contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def mask(self, logits: np.ndarray) -> None:
        np.copyto(logits, np.float32(-np.inf), where=~self.allowed()[:len(logits)])

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def accepts_eos(self) -> bool:
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        return self._m.is_stopped()

    @property
    def failed(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error()


class GrammarCache:
    """Compiled grammars of one tokenizer (LRU, ``max_entries``); thread-safe."""

    def __init__(self, tokenizer, n_vocab: int, max_entries: int = 64, max_compile_s: float = 5.0):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.max_entries = max_entries
        self.max_compile_s = max_compile_s
        self._compiled: OrderedDict[bytes, object] = OrderedDict()  # digest -> LLMatcher, or the refusal
        self._lock = threading.Lock()
        self.compiles = 0
        self.hits = 0

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the start of ``grammar``; GrammarRefused when it cannot be compiled."""
        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
        if compiled is None:
            compiled = self._compile(grammar)
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > self.max_entries:
                    self._compiled.popitem(last=False)
        if isinstance(compiled, GrammarRefused):
            raise compiled
        return Matcher(compiled.deep_copy(), self.n_vocab)

    def _compile(self, grammar: str):
        from llguidance import LLMatcher

        started = time.perf_counter()
        m = LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        took = time.perf_counter() - started
        self.compiles += 1
        if m.is_error():
            return GrammarRefused(m.get_error()[:300])
        if took > self.max_compile_s:
            return GrammarRefused(f"the grammar took {took:.1f} s to compile (at most {self.max_compile_s:g} s)")
        return m
