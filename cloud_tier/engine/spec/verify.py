"""Verifying proposed tokens against the engine's logits at the K+1 positions from the last known
token through the last proposed one.

Greedy: the longest prefix of the proposal that equals the engine's argmax, then the argmax at the
first mismatch (or after the last proposed token: the bonus token), so the output is the one the
non-speculative greedy path gives. Sampling: speculative rejection sampling (Leviathan et al.
2023): proposed token x is accepted with probability min(1, p(x) / q(x)), p the engine's processed
distribution and q the proposer's; at the first rejection the token is drawn from
norm(max(0, p - q)); when all are accepted, the bonus token from p. The output then follows p
exactly, whatever q was."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_tier.engine.request import Request


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # the accepted prefix of the proposal
    token: int  # the engine's own token after it


def verify_greedy(logits: torch.Tensor, proposed: tuple[int, ...]) -> Verdict:
    """``logits`` [K+1, V] for the K ``proposed`` tokens."""
    best = logits.float().argmax(dim=-1).tolist()
    m = 0
    while m < len(proposed) and best[m] == proposed[m]:
        m += 1
    return Verdict(list(proposed[:m]), best[m])


def verify_sampled(probs: torch.Tensor, proposed: tuple[int, ...], q: list[dict[int, float]] | None,
                   generator: torch.Generator) -> Verdict:
    """``probs`` [K+1, V]: the engine's processed distribution at each position; ``q``: the
    proposer's over the whole vocabulary at each proposed position (None: one-hot on the
    proposed token, as a greedy proposer or an n-gram lookup)."""
    draws = torch.rand(len(proposed), generator=generator, device=probs.device).tolist()
    for i, x in enumerate(proposed):
        qi = q[i] if q is not None else {x: 1.0}
        p_x = float(probs[i, x])
        if draws[i] * qi[x] < p_x:  # u < p(x)/q(x) without dividing: q(x) > 0 (Draft.check)
            continue
        residual = probs[i].clone()
        ids = torch.tensor(list(qi), dtype=torch.long, device=probs.device)
        residual[ids] -= torch.tensor(list(qi.values()), dtype=residual.dtype, device=probs.device)
        residual.clamp_(min=0.0)
        if not residual.sum() > 0:  # p <= q everywhere: a rejection had probability 0; p is its limit
            residual = probs[i]
        token = int(torch.multinomial(residual, 1, generator=generator)[0])
        return Verdict(list(proposed[:i]), token)
    return Verdict(list(proposed), int(torch.multinomial(probs[len(proposed)], 1, generator=generator)[0]))


def draft_q(request: Request) -> list[dict[int, float]] | None:
    """The proposer's q for the tokens ``request`` verifies now: the device draft's (while it is
    pending), else None (the engine's own proposals are one-hot)."""
    draft = request.spec.draft
    return None if draft is None else draft.distributions()
