"""The contract every edge model backend keeps (llama.cpp today, ONNX Runtime next).

A backend owns one loaded model and one generation context. It is used from one thread at a
time; the service runs several backends (slots) for parallelism. ``generate`` is a plain
iterator so a backend needs no event loop: it yields one ``TokenEvent`` per generated token
and ends with a ``Finish``; it checks ``cancel`` between tokens and stops promptly when set.

Invariants the contract tests check for every backend:
- ``tokenize`` then ``detokenize`` round-trips plain text;
- the concatenated ``TokenEvent.text`` equals the detokenized generated tokens, minus a
  matched stop string and anything after it;
- ``Finish.completion_tokens`` equals the number of TokenEvents with a token, and
  ``finish_reason`` is "stop" (EOS or stop string), "length" (max_tokens or context full)
  or "cancelled";
- with temperature 0 the output is deterministic; with a seed, reproducible.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cascade.generation import Finish, TokenEvent, TopToken

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling and stopping for one request (validated by the API before it gets here)."""

    max_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0  # alternatives to report per token; the chosen one's logprob always is
    grammar: str | None = None  # llguidance grammar (cascade.structured) every token must follow; None: free

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass(frozen=True)
class ModelDescription:
    name: str
    path: str
    architecture: str
    n_ctx: int
    n_vocab: int
    chat_template: bool
    quantization: str
    format: str = "gguf"  # the weights' format, as /v1/models shows it: gguf (llama.cpp) | onnx
    tokenizer: str = ""  # model_distribution.artifacts.tokenizer_identity ("": unknown): a cloud with the
    # same verifies this model's draft tokens instead of generating them again (cascade.draft)


class Backend(ABC):
    """One model, one generation context; see the module docstring for the contract."""

    description: ModelDescription

    @abstractmethod
    def load(self) -> None: ...

    @abstractmethod
    def unload(self) -> None: ...

    @abstractmethod
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    @abstractmethod
    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The prompt text for a chat (the model's own template; a plain transcript for base
        models, whose stop strings ``chat_stop_strings`` gives)."""

    def chat_prompt_tokens(self, prompt: str) -> list[int]:
        """The tokens of a prompt rendered by ``apply_chat_template`` (which may already
        contain the BOS token)."""
        return self.tokenize(prompt, add_special=False)

    def chat_stop_strings(self) -> tuple[str, ...]:
        return ()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def grammars(self):
        """This model's compiled grammars (``cascade.structured.matcher.GrammarCache``), for
        ``GenerationOptions.grammar``; NotImplementedError where the backend cannot mask."""
        raise NotImplementedError(f"{type(self).__name__} does not constrain its output")

    @property
    def special_tool_tags(self) -> bool:
        """The vocabulary has ``<tool_call>``/``</tool_call>`` as special tokens (Qwen's)."""
        return False

    @abstractmethod
    def generate(self, prompt: str | Sequence[int], options: GenerationOptions,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Finish]: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: what a slot's cache can keep of a new prompt."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


__all__ = ["Backend", "common_prefix", "Finish", "GenerationOptions", "ModelDescription", "TokenEvent", "TopToken"]


def identity_of(path) -> str:
    """The tokenizer identity of the model at ``path`` (a GGUF file or an HF/ONNX directory), ""
    when it cannot be read (the agent then never offers a draft)."""
    from model_distribution.artifacts.tokenizer_identity import tokenizer_identity

    try:
        return tokenizer_identity(path)
    except (OSError, ValueError, KeyError) as e:
        log.warning("no tokenizer identity for %s (%s): escalations carry no draft", path, e)
        return ""
