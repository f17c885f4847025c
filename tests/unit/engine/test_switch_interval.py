"""The GIL switch interval a server's engine thread runs with (cloud_tier.engine.async_engine)."""

import pytest

from cloud_tier.engine.async_engine import SWITCH_INTERVAL_US, engine_switch_interval_s


@pytest.mark.parametrize("raw, want_s", [
    ("", SWITCH_INTERVAL_US / 1e6),
    ("   ", SWITCH_INTERVAL_US / 1e6),
    ("50", 50e-6),
    ("5000", 5e-3),
    ("0", 1e-6),  # floored: sys.setswitchinterval refuses 0
    ("-3", 1e-6),
    ("fast", SWITCH_INTERVAL_US / 1e6),  # not a number: the default, with a warning
    ("nan", SWITCH_INTERVAL_US / 1e6),
    ("inf", float("inf")),  # never shortens: the process's own interval stays
])
def test_the_interval_comes_from_the_environment_in_microseconds(monkeypatch, raw, want_s):
    monkeypatch.setenv("CASCADE_ENGINE_SWITCH_INTERVAL_US", raw)
    assert engine_switch_interval_s() == pytest.approx(want_s)


def test_unset_is_the_default(monkeypatch):
    monkeypatch.delenv("CASCADE_ENGINE_SWITCH_INTERVAL_US", raising=False)
    assert engine_switch_interval_s() == pytest.approx(SWITCH_INTERVAL_US / 1e6)
