"""Engine objects <-> the request record that travels between workers."""

from __future__ import annotations

import time

from cloud_tier.disagg.messages import RequestRecord, TokenLogprobRecord
from cloud_tier.engine.request import ServiceLevel
from cloud_tier.engine.sampler import TokenLogprobs
from cloud_tier.sampling import SamplingParams


def params_of(record: RequestRecord) -> SamplingParams:
    """The record's sampling params (ValueError/TypeError on bad ones)."""
    return SamplingParams.from_dict(record.sampling)


def service_level_of(record: RequestRecord, received: float | None = None) -> ServiceLevel:
    """The record's service level here: its deadline is what was left of it when sent, from when
    it was received (``time.monotonic()``; now if not given)."""
    deadline = None
    if record.timeout_s is not None:
        deadline = (time.monotonic() if received is None else received) + record.timeout_s
    return ServiceLevel(record.priority_class, record.ttft_slo_s, record.tpot_slo_s, deadline, record.tenant)


def arrival_of(record: RequestRecord, received: float | None = None) -> float:
    """The request's arrival on this host's ``time.monotonic()`` clock: when it was received here
    (now if not given), less what it had waited before (``waited_s``, a duration: clocks differ)."""
    return (time.monotonic() if received is None else received) - record.waited_s


def logprob_record(lp: TokenLogprobs) -> TokenLogprobRecord:
    return TokenLogprobRecord(token_id=lp.token_id, logprob=lp.logprob, top=[tuple(t) for t in lp.top])


def logprobs_of(rec: TokenLogprobRecord) -> TokenLogprobs:
    return TokenLogprobs(rec.token_id, rec.logprob, tuple((int(t), float(v)) for t, v in rec.top))
