"""The rollout and execution transition tables (model_distribution/rollout/states.py): every move
they hold is taken, by the checks and by the store; a sample of the others is refused with the
reason, and nothing is written."""

from __future__ import annotations

import pytest

from model_distribution.protocol.device_messages import DeviceState
from model_distribution.rollout.spec import RolloutSpec
from model_distribution.rollout.states import (
    EXECUTION_MOVES,
    REPORTED,
    ROLLOUT_MOVES,
    ExecutionState,
    IllegalMove,
    RolloutState,
    check_execution_move,
    check_rollout_move,
)
from model_distribution.rollout.store import RolloutStore

E, R = ExecutionState, RolloutState
ALLOWED_EXECUTION = [(a, b) for a, to in EXECUTION_MOVES.items() for b in to]
ALLOWED_ROLLOUT = [(a, b) for a, to in ROLLOUT_MOVES.items() for b in to]
ILLEGAL_EXECUTION = [(E.QUEUED, E.SUCCEEDED), (E.QUEUED, E.ROLLED_BACK), (E.SUCCEEDED, E.IN_PROGRESS),
                     (E.FAILED, E.SUCCEEDED), (E.CANCELED, E.QUEUED), (E.ROLLED_BACK, E.ROLLED_BACK),
                     (E.TIMED_OUT, E.CANCELED)]
ILLEGAL_ROLLOUT = [(R.SUCCEEDED, R.RUNNING), (R.ROLLED_BACK, R.RUNNING), (R.ABORTED, R.PAUSED),
                   (R.ROLLED_BACK, R.ROLLED_BACK), (R.RUNNING, R.RUNNING)]


def test_the_stored_strings_are_the_ones_printed_and_kept_before():
    assert [s.value for s in RolloutState] == ["RUNNING", "PAUSED", "SUCCEEDED", "ROLLED_BACK", "ABORTED"]
    assert [s.value for s in ExecutionState] == ["QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "TIMED_OUT",
                                                 "REJECTED", "CANCELED", "ROLLED_BACK"]
    assert set(EXECUTION_MOVES) == set(ExecutionState) and set(ROLLOUT_MOVES) == set(RolloutState)


@pytest.mark.parametrize(("src", "dst"), ALLOWED_EXECUTION)
def test_every_allowed_execution_move_is_taken(src, dst):
    assert check_execution_move(src.value, dst.value) is dst


@pytest.mark.parametrize(("src", "dst"), ALLOWED_ROLLOUT)
def test_every_allowed_rollout_move_is_taken(src, dst):
    assert check_rollout_move(src.value, dst.value) is dst


@pytest.mark.parametrize(("src", "dst"), ILLEGAL_EXECUTION)
def test_an_illegal_execution_move_is_refused_saying_what_is_allowed(src, dst):
    with pytest.raises(IllegalMove, match=f"execution cannot move from {src} to {dst}"):
        check_execution_move(src, dst)


@pytest.mark.parametrize(("src", "dst"), ILLEGAL_ROLLOUT)
def test_an_illegal_rollout_move_is_refused(src, dst):
    with pytest.raises(IllegalMove, match=f"rollout cannot move from {src} to {dst}"):
        check_rollout_move(src, dst)


def test_a_state_no_table_knows_is_refused():
    with pytest.raises(IllegalMove, match="not a ExecutionState"):
        check_execution_move("QUEUED", "COMPLETED")
    with pytest.raises(IllegalMove, match="not a RolloutState"):
        check_rollout_move("RUNNING", "COMPLETED")


def test_only_a_devices_final_words_end_its_execution():
    assert REPORTED == {DeviceState.ACTIVE: E.SUCCEEDED, DeviceState.FAILED: E.FAILED,
                        DeviceState.REJECTED: E.REJECTED}
    assert all(dst in EXECUTION_MOVES[E.IN_PROGRESS] for dst in REPORTED.values())


@pytest.fixture
def store(tmp_path):
    s = RolloutStore(tmp_path)
    yield s
    s.close()


def test_the_store_refuses_an_illegal_move_and_writes_nothing(store):
    r = store.create(RolloutSpec("tiny@1.0.0", "kiosks", waves=[100]), {"k1": (0, None), "k2": (0, None)})
    e1, e2 = store.executions(r.rollout_id)
    with pytest.raises(IllegalMove, match="from QUEUED to SUCCEEDED"):
        store.move(e1, "SUCCEEDED")
    with pytest.raises(IllegalMove, match="from QUEUED to ROLLED_BACK"):
        store.move_all([e1, e2], E.ROLLED_BACK, "back", 1.0)
    with pytest.raises(IllegalMove, match="from RUNNING to RUNNING"):
        store.update(r, state=R.RUNNING)
    assert [e.row_version for e in store.executions(r.rollout_id)] == [0, 0]
    assert store.get(r.rollout_id).row_version == 0


def test_the_store_takes_a_whole_execution_path_and_reads_typed_states_back(store):
    r = store.create(RolloutSpec("tiny@1.0.0", "kiosks", waves=[100]), {"k1": (0, "tiny@0.9.0")})
    for state in (E.IN_PROGRESS, E.IN_PROGRESS, E.SUCCEEDED, E.ROLLED_BACK):
        e = store.executions(r.rollout_id)[0]
        assert store.move(e, state, state.value)
    got = store.executions(r.rollout_id)[0]
    assert got.state is E.ROLLED_BACK and got.to_dict()["state"] == "ROLLED_BACK"
    paused = store.update(r, state=R.PAUSED)
    assert paused.state is R.PAUSED and store.update(paused, state=R.ROLLED_BACK).state is R.ROLLED_BACK


def test_a_kept_report_is_read_back_typed_and_one_the_schema_refuses_is_none():
    from model_distribution.protocol.device_messages import reported_state

    got = reported_state({"state": "ACTIVE", "desired": "tiny@1.0.0", "rev": 3, "at": 1000})
    assert got.state == DeviceState.ACTIVE and got.rev == 3 and got.at == 1000.0 and REPORTED[got.state] is E.SUCCEEDED
    assert reported_state(None) is None and reported_state({"state": "lower"}) is None
    assert reported_state({"state": "NEWER_STEP"}).state not in REPORTED  # a newer agent's step ends nothing
