"""Faults to inject between the edge agent and the cloud: a TCP proxy on loopback that can be
down (connections refused), up, or drop responses (the cloud has done the work; the device never
hears back), or throttle what comes back (``rate``, bytes/s: a slow download to interrupt). It
records the Idempotency-Key of each request it forwards, in order, and each request's line with
its Range header (``requests``)."""

from __future__ import annotations

import re
import socket
import threading
import time

from cascade.processes import free_port

_KEY = re.compile(rb"idempotency-key: *([^\r\n]+)", re.I)
_RANGE = re.compile(rb"\r\nrange: *([^\r\n]+)", re.I)


class Proxy:
    def __init__(self, target_port: int, port: int = 0):
        self.target = ("127.0.0.1", target_port)
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._drop = 0
        self.forwarded: list[tuple[float, str]] = []  # (time, idempotency key) of each request sent on
        self.dropped = 0
        self.rate = 0.0  # bytes/s of responses (0: as fast as they come)
        self.requests: list[tuple[str, str | None]] = []  # (request line, Range header) of each request
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> Proxy:
        with self._lock:
            if self._listener is not None:
                return self
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", self.port))
            ls.listen(64)
            self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            ls, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if ls is not None:
            ls.close()
        for c in conns:
            close_socket(c)

    def drop_responses(self, n: int) -> None:
        """The next ``n`` responses to requests with an Idempotency-Key are swallowed and their
        client connections cut."""
        with self._lock:
            self._drop = n

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                close_socket(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._conns += [client, server]
            state = {"keyed": False}  # is the request on this connection one with an Idempotency-Key?
            threading.Thread(target=self._pump, args=(client, server, True, state), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False, state), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool, state: dict) -> None:
        try:
            while data := src.recv(65536):
                if upstream:
                    keys = _KEY.findall(data)
                    if data[:4] in (b"POST", b"GET ", b"PUT ", b"DELE"):
                        state["keyed"] = bool(keys)
                        rng = _RANGE.search(data)
                        self.requests.append((data.split(b"\r\n", 1)[0].decode(errors="replace"),
                                              rng.group(1).decode().strip() if rng else None))
                    for key in keys:
                        self.forwarded.append((time.monotonic(), key.decode().strip()))
                else:
                    with self._lock:
                        drop = self._drop > 0 and state["keyed"]
                        if drop:
                            self._drop -= 1
                            self.dropped += 1
                    if drop:
                        break
                    if self.rate:
                        for i in range(0, len(data), 8192):
                            dst.sendall(data[i:i + 8192])
                            time.sleep(min(len(data) - i, 8192) / self.rate)
                        continue
                dst.sendall(data)
        except OSError:
            pass
        close_socket(src)
        close_socket(dst)


def close_socket(s: socket.socket) -> None:
    """Shut down and close, ignoring a peer that is gone already."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
