"""A request's speculation state (``SpecState``); the draft itself is ``cloud_tier.draft.Draft``
(plain data the gateway and the request record share), re-exported here for the engine's modules."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud_tier.draft import FULL_SUPPORT, MAX_DRAFT_TOKENS, Draft, DraftError

__all__ = ["FULL_SUPPORT", "MAX_DRAFT_TOKENS", "Draft", "DraftError", "SpecState"]


@dataclass
class SpecState:
    """A request's speculation, on its record: the tokens its next sampling step verifies and what
    came of the device's draft and of the engine's own proposals."""

    token_ids: list[int] = field(default_factory=list)  # proposed: verified in the next step that samples
    draft: Draft | None = None  # the device's draft, until the first sampling step verifies it (or refuses)
    offered: int = 0  # the draft's tokens received ...
    accepted: int = 0  # ... and accepted
    skipped: str = ""  # why the draft was run without ("" if verified or none)
    proposed: int = 0  # the engine's own proposals (ngram): tokens proposed ...
    proposed_accepted: int = 0  # ... and accepted

    def refuse(self, why: str) -> None:
        """Run without the draft (the reason is reported)."""
        if self.draft is not None:
            self.skipped = why
            self.draft = None
        self.token_ids = []
