"""systemd's notification protocol (sd_notify(3)) without libsystemd: one datagram of
``KEY=VALUE`` lines to the AF_UNIX socket named in ``$NOTIFY_SOCKET`` (a path, or an abstract
name written with a leading ``@``). Outside systemd the variable is unset and every call is a
no-op, so the agent runs the same from a shell, a container or a unit of ``Type=notify``."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


def socket_address(value: str) -> str | None:
    """``$NOTIFY_SOCKET`` as an address for ``sendto``: ``@name`` is the abstract name
    ``\\0name``; a path must be absolute. Anything else (vsock, empty) is not ours: None."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(environ: Mapping[str, str]) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``$WATCHDOG_USEC`` (sd_watchdog_enabled(3)),
    or None when no watchdog is asked of this process (unset, not a positive number, or
    ``$WATCHDOG_PID`` naming another process)."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2 / 1e6


class Notifier:
    """Sends state changes to the service manager: ``notify(READY=1, STATUS="serving")``."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self.address = socket_address(environ.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = watchdog_interval_s(environ) if self.address else None
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; True when it was sent. A failure is logged
        once and never raised: the service manager's bookkeeping must not stop the agent."""
        if self.address is None:
            return False
        data = "".join(f"{k}={_one_line(v)}\n" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(data, self.address)
        except OSError as e:
            if not self._failed:
                log.warning("cannot notify the service manager at %r: %s", self.address, e)
            self._failed = True
            return False
        self._failed = False
        return True

    def reloading(self, status: str) -> None:
        """``RELOADING=1`` with the CLOCK_MONOTONIC stamp systemd 253+ asks for; READY=1 ends it."""
        self.notify(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000, STATUS=status)

    async def watchdog(self) -> None:
        """Ping ``WATCHDOG=1`` every half interval until cancelled. It runs on the event loop on
        purpose: a loop that hangs stops the pings, and systemd restarts the agent."""
        if self.watchdog_s is None:
            return
        while True:
            self.notify(WATCHDOG=1)
            await asyncio.sleep(self.watchdog_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(value) -> str:
    return str(value).replace("\n", " ")
