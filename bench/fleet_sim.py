"""The device side of bench/fleet_rollout.py: simulated devices in a child process, each running
the real DeviceStateClient (its own paho client and loop thread) and DeviceUpdater (on a thread
of its own, as the agent's FleetFollower runs it), activation = a sha256 check of the file.
Several such processes share the devices so that the device side is not one GIL.

The parent talks to ``serve(...)`` over a Pipe:
    child -> ("connected", n)                         every device of this process is connected
    child -> ("rollout", [Timeline, ...])             every device final (ACTIVE, REJECTED, FAILED for
                                                      good), or when the parent sends ("enough",)
    parent -> ("download", url, tag)  child -> ("download", [(start, end, error), ...])
        the same download (download.fetch) by every device at once, into ``<state>/<tag>``
    parent -> ("follow", sha256)      child -> ("following",)
        fresh timelines, about the change to that artifact only (bench/fleet_waves.py's rollout)
    parent -> ("timelines",)          child -> ("timelines", [Timeline, ...])
    parent -> ("stop",)
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import shutil
import threading
import time
from pathlib import Path

from tuf.api.metadata import TargetFile

from model_distribution.artifacts.download import fetch
from model_distribution.device.client import DeviceConfig, DeviceUpdater
from model_distribution.device.state_client import DeviceStateClient
from model_distribution.registry.store import file_sha256
from sync.mqtt_link import stop_loop

RETRY_MIN_S, RETRY_MAX_S = 5.0, 300.0  # as edge_agent/server/fleet.py


@dataclasses.dataclass
class Timeline:
    """When (time.time()) each step of one device's change happened; 0.0: it did not."""

    device: str
    desired: float = 0.0  # the signed document arrived (paho's thread)
    downloading: float = 0.0  # the TUF metadata verified, the download starts
    verifying: float = 0.0  # the last byte arrived
    activating: float = 0.0  # the file verified against its signed target
    active: float = 0.0
    final: str = ""  # the last state reported
    reason: str = ""
    retries: int = 0  # cut downloads tried again


class SimDevice:
    """One device: the agent's FleetFollower minus the model (``activate`` checks the file's
    sha256), with the time of each step it reports."""

    def __init__(self, name: str, secret: str, broker: str, http: str, root_json: bytes, public_key: bytes,
                 state_dir: Path, mirror: str = ""):
        self.timeline = Timeline(name)
        self.want = ""  # the sha256 the timeline follows ("": any change)
        self.state_dir = state_dir
        self.done = threading.Event()
        self.client = DeviceStateClient(broker, "default", name, public_key, self._desired, name, secret)
        urls = {"artifact_url": f"{mirror}/v1/artifacts", "metadata_url": f"{mirror}/v1/tuf/"} if mirror else {}
        self.updater = DeviceUpdater(DeviceConfig(name, http, root_json, state_dir, secret=secret, **urls),
                                     self._report, self._activate)
        self._wanted: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"updater-{name}", daemon=True)
        self._worker.start()

    def follow(self, sha256: str) -> None:
        """A fresh timeline, about the change to ``sha256`` only: a document that still wants the
        old version (one that asks for a prefetch) is no step of it."""
        self.want, self.timeline = sha256, Timeline(self.timeline.device)

    def _desired(self, payload: dict) -> None:  # paho's thread: hand over, never block it
        if not self.want or payload.get("sha256") == self.want:
            self.timeline.desired = self.timeline.desired or time.time()
        self._wanted.put(payload)

    def _work(self) -> None:
        """FleetFollower._work (edge_agent/server/fleet.py): the newest assignment; a cut download is
        tried again after a growing pause."""
        payload, pause = self._wanted.get(), RETRY_MIN_S
        while payload is not None:
            while not self._wanted.empty():
                payload = self._wanted.get()
                if payload is None:
                    return
            self.updater.apply(payload)
            if not self.updater.retry:
                payload, pause = self._wanted.get(), RETRY_MIN_S
                continue
            self.timeline.retries += 1
            try:
                payload = self._wanted.get(timeout=pause)
                pause = RETRY_MIN_S
            except queue.Empty:
                pause = min(pause * 2, RETRY_MAX_S)

    def _report(self, state: dict) -> None:
        t, s = self.timeline, state["state"]
        if not (self.want and s == "ACTIVE" and state.get("sha256") != self.want):  # not the old version still
            attr = s.lower()
            if hasattr(t, attr) and not getattr(t, attr):
                setattr(t, attr, time.time())
            t.final, t.reason = s, state.get("reason", "")
        self.client.report(state)
        if s in ("ACTIVE", "REJECTED") or (s == "FAILED" and not self.updater.retry):
            self.done.set()

    def _activate(self, path: Path, manifest: dict) -> None:
        if file_sha256(path)[0] != manifest["sha256"]:
            raise RuntimeError(f"{path} is not the signed artifact")

    def stop(self) -> None:
        self._wanted.put(None)
        stop_loop(self.client.link.client)


def _download_all(devices: list[SimDevice], url: str, tag: str, info: TargetFile) -> list[tuple]:
    """Every device fetches ``url`` at once (one thread each, as in the rollout), with its
    credentials where the updater would send them (to the control plane, not to a mirror)."""
    out: list[tuple] = [None] * len(devices)  # type: ignore[list-item]
    go = threading.Barrier(len(devices))

    def one(i: int, d: SimDevice) -> None:
        go.wait()
        start = time.time()
        try:
            fetch(url, d.state_dir / tag / "artifact", info, auth=d.updater.config.auth_for(url))
            out[i] = (start, time.time(), "")
        except Exception as e:  # noqa: BLE001 (measured and reported, not raised)
            out[i] = (start, time.time(), repr(e))
        shutil.rmtree(d.state_dir / tag, ignore_errors=True)

    threads = [threading.Thread(target=one, args=(i, d)) for i, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serve(conn, devices: list[tuple[str, str]], broker: str, http: str, root_json: bytes, public_key: bytes,
          state_root: str, sha256: str, size: int, mirror: str, log: str) -> None:
    """A child process's life: its devices connect, follow the rollout (metadata and artifacts
    from ``mirror`` when given, else from the control plane), then run the downloads the parent
    asks for, until "stop"."""
    logging.basicConfig(level=logging.WARNING, filename=log)  # a REJECTED per device: not on the terminal
    threading.stack_size(512 << 10)  # thousands of threads: small stacks
    sims = [SimDevice(name, secret, broker, http, root_json, public_key, Path(state_root) / name, mirror)
            for name, secret in devices]
    for d in sims:
        d.client.start()
    while not all(d.client.connected.is_set() for d in sims):
        time.sleep(0.05)
    conn.send(("connected", len(sims)))
    while not all(d.done.is_set() for d in sims):
        if conn.poll(0.1):  # the parent gave up waiting
            conn.recv()
            break
    conn.send(("rollout", [d.timeline for d in sims]))
    info = TargetFile(size, {"sha256": sha256}, "artifact")
    while (msg := conn.recv())[0] != "stop":
        if msg[0] == "follow":
            for d in sims:
                d.follow(msg[1])
            conn.send(("following",))
        elif msg[0] == "timelines":
            conn.send(("timelines", [d.timeline for d in sims]))
        else:
            _, url, tag = msg
            conn.send(("download", _download_all(sims, url, tag, info)))
    for d in sims:
        d.stop()
    conn.send(("stopped",))
