"""A malformed draft is a DraftError (a ValueError) naming its field, raised when the request is
made, never in the step loop; a draft the engine cannot verify exactly runs without (counted)."""

from __future__ import annotations

import math

import pytest

from cloud_tier.engine.draft import MAX_DRAFT_TOKENS, Draft, DraftError

VOCAB = 272


@pytest.mark.parametrize(("draft", "param"), [
    (Draft.of([1, 2, VOCAB]), "cascade.draft.token_ids[2]"),
    (Draft.of([-1]), "cascade.draft.token_ids[0]"),
    (Draft.of([True]), "cascade.draft.token_ids[0]"),
    (Draft.of([]), "cascade.draft.token_ids"),
    (Draft.of([1] * (MAX_DRAFT_TOKENS + 1)), "cascade.draft.token_ids"),
    (Draft.of([1] * 10_000), "cascade.draft.token_ids"),
    (Draft.of([1, 2], [0.5]), "cascade.draft.probs"),
    (Draft.of([1, 2], [0.5, math.nan]), "cascade.draft.probs[1]"),
    (Draft.of([1, 2], [0.5, 1.5]), "cascade.draft.probs[1]"),
    (Draft.of([1, 2], [0.5, 0.0]), "cascade.draft.probs[1]"),
    (Draft.of([1, 2], None, [[(1, 1.0)]]), "cascade.draft.top"),
    (Draft.of([1], None, [[(1, 0.5), (VOCAB, 0.5)]]), "cascade.draft.top[0]"),
    (Draft.of([1], None, [[(1, 0.5), (1, 0.5)]]), "cascade.draft.top[0]"),
    (Draft.of([1], None, [[(1, math.inf)]]), "cascade.draft.top[0]"),
    (Draft.of([1], None, [[(2, 1.0)]]), "cascade.draft.top[0]"),  # the drafted token has no mass in its q
    (Draft.of([1], None, [[(1, 0.7), (2, 0.7)]]), "cascade.draft.top[0]"),  # more than 1 in all
    (Draft.of([1], [0.2], [[(1, 0.9), (2, 0.1)]]), "cascade.draft.top[0]"),  # probs and top disagree
])
def test_a_malformed_draft_names_its_field(draft, param):
    with pytest.raises(DraftError) as e:
        draft.check(VOCAB)
    assert e.value.param == param and isinstance(e.value, ValueError)


def test_q_is_known_from_a_full_top_or_a_probability_of_one_and_unknown_otherwise():
    assert Draft.of([3, 4], [1.0, 1.0]).distributions() == [{3: 1.0}, {4: 1.0}]
    assert Draft.of([3], None, [[(3, 0.75), (5, 0.25)]]).distributions() == [{3: 0.75, 5: 0.25}]
    assert Draft.of([3, 4], [1.0, 0.5]).distributions() is None
    assert Draft.of([3], None, [[(3, 0.75), (5, 0.2)]]).distributions() is None  # a tail is missing
    assert Draft.of([3]).distributions() is None
