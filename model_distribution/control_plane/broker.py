"""The fleet's MQTT broker, started by the control plane: Mosquitto when it is installed, else an
embedded one (amqtt, ``embedded_broker.py``) in this process, so ``cascade fleet serve`` and
``make demo`` work with nothing but the pip install.

    broker = FleetBroker(root, host="127.0.0.1", port=1883, credentials=(user, secret), prefer="auto")
    url = broker.start()   # "mqtt://127.0.0.1:1883"; port=0 picks a free port
    broker.refresh()       # after enrolling devices: Mosquitto rereads passwd and ACL (the embedded one needs none)
    broker.stop()

``root`` is the folder that holds the DeviceStore; ``credentials`` the control plane's own broker
user and secret (``control_plane_credentials(keys_dir)``). ``prefer``: "auto" (Mosquitto if it is
on PATH or in /usr/sbin, else embedded), "mosquitto" or "embedded". ``kind`` says which one runs.

Both take the same credentials (each enrolled device's secret; the control plane's user; no
anonymous clients), bind each connection's client id to its user (one session per identity,
which no other login can take over), and enforce the same ACL (``allowed``, which the acl_file written by
``device_secrets.broker_files`` says for Mosquitto): a device reads only its own desired topic and writes
only its own reported, events, status and telemetry topics; the control plane reads and writes
``cascade/v1/#``. Both keep retained messages across a restart of the broker.

- Mosquitto runs as a child process, its files in
  ``<root>/broker/``: mosquitto.conf, passwd, acl, mosquitto.log, data/ (persistence). It learns
  of devices enrolled after the start only through ``refresh()`` (new files, SIGHUP). It gets
  SIGTERM when the *thread* that called ``start()`` ends (PR_SET_PDEATHSIG, so no orphan outlives
  a killed control plane): call it from the main thread, not from a short-lived worker thread.
- The embedded broker runs on a thread of its own and checks each CONNECT against the
  DeviceStore, so a device enrolled later connects at once. Retained messages are kept in
  ``<root>/broker/retained.db``; the queued QoS 1 messages of offline persistent sessions are in
  memory only (lost when the broker restarts; the control plane sends all desired state again
  at each reconnect anyway).
"""

from __future__ import annotations

import getpass
import logging
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cascade.processes import free_port, spawn, stop
from model_distribution.control_plane.broker_acl import MAX_PACKET_BYTES
from model_distribution.control_plane.mosquitto_files import broker_files
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import CONTROL_PLANE_USER

log = logging.getLogger(__name__)

PREFER = ("auto", "mosquitto", "embedded")
MAX_QUEUED = 200_000  # QoS 1 messages Mosquitto queues for one client (the control plane) before it drops
MAX_QUEUED_BYTES = 256 << 20  # ... and bytes: one device's flood of large records must not grow the broker by GBs


@dataclass
class TLSListener:
    """A second listener with TLS (devices connect with mqtts://): where, and its PEM certificate
    chain and key. ``port`` 0 picks a free port."""

    host: str
    port: int
    certfile: Path | str
    keyfile: Path | str


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")


