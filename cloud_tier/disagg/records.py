"""Engine objects <-> the request record that travels between workers."""

from __future__ import annotations

from cloud_tier.disagg.messages import RequestRecord, TokenLogprobRecord
from cloud_tier.engine.sampler import TokenLogprobs
from cloud_tier.sampling import SamplingParams


def params_of(record: RequestRecord) -> SamplingParams:
    """The record's sampling params (ValueError/TypeError on bad ones)."""
    return SamplingParams.from_dict(record.sampling)


def logprob_record(lp: TokenLogprobs) -> TokenLogprobRecord:
    return TokenLogprobRecord(token_id=lp.token_id, logprob=lp.logprob, top=[tuple(t) for t in lp.top])


def logprobs_of(rec: TokenLogprobRecord) -> TokenLogprobs:
    return TokenLogprobs(rec.token_id, rec.logprob, tuple((int(t), float(v)) for t, v in rec.top))
