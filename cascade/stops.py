"""Stop strings: release generated text to a client only once it cannot become a stop string,
and cut at the first full match. Pure logic, shared by the edge backends and the cloud engine so
stop handling is identical everywhere."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field


@dataclass
class TextReleaser:
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # keep the matched stop string in the released text
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    _pending: str = ""
    stopped: bool = False

    def push(self, piece: bytes) -> str:
        """Add a token's bytes (a multi-byte character may span tokens); return what is now safe
        to release."""
        return self.push_text(self._decoder.decode(piece))

    def push_text(self, text: str) -> str:
        """Add decoded text; return what is now safe to release."""
        if self.stopped:
            return ""
        self._pending += text
        if not self.stop:
            out, self._pending = self._pending, ""
            return out
        hits = [(i, s) for s in self.stop if (i := self._pending.find(s)) != -1]
        if hits:
            idx, s = min(hits)
            self.stopped = True
            out = self._pending[:idx + (len(s) if self.include_stop else 0)]
            self._pending = ""
            return out
        hold = self._longest_stop_prefix_suffix(self._pending)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back text once generation ended without a stop match."""
        if self.stopped:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
