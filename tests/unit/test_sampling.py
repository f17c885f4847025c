"""The numpy sampler of the ONNX backend on hand-made logits: exact outcomes for the masks and
penalties, the drawn frequencies for temperature, and the step statistics against float64."""

import math

import numpy as np
import pytest

from edge_agent.backends.base import GenerationOptions
from edge_agent.backends.sampling import LogitsSampler, StepStats

V = 1000


def logits_with(values: dict[int, float], rest: float = -10.0) -> np.ndarray:
    out = np.full(V, rest, dtype=np.float32)
    for t, v in values.items():
        out[t] = v
    return out


def draws(options, logits, n=2000):
    s = LogitsSampler(options, [], V)
    return [s.sample(logits) for _ in range(n)]


def test_greedy_takes_the_argmax_and_leaves_the_logits_alone():
    logits = logits_with({5: 3.0, 7: 2.9})
    before = logits.copy()
    assert LogitsSampler(GenerationOptions(temperature=0), [], V).sample(logits) == 5
    assert np.array_equal(logits, before)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = logits_with({5: 1.0, 7: 0.9, 9: 0.8})
    assert set(draws(GenerationOptions(temperature=5.0, top_k=1), logits, 200)) == {5}


def test_top_k_keeps_only_the_k_most_likely():
    logits = logits_with({5: 1.0, 7: 0.9, 9: 0.8, 11: 0.7})
    assert set(draws(GenerationOptions(temperature=1.0, top_k=3), logits)) == {5, 7, 9}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2 (plus a negligible tail): 0.5 + 0.3 >= 0.7 keeps two
    logits = logits_with({1: math.log(0.5), 2: math.log(0.3), 3: math.log(0.2)}, rest=-60.0)
    assert set(draws(GenerationOptions(temperature=1.0, top_p=0.7), logits)) == {1, 2}
    assert set(draws(GenerationOptions(temperature=1.0, top_p=0.4), logits)) == {1}


def test_top_p_over_a_flat_vocabulary_looks_past_the_first_candidates():
    logits = np.zeros(V, dtype=np.float32)  # every token 1/1000: top_p 0.9 keeps ~900 of them
    seen = set(draws(GenerationOptions(temperature=1.0, top_p=0.9, seed=0), logits, 5000))
    assert 800 < len(seen) <= 901


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    logits = logits_with({1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.1)}, rest=-60.0)
    assert set(draws(GenerationOptions(temperature=1.0, min_p=0.2), logits)) == {1, 2}


def test_temperature_draws_follow_the_distribution():
    logits = logits_with({1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.1)}, rest=-60.0)
    picks = np.array(draws(GenerationOptions(temperature=1.0, seed=3), logits, 20000))
    freq = [np.mean(picks == t) for t in (1, 2, 3)]
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=0.02)
    hot = np.array(draws(GenerationOptions(temperature=100.0, seed=3), logits, 5000))
    assert np.mean(np.isin(hot, [1, 2, 3])) < 0.1  # near uniform over the vocabulary


def test_a_seed_reproduces_the_draws_and_another_seed_differs():
    logits = np.zeros(V, dtype=np.float32)
    a = draws(GenerationOptions(temperature=1.0, seed=42), logits, 50)
    assert a == draws(GenerationOptions(temperature=1.0, seed=42), logits, 50)
    assert a != draws(GenerationOptions(temperature=1.0, seed=43), logits, 50)


def test_repetition_penalty_covers_the_prompt_and_the_output():
    logits = logits_with({1: 2.0, 2: 1.9, 3: 1.8})
    s = LogitsSampler(GenerationOptions(temperature=0, repetition_penalty=1.2), [1], V)
    assert s.sample(logits) == 2  # 2.0 / 1.2 < 1.9
    s.accept(2)
    assert s.sample(logits) == 3


def test_repetition_penalty_pushes_negative_logits_further_down():
    logits = logits_with({1: -1.0, 2: -1.1}, rest=-50.0)
    s = LogitsSampler(GenerationOptions(temperature=0, repetition_penalty=1.2), [1], V)
    assert s.sample(logits) == 2  # -1.0 * 1.2 < -1.1


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = logits_with({1: 2.0, 2: 1.5})
    s = LogitsSampler(GenerationOptions(temperature=0, frequency_penalty=0.3), [1, 1, 1], V)
    assert s.sample(logits) == 1  # the prompt's repeats do not count
    s.accept(1)
    assert s.sample(logits) == 1  # 2.0 - 0.3 > 1.5
    s.accept(1)
    assert s.sample(logits) == 2  # 2.0 - 0.6 < 1.5
    p = LogitsSampler(GenerationOptions(temperature=0, presence_penalty=0.6), [], V)
    p.accept(1)
    assert p.sample(logits) == 2


def test_step_stats_match_a_float64_log_softmax():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(49152) * 4).astype(np.float32)
    stats = StepStats(len(logits))
    log_z, entropy = stats(logits)
    ref = logits.astype(np.float64) - logits.max()
    ref_logprobs = ref - np.log(np.exp(ref).sum())
    assert logits[17] - log_z == pytest.approx(ref_logprobs[17], abs=1e-4)
    assert entropy == pytest.approx(-(np.exp(ref_logprobs) * ref_logprobs).sum(), rel=1e-4)
    for k in (1, 3, 20):
        top = stats.top(k)
        assert [t for t, _ in top] == np.argsort(-ref_logprobs)[:k].tolist()
        assert [lp for _, lp in top] == pytest.approx(np.sort(ref_logprobs)[::-1][:k], abs=1e-4)


def test_top_alternatives_of_a_peaked_distribution_reach_past_the_near_candidates():
    # one token far ahead: fewer than k within a few nats, so the partition over all is used
    logits = logits_with({4: 30.0, 9: 5.0, 2: 1.0}, rest=0.0)
    stats = StepStats(V)
    stats(logits)
    top = [t for t, _ in stats.top(5)]
    assert top[:3] == [4, 9, 2] and len(top) == 5 and len(set(top)) == 5


def test_a_near_certain_token_has_an_entropy_near_zero_never_below():
    for top in (20.0, 50.0, 200.0):
        _, entropy = StepStats(V)(logits_with({4: top}, rest=0.0))
        assert 0.0 <= entropy < 1e-4


def test_draws_over_a_large_vocabulary_follow_the_distribution():
    # 49152 tokens: the blocked inverse CDF; mass on a few ids spread over several blocks
    big = np.full(49152, -40.0, dtype=np.float32)
    chosen = {7: 0.4, 5000: 0.3, 30001: 0.2, 49151: 0.1}
    for t, p in chosen.items():
        big[t] = math.log(p)
    s = LogitsSampler(GenerationOptions(temperature=1.0, seed=5), [], len(big))
    picks = np.array([s.sample(big) for _ in range(10000)])
    assert set(picks.tolist()) <= set(chosen)
    assert [np.mean(picks == t) for t in chosen] == pytest.approx(list(chosen.values()), abs=0.02)