class FleetBroker:
    """One broker for the fleet: start(), url, refresh(), stop(). See the module docstring."""

    def __init__(self, root: Path | str, host: str = "127.0.0.1", port: int = 1883,
                 credentials: tuple[str, str] | None = None, prefer: str = "auto", tls: TLSListener | None = None):
        if prefer not in PREFER:
            raise ValueError(f"prefer must be one of {', '.join(PREFER)}, not {prefer!r}")
        if credentials is None or not all(credentials):
            raise ValueError("the broker needs the control plane's credentials (user, secret)")
        self.root, self.dir = Path(root), Path(root) / "broker"
        self.host, self.port = host, port
        self.credentials = credentials
        self.prefer = prefer
        self.tls = tls
        self.kind: str | None = None  # "mosquitto" or "embedded", once started
        self._store: DeviceStore | None = None
        self._proc = None
        self._embedded = None
        self._following: threading.Event | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    @property
    def tls_url(self) -> str | None:
        if self.tls is None:
            return None
        host = f"[{self.tls.host}]" if ":" in self.tls.host else self.tls.host
        return f"mqtts://{host}:{self.tls.port}"

    def start(self) -> str:
        """Start the broker; its URL once it accepts connections. RuntimeError when it cannot
        (``prefer="mosquitto"`` without one, the port taken, ...)."""
        mosquitto = find_mosquitto() if self.prefer != "embedded" else None
        if self.prefer == "mosquitto" and mosquitto is None:
            raise RuntimeError("no mosquitto on PATH or in /usr/sbin (apt-get install mosquitto)")
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.tls is not None and self.tls.port == 0:
            self.tls.port = free_port(self.tls.host)
        self._store = DeviceStore(self.root)
        try:
            if mosquitto:
                self._start_mosquitto(mosquitto)
            else:
                self._start_embedded()
        except BaseException:
            self.stop()
            raise
        return self.url

    def refresh(self) -> None:
        """Let devices enrolled since the start connect. Mosquitto: rewrite passwd and ACL, SIGHUP,
        and wait until it has reread them. The embedded broker asks the DeviceStore at each CONNECT."""
        if self.kind != "mosquitto":
            return
        broker_files(self._store, self.dir, *self.credentials)
        seen = (self.dir / "mosquitto.log").stat().st_size
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        # mosquitto is single-threaded: once it logged the reload, every later CONNECT sees the new files
        while "Reloading config." not in self._log_text(seen):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not reload its files:\n{self._log_tail()}")
            time.sleep(0.02)

    def follow_enrolments(self, every_s: float = 2.0) -> None:
        """Mosquitto: ``refresh()`` whenever the enrolled devices change (``cascade fleet devices add``
        runs in another process), from a thread of its own until ``stop()``."""
        if self.kind != "mosquitto":
            return

        def watch(stopped: threading.Event) -> None:
            known = self._store.broker_entries()
            while not stopped.wait(every_s):
                try:
                    now = self._store.broker_entries()
                    if now != known:
                        self.refresh()
                        known = now
                        log.info("the broker knows %d device(s)", len(now))
                except Exception:  # the broker keeps the old files; tried again next round
                    log.exception("cannot give the broker the enrolled devices")

        self._following = threading.Event()
        threading.Thread(target=watch, args=(self._following,), name="broker-enrolments", daemon=True).start()

    def stop(self) -> None:
        """Stop the broker (Mosquitto saves its retained messages on the way out). Idempotent."""
        if self._following is not None:
            self._following.set()
            self._following = None
        if self._proc is not None:
            stop(self._proc)
            self._proc = None
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
        if self._store is not None:
            self._store.close()
            self._store = None
        self.kind = None

    def _start_mosquitto(self, binary: str) -> None:
        if self.port == 0:
            self.port = free_port(self.host)
        passwd, acl = broker_files(self._store, self.dir, *self.credentials)
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        conf = self.dir / "mosquitto.conf"
        # as root, mosquitto would drop to user "mosquitto", who may not write our folder: stay who we are
        tls = "" if self.tls is None else (f"listener {self.tls.port} {self.tls.host}\ncertfile {self.tls.certfile}\n"
                                           f"keyfile {self.tls.keyfile}\n")
        conf.write_text(f"listener {self.port} {self.host}\n{tls}allow_anonymous false\npassword_file {passwd}\n"
                        f"acl_file {acl}\npersistence true\npersistence_location {data}/\n"
                        # a connection's client id is its user: no login can take another identity's session
                        "use_username_as_clientid true\n"
                        f"max_packet_size {MAX_PACKET_BYTES}\n"
                        # a fleet's reports arrive in bursts (~14 per device per change): Mosquitto's default
                        # queue of 1,000 per client dropped most of 1,000 devices' reports to the control plane
                        f"max_queued_messages {MAX_QUEUED}\nmax_queued_bytes {MAX_QUEUED_BYTES}\n"
                        # a device's QoS 0 flood would go to the control plane at QoS 0, which Mosquitto buffers
                        # for a slow subscriber without bound (GBs in seconds); at the subscription's QoS 1 it
                        # goes through the queue that max_queued_bytes bounds
                        "upgrade_outgoing_qos true\n"
                        f"log_dest file {self.dir / 'mosquitto.log'}\nuser {getpass.getuser()}\n")
        self._proc = spawn([binary, "-c", str(conf)], log=self.dir / "mosquitto.out", die_with_parent=True)
        deadline = time.monotonic() + 10
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited ({self._proc.returncode}):\n{self._log_tail()}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mosquitto did not listen on {self.url}:\n{self._log_tail()}") from None
                time.sleep(0.05)
        self.kind = "mosquitto"
        log.info("MQTT broker: Mosquitto (%s) on %s, its files in %s", binary, self.url, self.dir)

    def _start_embedded(self) -> None:
        from model_distribution.control_plane.embedded_broker import EmbeddedBroker

        self._embedded = EmbeddedBroker(self._store, self.host, self.port, self.credentials,
                                        self.dir / "retained.db", self.tls)
        try:
            self.port = self._embedded.start()
        except Exception as e:
            raise RuntimeError(f"the embedded MQTT broker did not start on {self.url}: {e}") from e
        self.kind = "embedded"
        log.info("MQTT broker: embedded (amqtt, no Mosquitto used) on %s, retained messages in %s",
                 self.url, self.dir / "retained.db")

    def _log_text(self, offset: int = 0) -> str:
        path = self.dir / "mosquitto.log"
        if not path.is_file():
            return ""
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def _log_tail(self, lines: int = 20) -> str:
        out = self.dir / "mosquitto.out"
        text = self._log_text() + (out.read_text(errors="replace") if out.is_file() else "")
        return "\n".join(text.splitlines()[-lines:])


def control_plane_credentials(keys_dir: Path) -> tuple[str, str]:
    """The control plane's own broker user and secret (made once, kept beside the keys, mode 0600)."""
    import os
    import secrets

    path = Path(keys_dir) / "mqtt-control-plane.secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
    return CONTROL_PLANE_USER, path.read_text().strip()
