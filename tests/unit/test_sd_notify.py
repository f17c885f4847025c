"""The sd_notify client (edge_agent/sd_notify.py) against a real AF_UNIX datagram socket."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import pytest

from edge_agent.sd_notify import Notifier, socket_address, watchdog_interval_s


@pytest.fixture
def abstract():
    name = f"cascade-unit-{uuid.uuid4().hex[:12]}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    yield "@" + name, s
    s.close()


def test_a_notification_is_one_datagram_of_lines_on_an_abstract_socket(abstract):
    name, sock = abstract
    n = Notifier({"NOTIFY_SOCKET": name})
    assert n.notify(READY=1, STATUS="serving\nsmollm2")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving smollm2\n"
    n.reloading("reloading edge.toml")
    fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
    assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
    n.close()


def test_a_notification_reaches_a_socket_path(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": path}).notify(STOPPING=1)
        assert sock.recv(4096) == b"STOPPING=1\n"


def test_without_notify_socket_nothing_is_sent_and_nothing_fails():
    n = Notifier({})
    assert not n.enabled and n.watchdog_s is None and n.notify(READY=1) is False
    assert socket_address("vsock:2:1234") is None and socket_address("") is None


def test_a_socket_nobody_listens_on_is_logged_not_raised(caplog):
    n = Notifier({"NOTIFY_SOCKET": f"@cascade-nobody-{uuid.uuid4().hex}"})
    assert n.notify(READY=1) is False and n.notify(READY=1) is False
    assert len([r for r in caplog.records if "cannot notify" in r.message]) == 1  # once


@pytest.mark.parametrize("env, interval", [
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid())}, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "1"}, None),  # another process's watchdog
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None),
])
def test_the_watchdog_interval_is_half_of_watchdog_usec_for_this_process(env, interval):
    assert watchdog_interval_s(env) == interval


def test_watchdog_pings_until_cancelled(abstract):
    name, sock = abstract
    n = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "20000"})

    async def main():
        task = asyncio.create_task(n.watchdog())
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    sock.settimeout(0.5)
    pings = []
    try:
        while True:
            pings.append(sock.recv(4096))
    except TimeoutError:
        pass
    assert len(pings) >= 3 and set(pings) == {b"WATCHDOG=1\n"}
