"""The step budget as a value: what a step may still take, drawn down by each chunk it schedules."""

from cloud_tier.engine.request import Request, ServiceLevel
from cloud_tier.engine.scheduling.budget import StepBudget
from cloud_tier.engine.scheduling.step_cost import StepCostModel
from cloud_tier.engine.scheduling.tenants import TpotPolicy
from cloud_tier.engine_config import SchedulerConfig
from cloud_tier.sampling import SamplingParams


def req(rid: str, prompt: int, computed: int = 0, tpot_s: float | None = None) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=4), slo=ServiceLevel(tpot_s=tpot_s))
    r.num_computed_tokens = computed
    return r


def plan(running=(), waiting=(), **config) -> StepBudget:
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 100, "max_model_len": 512, "short_prompt_tokens": 8,
                             "short_lane_share": 0.25, **config})
    cost = StepCostModel(base_s=0.01, per_prefill_token_s=0.001, per_decode_s=0.01)
    tpot = TpotPolicy(cfg.tpot_min_batch, cfg.min_tpot_s, cfg.max_num_seqs)
    return StepBudget.plan(cfg, cost, tpot, lambda r: tpot.effective(r.slo.tpot_s, cost), running, waiting)


def test_a_short_prompt_waiting_keeps_its_lane_from_the_long_ones():
    budget = plan(waiting=[req("short", 4)])
    assert (budget.tokens, budget.prefill_tokens, budget.long_tokens) == (100, 100, 75)
    assert budget.chunk(req("long", 300)) == 75 and budget.chunk(req("short", 4)) == 4
    assert plan(waiting=[req("long", 300)]).long_tokens == 100  # no short one waits: no lane kept


def test_take_draws_a_chunk_from_every_allowance_and_a_decode_only_from_the_tokens():
    budget = plan(running=[decode := req("d", 10, computed=9)])
    budget.take(decode, 1)
    assert (budget.tokens, budget.prefill_tokens, budget.prefill_s) == (99, 100, 0.0)
    budget.take(long := req("long", 300), 50)
    assert (budget.tokens, budget.prefill_tokens, budget.long_tokens) == (49, 50, 50)
    budget.give_back(50)  # preempted after it was scheduled: only the tokens come back
    assert (budget.tokens, budget.prefill_tokens) == (99, 50) and budget.chunk(long) == 50


def test_a_running_tpot_target_caps_its_tenants_prefill_but_at_least_the_minimum_chunk():
    budget = plan(running=[req("d", 10, computed=9, tpot_s=0.05)], min_prefill_chunk=16, tpot_min_batch=1)
    # 0.05 s a step, less 0.01 base and 0.01 for the decode: 30 tokens at 1 ms
    assert budget.prefill_room(req("p", 300)) == 30
    budget.take(req("p", 300), 30)
    assert budget.prefill_room(req("q", 300)) == 0
