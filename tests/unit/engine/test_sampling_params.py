"""SamplingParams: values that would overflow the sampler are clamped or refused at construction."""

import math

import pytest

from cloud_tier.sampling import SamplingParams


@pytest.mark.parametrize("t", [1e-39, 1e-300, 5e-3])
def test_a_tiny_positive_temperature_samples_as_0_01(t):
    assert SamplingParams(temperature=t).temperature == 0.01


def test_zero_and_ordinary_temperatures_are_kept():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.7).temperature == 0.7


def test_a_tiny_repetition_penalty_is_clamped_to_0_01():
    assert SamplingParams(repetition_penalty=1e-39).repetition_penalty == 0.01
    assert SamplingParams(repetition_penalty=1.3).repetition_penalty == 1.3


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_clamped_values_survive_the_record_round_trip():
    p = SamplingParams(temperature=1e-39, repetition_penalty=1e-39)
    assert SamplingParams.from_dict(p.to_dict()) == p
