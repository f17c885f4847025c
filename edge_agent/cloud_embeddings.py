"""What the edge agent asks of the cloud for embeddings: which embedding identity the cloud's model
states (its /v1/models card's ``meta.embedding``, read at most once a minute while unknown), and
the request itself, on the upstream's client (its key, device header and time limits)."""

from __future__ import annotations

import math
import time

import httpx

from cascade import errors, wire
from cascade.embedding_identity import identity_of_card
from edge_agent.upstream import TOKENIZER_RELIST_S, Upstream
from edge_agent.upstream_reads import MAX_BODY_BYTES


class CloudEmbeddings:
    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._identities: dict[str, str] = {}  # the cloud's models -> meta.embedding
        self._first: str | None = None  # the cloud's first listed model
        self._listed_at = -math.inf

    async def model(self) -> str | None:
        """The cloud's model to ask for: ``[upstream] model``, else the cloud's first listed."""
        if self.upstream.config.model:
            return self.upstream.config.model
        if self._first is None:
            await self._list()
        return self._first

    async def identity(self, model: str) -> str:
        """The embedding identity the cloud states for ``model`` ("" when it states none or cannot be asked)."""
        if model not in self._identities and time.monotonic() - self._listed_at > TOKENIZER_RELIST_S:
            await self._list()
        return self._identities.get(model, "")

    def forget(self, model: str) -> None:
        """Drop what the cloud's card said of ``model`` (its answer showed another identity)."""
        self._identities.pop(model, None)
        self._listed_at = -math.inf

    async def _list(self) -> None:
        self._listed_at = time.monotonic()
        try:
            r = await self.upstream.client.get(self.upstream.base_url + "/models", timeout=5.0)
        except httpx.HTTPError:
            return
        listing = _json_object(r.content)
        data = listing.get("data") if listing is not None else None
        for card in data if isinstance(data, list) else ():
            if isinstance(card, dict) and isinstance(card.get("id"), str):
                self._first = self._first or card["id"]
                if identity := identity_of_card(card):
                    self._identities[card["id"]] = identity

    async def embed(self, body: dict) -> tuple[int, dict]:
        """POST ``body`` to the cloud's /v1/embeddings: (its status, its JSON object), a 502 body when it
        answers anything else; httpx.HTTPError when it cannot be reached."""
        r = await self.upstream.client.post(self.upstream.base_url + "/embeddings", json=body,
                                            headers={"accept": "application/json"})
        answer = _json_object(r.content)
        if answer is None:
            return 502, errors.APIError(502, f"The cloud answered HTTP {r.status_code} without a JSON object.",
                                        "server_error", None, "bad_upstream").body()
        return r.status_code, answer


def _json_object(content: bytes) -> dict | None:
    try:
        body = wire.loads(content, limit=MAX_BODY_BYTES)
    except wire.WireError:
        return None
    return body if isinstance(body, dict) else None
