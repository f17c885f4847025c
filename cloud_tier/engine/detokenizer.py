"""Incremental detokenization with stop strings, per request (the engine's output side)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.stops import TextReleaser


@dataclass
class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas without re-decoding everything:
    decode a short window before the new tokens and keep what it adds, holding back while the
    tail is an incomplete UTF-8 sequence (the tokenizer renders it as U+FFFD)."""

    tokenizer: object
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _releaser: TextReleaser = field(init=False)
    _decode: object = field(init=False, repr=False)

    def __post_init__(self):
        self._releaser = TextReleaser(tuple(self.stop), self.include_stop)
        self._decode = _decoder(self.tokenizer)

    @property
    def stopped(self) -> bool:
        return self._releaser.stopped

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text released by it (may be empty)."""
        self._ids.append(token_id)
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        else:
            delta = ""
        released = self._releaser.push_text(delta)
        self.text += released
        return released

    def finish(self) -> str:
        """Release what was held back (an incomplete character at the very end comes out as
        U+FFFD) once the request has ended."""
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        tail = self._releaser.push_text(full[len(prefix):]) if len(full) > len(prefix) else ""
        tail += self._releaser.flush()
        self.text += tail
        return tail


def _decoder(tokenizer):
    """ids -> text without special tokens: the Rust tokenizer's own decode where the HF wrapper
    would return just that (a fast tokenizer without space clean-up; the wrapper's argument
    handling cost more than the decode, twice per token of every sequence), else the wrapper's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
