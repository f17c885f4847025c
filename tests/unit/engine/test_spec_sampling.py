"""Speculative rejection sampling keeps the engine's distribution: whatever the proposer's q, the
tokens come out distributed as the engine's own processed distribution p (chi-square tests at
p < 0.001, on a controlled p and q, and end to end on a tiny model against the plain sampler)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from cloud_tier.engine import LLMEngine, SamplingParams
from cloud_tier.engine.draft import Draft
from cloud_tier.engine.spec.verify import verify_sampled
from tests.unit.engine.spec_models import SMALL, make_tiny, plain_greedy, run

P = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0]).softmax(dim=-1)
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def chi2_against(counts: Counter, expected: torch.Tensor, n: int) -> float:
    return sum((counts.get(i, 0) - n * float(e)) ** 2 / (n * float(e)) for i, e in enumerate(expected))


def chi2_two_samples(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic that two samples come from one distribution, and its degrees of freedom."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a.get(k, 0) + b.get(k, 0)
        for c, n in ((a.get(k, 0), na), (b.get(k, 0), nb)):
            e = total * n / (na + nb)
            stat += (c - e) ** 2 / e
    return stat, len(keys) - 1


def draws(q_rows, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """The first two tokens of ``n`` answers that verify 2 tokens drafted from ``q_rows`` (None: the
    draft is p's most likely token, q one-hot), p the same at every position."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    probs = P.expand(3, -1).clone()
    out = []
    for _ in range(n):
        if q_rows is None:
            drafted, q = (0, 0), None
        else:
            drafted = tuple(int(rng.choice(len(row), p=row)) for row in q_rows)
            q = [dict(enumerate(row)) for row in q_rows]
        v = verify_sampled(probs, drafted, q, g)
        tokens = [*v.accepted, v.token]
        if len(tokens) < 2:  # rejected at once: the next step samples p plainly (p is the same there)
            tokens.append(int(torch.multinomial(P, 1, generator=g)[0]))
        out.append((tokens[0], tokens[1]))
    return out


@pytest.mark.parametrize("q_rows", [None, [[0.1, 0.6, 0.1, 0.1, 0.05, 0.05], [0.02, 0.02, 0.02, 0.02, 0.02, 0.9]]],
                         ids=["one-hot", "sparse-top"])
def test_each_verified_token_is_distributed_as_p_whatever_the_draft_distribution(q_rows):
    n = 20000
    out = draws(q_rows, n)
    for position in (0, 1):
        stat = chi2_against(Counter(t[position] for t in out), P, n)
        assert stat < CHI2_001[5], f"position {position}: chi-square {stat:.1f}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))
    return LLMEngine.from_model(str(path), **{**SMALL, "num_kv_blocks": 4096, "max_num_seqs": 512})


def test_sampled_answers_with_a_draft_follow_the_plain_samplers_distribution(engine):
    prompt = list(b"def fibonacci(n):")
    greedy = plain_greedy(engine, prompt, 3)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=2, seed=s) for s in range(600)]
    plain = run(engine, [engine.make_request(prompt, p) for p in params])
    top = [{t: 1.0} for t in greedy]  # a greedy device: q one-hot on its token
    drafted = run(engine, [engine.make_request(prompt, SamplingParams(temperature=1.0, top_k=3, max_tokens=2,
                                                                      seed=10_000 + i),
                                               draft=Draft.of(greedy, [1.0] * 3, [list(r.items()) for r in top]))
                           for i in range(600)])
    assert all(o.draft_skipped == "" and o.draft_offered == 3 for o in drafted)
    assert 0 < sum(o.draft_accepted for o in drafted) < 600  # some drafts accepted, some rejected
    stat, df = chi2_two_samples(Counter(tuple(o.token_ids) for o in plain),
                                Counter(tuple(o.token_ids) for o in drafted))
    assert stat < CHI2_001[df], f"chi-square {stat:.1f} on {df} degrees of freedom"


def test_a_sampled_request_with_a_draft_of_unknown_distribution_runs_without_it(engine):
    prompt = list(b"def fibonacci(n):")
    req = engine.make_request(prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=1),
                              draft=Draft.of([1, 2, 3], probs=[0.5, 0.5, 0.5]))
    (out,) = run(engine, [req])
    assert (out.draft_offered, out.draft_accepted, out.draft_skipped) == (3, 0, "unverifiable")
    (again,) = run(engine, [engine.make_request(prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=1))])
    assert out.token_ids == again.token_ids  # run exactly as without a draft
