"""Sampler: masks, greedy, seeds, penalties and logprobs on hand-made logits."""

import math

import torch

from cloud_tier.engine.request import Request
from cloud_tier.engine.sampler import Sampler, _processed_probs
from cloud_tier.sampling import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def req(rid="r", **kw):
    return Request(rid, [0], SamplingParams(max_tokens=4, **kw))


def probs(**kw):
    return _processed_probs(LOGITS.clone(), [SamplingParams(temperature=1.0, **kw)])[0]


def test_top_k_keeps_the_k_most_likely():
    p = probs(top_k=2)
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = probs(top_p=0.8)  # 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert probs(top_p=0.01)[0] == 1.0  # the most likely token always survives


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    p = probs(min_p=0.25)  # threshold 0.125
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_masks_combine_and_temperature_sharpens():
    assert torch.count_nonzero(probs(top_k=3, top_p=0.6)) == 2
    sharp = _processed_probs(LOGITS.clone(), [SamplingParams(temperature=0.5)])[0]
    assert sharp[0] > 0.5 and math.isclose(sharp.sum().item(), 1.0, rel_tol=1e-6)


def test_greedy_takes_the_argmax_and_logprobs_are_raw():
    s = Sampler()
    out = s(LOGITS.clone(), [req(temperature=0.0, logprobs=2)])
    assert out.token_ids == [0]
    lp = out.logprobs[0]
    assert math.isclose(lp.logprob, math.log(0.5), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == [0, 1]


def test_a_seed_reproduces_regardless_of_the_batch():
    logits = torch.zeros(1, 1000)
    alone = Sampler(seed=1)(logits, [req("x", temperature=1.0, seed=5)]).token_ids[0]
    s = Sampler(seed=2)
    batch = s(torch.zeros(3, 1000), [req("u", temperature=1.0), req("y", temperature=1.0, seed=5),
                                     req("v", temperature=1.0)])
    assert batch.token_ids[1] == alone  # the engine-wide seed and the neighbours do not matter


def test_penalties_push_repeated_tokens_down():
    r = req(temperature=0.0, frequency_penalty=2.0)
    r.append_token(0)
    r.append_token(0)  # token 0 twice in the output: -4 on its logit
    assert Sampler()(LOGITS.clone(), [r]).token_ids == [1]
    rep = req(temperature=0.0, repetition_penalty=100.0)  # prompt token 0 is penalised too
    assert Sampler()(torch.tensor([[2.0, 1.0, 0.0]]), [rep]).token_ids == [1]


def test_a_top_p_1_row_is_untouched_when_batched_with_top_k_rows():
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 3  # a vocabulary's worth
    batched = _processed_probs(logits.clone(), [SamplingParams(), SamplingParams(top_k=5)])[0]
    alone = _processed_probs(logits[:1].clone(), [SamplingParams()])[0]
    assert torch.equal(batched, alone)  # cumulative-sum rounding drops no tail token
    assert torch.count_nonzero(batched) == 49152


def test_a_tiny_temperature_or_repetition_penalty_samples_without_overflow():
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5]] * 3)
    reqs = [req("t", temperature=1e-39), req("r", temperature=1.0, repetition_penalty=1e-39, seed=3),
            req("b", temperature=1e-39, repetition_penalty=1e-39)]
    out = Sampler()(logits, reqs)
    assert not out.errors and out.token_ids[0] == 0 and out.token_ids[2] == 0


def test_a_row_of_non_finite_logits_fails_only_its_request():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    logits[1, 2] = math.nan
    logits[3, :] = -math.inf
    reqs = [req("g", temperature=0.0), req("nan", temperature=1.0), req("s", temperature=1.0, seed=9),
            req("none", temperature=1.0)]
    out = Sampler()(logits, reqs)
    assert set(out.errors) == {1, 3} and "finite" in out.errors[1]
    alone = Sampler()(logits[2:3].clone(), [req("s", temperature=1.0, seed=9)])
    assert out.token_ids[0] == 0 and out.token_ids[2] == alone.token_ids[0]


def test_an_all_greedy_batch_fails_exactly_its_non_finite_rows_in_either_dtype():
    logits = torch.randn(6, 50)
    logits[1, 7] = math.nan
    logits[2, 3] = math.inf
    logits[3, :] = -math.inf
    logits[4, :10] = -math.inf  # some -inf is fine
    logits[5, [4, 9]] = 30.0  # a tie: the first maximum, as torch's argmax
    reqs = [req(f"g{i}", temperature=0.0) for i in range(6)]
    for dtype in (torch.float32, torch.bfloat16):
        out = Sampler()(logits.to(dtype), reqs)
        assert set(out.errors) == {1, 2, 3}
        expected = logits.to(dtype).float().argmax(dim=-1).tolist()
        assert [out.token_ids[i] for i in (0, 4, 5)] == [expected[i] for i in (0, 4, 5)]
        assert out.token_ids[5] == 4 and out.logprobs == [None] * 6
