"""The strict decoder (``cascade.wire``): orjson's fast path never accepts what the checked path
refuses, and gives the same value where both accept; every refusal names its reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade import wire

LIMIT = 1 << 20


def outcome(decode, data, **kw):
    try:
        return "ok", decode(data, **kw)
    except wire.WireError as e:
        return "refused", e.reason


def checked(data, max_depth=wire.MAX_DEPTH, text_safe=False, int64=True):
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > LIMIT:
        raise wire.WireError("too_large", "")
    return wire._checked(data, max_depth, text_safe, int64)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans(), st.integers(min_value=1, max_value=40))
def test_the_fast_path_gives_what_the_checked_path_gives(value, int64, max_depth):
    for data in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")):
        fast = outcome(wire.loads, data, limit=LIMIT, int64=int64, max_depth=max_depth)
        assert fast == outcome(checked, data, int64=int64, max_depth=max_depth), data[:200]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_bytes_are_refused_or_decoded_alike(data):
    assert outcome(wire.loads, data, limit=LIMIT) == outcome(checked, data)


@pytest.mark.parametrize("data, reason", [
    (b"NaN", "non_finite"), (b"[Infinity]", "non_finite"), (b"-Infinity", "non_finite"), (b"1e999", "non_finite"),
    (b'{"n": 18446744073709551616}', "int_range"), (b"9223372036854775808", "int_range"),
    (b"-9223372036854775809", "int_range"), (b"1" * 5000, "int_range"), (b'"\\ud800"', "surrogate"),
    (b'{"a": "\\udfff"}', "surrogate"), ("\ufeff{}".encode(), "not_json"), (b"[" * 33 + b"]" * 33, "not_json"),
    (b"\xff{}", "encoding"), (b'{"a": 1', "not_json"), (b'"a\x01b"', "not_json"), (b"x" * (LIMIT + 1), "too_large"),
])
def test_each_refusal_names_its_reason(data, reason):
    with pytest.raises(wire.WireError) as e:
        wire.loads(data, limit=LIMIT)
    assert e.value.reason == reason


def test_line_separators_pass_unless_text_safe():
    data = '{"t": "a\u2028b\u0085c"}'.encode()
    assert wire.loads(data, limit=LIMIT) == {"t": "a\u2028b\u0085c"}
    with pytest.raises(wire.WireError) as e:
        wire.loads(data, limit=LIMIT, text_safe=True)
    assert e.value.reason == "control_char"


def test_integers_of_any_size_are_kept_when_asked():
    assert wire.loads(b'{"n": 123456789012345678901234567890}', limit=LIMIT, int64=False) == {
        "n": 123456789012345678901234567890}
    assert wire.loads(b"9223372036854775807", limit=LIMIT) == 2**63 - 1
