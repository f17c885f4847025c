"""An operator's command that loses the race with the controller (or another operator) writes
nothing: an abort does not cancel the executions of a rollout it then fails to stop (the rollout
would sit RUNNING with a wave that never completes, holding its group), and a resume that is
refused records no "pass by operator" decision. Found by an attacker helper (issue 38)."""

from __future__ import annotations

import pytest

from model_distribution.rollout import actions
from model_distribution.rollout.spec import RolloutError, RolloutSpec
from model_distribution.rollout.states import ExecutionState, RolloutState
from model_distribution.rollout.store import RolloutStore


def stale_reads(monkeypatch, store: RolloutStore, rollout_id: str, change) -> None:
    """The command reads the rollout, then ``change`` lands (a controller tick) before it writes."""
    stale = store.get(rollout_id)
    change(stale)
    real_get = store.get
    calls = []

    def get(rid):
        calls.append(rid)
        return stale if len(calls) == 1 else real_get(rid)

    monkeypatch.setattr(store, "get", get)


def test_an_abort_that_loses_the_race_cancels_nothing(tmp_path, monkeypatch):
    store = RolloutStore(tmp_path)
    r = store.create(RolloutSpec("tiny@1.1.0", "g", [50, 100]), {"k1": (0, "tiny@1.0.0"), "k2": (1, "tiny@1.0.0")})
    stale_reads(monkeypatch, store, r.rollout_id, lambda stale: store.update(stale, wave_done_at=1.0))
    with pytest.raises(RolloutError, match="changed meanwhile"):
        actions.abort(store, r.rollout_id)
    assert {e.state for e in store.executions(r.rollout_id)} == {ExecutionState.QUEUED}
    assert store.get(r.rollout_id).state == RolloutState.RUNNING
    assert actions.abort(store, r.rollout_id).state == RolloutState.ABORTED  # tried again, it is whole
    assert {e.state for e in store.executions(r.rollout_id)} == {ExecutionState.CANCELED}
    store.close()


def test_a_resume_that_loses_the_race_records_no_decision(tmp_path, monkeypatch):
    store = RolloutStore(tmp_path)
    r = store.create(RolloutSpec("tiny@1.1.0", "g", [50, 100]), {"k1": (0, "tiny@1.0.0"), "k2": (1, "tiny@1.0.0")})
    r = store.update(r, state=RolloutState.PAUSED, reason="inconclusive: too few requests", wave_done_at=1.0)
    stale_reads(monkeypatch, store, r.rollout_id, lambda stale: store.update(stale, reason="inconclusive: again"))
    with pytest.raises(RolloutError, match="changed meanwhile"):
        actions.resume(store, r.rollout_id)
    assert store.decisions(r.rollout_id) == []
    resumed = actions.resume(store, r.rollout_id)
    assert (resumed.state, resumed.wave) == (RolloutState.RUNNING, 1)
    assert [d["outcome"] for d in store.decisions(r.rollout_id)] == ["pass"]
    store.close()
