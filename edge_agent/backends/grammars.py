"""A llama.cpp model's grammar engine: llguidance's tokenizer built from the model's own vocabulary
(its end-of-generation tokens as llguidance's EOS), once per loaded model and in the background
(~0.3-0.7 s for a 150k vocabulary), and the model's compiled grammars."""

from __future__ import annotations

import logging
import threading
import warnings

from cascade.structured.matcher import GrammarCache
from cascade.structured.tools import CLOSE, OPEN

log = logging.getLogger(__name__)


class ModelGrammars:
    def __init__(self, vocab, n_vocab: int):
        self._vocab, self._n_vocab = vocab, n_vocab
        self._cache: GrammarCache | None = None
        self._error: BaseException | None = None
        self.special_tags = False
        self._ready = threading.Event()
        threading.Thread(target=self._build, name="edge-grammar-tokenizer", daemon=True).start()

    def _build(self) -> None:
        try:
            import llama_cpp  # loaded already by the backend (which sets its environment first)
            from llguidance.llamacpp import lltokenizer_from_vocab

            eog = [t for t in range(self._n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
            with warnings.catch_warnings():  # it calls llama_token_get_attr (deprecated) once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                tok = lltokenizer_from_vocab(self._vocab, n_vocab=self._n_vocab, eos_token=eog)
            self.special_tags = all(len(ids := tok.tokenize_str(tag)) == 1 and tok.is_special_token(ids[0])
                                    for tag in (OPEN, CLOSE))
            self._cache = GrammarCache(tok, self._n_vocab)
        except BaseException as e:  # reported to each structured request, the agent serves the rest
            log.warning("no grammar engine for this model: %s", e)
            self._error = e
        finally:
            self._ready.set()

    def cache(self) -> GrammarCache:
        self._ready.wait()
        if self._cache is None:
            raise NotImplementedError(f"the grammar engine could not load this model's vocabulary: {self._error}")
        return self._cache
