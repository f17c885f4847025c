"""The suite's guard (tests/conftest.py) against pytest's log capture iterating the logger table
while a lingering thread adds a logger: a CI run failed one fleet test on that race."""

from __future__ import annotations

import logging
import threading
import time

from _pytest.logging import LogCaptureHandler, catching_logs


def test_entering_the_log_capture_while_a_thread_makes_loggers_never_fails():
    stop = threading.Event()

    def make_loggers():
        i = 0
        while not stop.is_set():
            logging.getLogger(f"cascade.tests.race.{i}")
            i += 1

    maker = threading.Thread(target=make_loggers, daemon=True)
    maker.start()
    failures = []
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                with catching_logs(LogCaptureHandler(), level=logging.INFO):
                    pass
            except RuntimeError as e:
                failures.append(e)
                break
    finally:
        stop.set()
        maker.join()
        manager = logging.Logger.manager
        with logging._lock:  # noqa: SLF001
            for name in [n for n in manager.loggerDict if n.startswith("cascade.tests.race.")]:
                del manager.loggerDict[name]
    assert not failures, failures
