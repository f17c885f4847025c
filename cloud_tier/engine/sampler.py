"""Token sampling for a batch: penalties, greedy, temperature, top-k, top-p, min-p, per-request
seeds, and logprobs of the model's own distribution (before any of that processing)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cloud_tier.engine.guided import advance_rows, mask_rows
from cloud_tier.engine.request import Request
from cloud_tier.engine.spec.verify import Verdict, draft_q, verify_greedy, verify_sampled

_NOT_FINITE = "the logits are not finite (NaN or infinity): no token can be sampled"


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass
class SampleResult:
    token_ids: list[int]  # a failed row's is meaningless
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu", native=None):
        """``native``: the compiled CPU kernels (``cloud_tier.engine.kernels``), for the greedy argmax."""
        self.device = torch.device(device)
        self.native = native
        self.generator = torch.Generator(self.device).manual_seed(seed)  # for unseeded requests
        self._seeded: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    def get_state(self, request_id: str) -> bytes | None:
        """The random state of a seeded request, so another worker continues its sequence."""
        g = self._seeded.get(request_id)
        return None if g is None else bytes(g.get_state().numpy().tobytes())

    def set_state(self, request_id: str, state: bytes) -> None:
        g = self._seeded[request_id] = torch.Generator(self.device)
        g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """``logits`` [B, V] (any float dtype; computed in float32 beyond an argmax), one row per
        request in ``requests``. A row that cannot be sampled (non-finite logits) is reported in
        ``errors``; the other rows are unaffected. A guided request's row is sampled among the tokens
        its grammar allows (its logprobs stay the model's own), and its matcher takes the token."""
        masked, guided = mask_rows(logits, requests)
        if all(r.sampling_params.greedy and r.sampling_params.logprobs is None
               and not r.sampling_params.needs_penalties for r in requests):
            result = _greedy(masked, self.native)
        else:
            result = self._sample(masked, logits, requests)
        if guided.rows:
            advance_rows(result.token_ids, requests, guided, result.errors)
        return result

    def _sample(self, logits: torch.Tensor, raw: torch.Tensor, requests: list[Request]) -> SampleResult:
        """Sampled rows of ``logits``; the logprobs from ``raw`` (the same logits before a grammar's mask)."""
        params = [r.sampling_params for r in requests]
        logits = logits.float()
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)
        if any(p.needs_penalties for p in params):
            logits = logits.clone()
            for i, r in enumerate(requests):
                if r.sampling_params.needs_penalties:
                    _apply_penalties(logits[i], r, self.device)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        # NaN or +inf anywhere, or no finite logit at all, has no meaningful sample
        bad = logits.isnan().any(dim=-1) | logits.isposinf().any(dim=-1) | ~logits.isfinite().any(dim=-1)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            probs = _processed_probs(logits[idx], [params[i] for i in rand])
            unusable = bad[idx] | ~probs.isfinite().all(dim=-1) | ~(probs.sum(dim=-1) > 0)
            bad[idx] = unusable
            probs[unusable] = 0.0  # a placeholder draw, so the rest of the batch can be drawn
            probs[unusable, 0] = 1.0
            tokens[idx] = self._draw(probs, [requests[i] for i in rand])
        token_list = tokens.tolist()
        errors = {i: _NOT_FINITE for i in bad.nonzero().flatten().tolist()}
        out_logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is not None and i not in errors:
                    out_logprobs[i] = _token_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
        return SampleResult(token_list, out_logprobs, errors)

    def verify(self, logits: torch.Tensor, request: Request, proposed: tuple[int, ...]) -> Verdict | str:
        """The verdict on ``proposed`` from ``logits`` [K+1, V] (``spec.verify``), or why there is
        none (non-finite logits). Speculation runs only without penalties and logprobs."""
        if not logits.isfinite().all():
            return _NOT_FINITE
        p = request.sampling_params
        if p.greedy:
            return verify_greedy(logits, proposed)
        probs = _processed_probs(logits.float(), [p] * len(logits))
        return verify_sampled(probs, proposed, draft_q(request), self._generator(request))

    def _generator(self, r: Request) -> torch.Generator:
        """A seeded request's own generator, else the shared one."""
        seed = r.sampling_params.seed
        if seed is None:
            return self.generator
        g = self._seeded.get(r.request_id)
        if g is None:
            g = self._seeded[r.request_id] = torch.Generator(self.device).manual_seed(seed)
        return g

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        out = torch.empty(len(requests), dtype=torch.long, device=probs.device)
        shared = []
        for i, r in enumerate(requests):
            if r.sampling_params.seed is None:
                shared.append(i)
                continue
            out[i] = torch.multinomial(probs[i], 1, generator=self._generator(r))[0]
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            out[idx] = torch.multinomial(probs[idx], 1, generator=self.generator)[:, 0]
        return out


def _greedy(logits: torch.Tensor, native=None) -> SampleResult:
    """The common case in one pass over the batch. On the CPU through numpy: torch's argmax
    there took 8-25 ms for 64 rows of a 49k vocabulary, numpy's 0.5 ms (same first-maximum rule,
    NaN counted as the maximum). bfloat16 is widened first; that changes no argmax. With the
    compiled kernels, one pass over the rows as stored, by the same rule."""
    if (native is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(1) == 1
            and logits.dtype != torch.float64):
        tokens, chosen = native.argmax_rows(logits)  # the rows read as stored: no float32 copy of the batch
    elif logits.device.type == "cpu":
        rows = logits.float().numpy()
        tokens = rows.argmax(axis=-1)
        chosen = torch.from_numpy(rows[np.arange(len(tokens)), tokens])
        tokens = torch.from_numpy(tokens)
    else:
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(1, tokens[:, None])[:, 0]
    # argmax picks NaN if there is one; +inf is the maximum wherever it is; a row with no finite
    # logit has a non-finite maximum: so the bad rows are exactly those whose chosen logit is not finite
    errors = {i: _NOT_FINITE for i in (~chosen.isfinite()).nonzero().flatten().tolist()}
    return SampleResult(tokens.tolist(), [None] * len(tokens), errors)


def _apply_penalties(row: torch.Tensor, r: Request, device) -> None:
    p = r.sampling_params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out_ids = r.output_token_ids
    if out_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out_ids, dtype=torch.long, device=device).unique(return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)


def _processed_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, as probabilities."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(top_k) or any(x < 1.0 for x in top_p) or any(min_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=dev)[None, :]
        k = torch.tensor([k or vocab for k in top_k], device=dev)[:, None]
        drop = ranks >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        # top_p 1.0 keeps everything: compared with 1.0, the sum's rounding would drop tail tokens
        p = torch.tensor([x if x < 1.0 else float("inf") for x in top_p], device=dev, dtype=probs.dtype)
        drop |= before > p[:, None]
        drop |= probs < torch.tensor(min_p, device=dev, dtype=probs.dtype)[:, None] * probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)


def _token_logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = row.topk(k)
        top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprobs(token, float(row[token]), top)
