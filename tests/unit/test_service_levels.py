"""A request's service level from its body and headers: X-Cascade-Deadline's three forms, the
earlier deadline winning, the class header over the body, 400s naming the header."""

import email.utils

import pytest

from cascade import errors
from cloud_tier.request_builder import RequestPlan, deadline_seconds, with_headers
from cloud_tier.sampling import SamplingParams

NOW = 1_800_000_000.0


def plan(**kw) -> RequestPlan:
    return RequestPlan([1, 2, 3], SamplingParams(), None, **kw)


@pytest.mark.parametrize("raw, left", [
    ("2.5", 2.5),  # seconds from now
    ("0", 0.0),
    (str(NOW + 30), 30.0),  # a Unix timestamp
    (str(NOW - 30), 0.0),  # already past: ends at once
    (email.utils.formatdate(NOW + 60, usegmt=True), 60.0),  # an HTTP date
])
def test_the_three_forms_of_a_deadline(raw, left):
    assert deadline_seconds(raw, wall=NOW) == pytest.approx(left)


@pytest.mark.parametrize("raw", ["tomorrow", "-1", "nan", "inf", ""])
def test_a_bad_deadline_is_a_400_naming_the_header(raw):
    with pytest.raises(errors.APIError) as e:
        deadline_seconds(raw, wall=NOW)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "X-Cascade-Deadline"


def test_headers_over_the_body_and_the_earlier_deadline_wins():
    p = plan(priority_class="escalation", timeout_s=10.0)
    assert with_headers(p, {}) is p
    assert with_headers(p, {"x-cascade-deadline": "3"}, wall=NOW).timeout_s == 3.0
    assert with_headers(p, {"x-cascade-deadline": "30"}, wall=NOW).timeout_s == 10.0
    assert with_headers(p, {"x-cascade-priority": "batch"}).priority_class == "batch"
    with pytest.raises(errors.APIError) as e:
        with_headers(p, {"x-cascade-priority": "vip"})
    assert e.value.body()["error"]["param"] == "X-Cascade-Priority"


def test_class_slos_parse_and_refuse():
    from cloud_tier.config import parse_class_slos

    assert parse_class_slos("interactive=2:0.2, escalation=5:0.5") == {"interactive": (2.0, 0.2),
                                                                      "escalation": (5.0, 0.5)}
    assert parse_class_slos("") == {}
    for bad in ("vip=1:1", "interactive=2", "batch=0:1", "interactive=x:y"):
        with pytest.raises(ValueError):
            parse_class_slos(bad)


@pytest.mark.parametrize("header, body, klass", [
    (None, None, "interactive"), ("escalation", None, "escalation"), ("batch", "escalation", "batch"),
    ("escalation", "interactive", "escalation"), (None, "batch", "batch")])
def test_a_request_takes_the_lower_standing_of_its_header_and_its_body(header, body, klass):
    from cloud_tier.request_builder import priority_class_of

    assert priority_class_of(header, body) == klass
