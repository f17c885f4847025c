"""SIGHUP: read the configuration again and apply what can change while serving.

What a reload applies: the ``[cascade]`` thresholds and modes (the Escalator's ``config`` and
``policy``, the keys the file changed, so thresholds a fleet version calibrated stay where the
file is silent) and the ``[upstream]`` section (a new cloud client swapped into the escalator
and the delivery loop; the old one is closed once nothing runs on it). Requests in flight keep
what they started with; nothing is dropped and the model is not reloaded. Everything else (the
model, the server, the queue, MQTT, the fleet, this device's name) is logged as needing a
restart and left as it runs. A file that no longer loads changes nothing: the agent keeps
serving on the configuration it has and says why in the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

from cascade.config import ConfigError
from edge_agent.config import EdgeConfig
from edge_agent.sd_notify import Notifier
from edge_agent.server.escalation import Escalator, policy_config
from edge_agent.server.outbox import Outbox
from edge_agent.upstream import Upstream

log = logging.getLogger(__name__)
SECRET_KEYS = {"api_key", "password", "secret"}
IDLE_CHECKS = 3  # an old cloud client is closed after this many idle looks in a row ...
IDLE_CHECK_S = 0.5  # ... this far apart


@dataclass(frozen=True)
class ConfigSource:
    """Where the running configuration came from, so a reload reads it the same way: the file
    (None: defaults and the environment only) under the same command-line flags."""

    path: str | None
    overrides: dict = field(default_factory=dict)

    def load(self) -> EdgeConfig:
        return EdgeConfig.load(self.path, self.overrides)


def changes(old: EdgeConfig, new: EdgeConfig) -> dict[str, dict[str, tuple[Any, Any]]]:
    """``{section: {key: (old, new)}}`` for every key whose value differs."""
    out: dict[str, dict[str, tuple[Any, Any]]] = {}
    for section in dataclasses.fields(EdgeConfig):
        a, b = getattr(old, section.name), getattr(new, section.name)
        diff = {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
                if getattr(a, f.name) != getattr(b, f.name)}
        if diff:
            out[section.name] = diff
    return out


@dataclass
class ReloadPlan:
    """What a reload does: the changes, the ``[cascade]`` keys to set, whether the cloud client is
    rebuilt, and the changes left for a restart (``"section.key"``)."""

    diff: dict[str, dict[str, tuple[Any, Any]]]
    cascade: dict[str, Any] = field(default_factory=dict)
    upstream: bool = False
    restart: list[str] = field(default_factory=list)

    @property
    def applied(self) -> list[str]:
        return [f"{s}.{k}" for s, keys in self.diff.items() for k in keys if f"{s}.{k}" not in self.restart]


def plan(old: EdgeConfig, new: EdgeConfig) -> ReloadPlan:
    p = ReloadPlan(changes(old, new))
    clouds = bool(old.upstream.url), bool(new.upstream.url)  # turning the cloud on or off needs a restart
    for section, keys in p.diff.items():
        for key, (_, after) in keys.items():
            if section == "cascade" and key != "device":  # the device name is in topics and headers
                p.cascade[key] = after
            elif section == "upstream" and clouds == (True, True):
                p.upstream = True
            elif section == "upstream" and clouds == (False, False):
                pass  # no cloud, no client: the value is kept for when there is one
            else:
                p.restart.append(f"{section}.{key}")
    return p


def describe(diff: dict[str, dict[str, tuple[Any, Any]]], keys: list[str] | None = None) -> str:
    """``[cascade] min_mean_logprob -inf -> -1.0, ...``, secrets masked."""
    parts = []
    for section, changed in diff.items():
        for key, (before, after) in changed.items():
            if keys is not None and f"{section}.{key}" not in keys:
                continue
            if key in SECRET_KEYS:
                before, after = ("***" if before else ""), ("***" if after else "")
            parts.append(f"[{section}] {key} {before!r} -> {after!r}")
    return ", ".join(parts)


def hold_sighup() -> None:
    """Until the reload handler is installed (and after it is removed), a SIGHUP is logged and
    ignored rather than ending the process, its default."""
    signal.signal(signal.SIGHUP, lambda *_: log.warning("SIGHUP while the agent is not serving: ignored"))


def idle(upstream: Upstream) -> bool:
    """No request open on the client: every connection of its pool idle. httpcore's
    ``connections`` is public; reaching the pool goes through httpx's transport, the one
    private step (an httpx without it reads as idle)."""
    pool = getattr(getattr(upstream.client, "_transport", None), "_pool", None)
    return pool is None or all(c.is_idle() or c.is_closed() for c in pool.connections)


class Reloader:
    """The running agent's reload: ``install()`` in the lifespan, ``close()`` at its end."""

    def __init__(self, source: ConfigSource, config: EdgeConfig, escalator: Escalator, outbox: Outbox,
                 notifier: Notifier | None = None):
        self.source, self.config = source, config  # the configuration as it runs
        self.escalator, self.outbox = escalator, outbox
        self.notifier = notifier or Notifier()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._retired: set[Upstream] = set()

    def install(self) -> Reloader:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.reload(), "reload"))
        return self

    async def close(self) -> None:
        """Stop taking SIGHUP; close the cloud clients a reload retired, idle or not (the
        server has drained by now)."""
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        hold_sighup()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for up in list(self._retired):
            await up.close()
        self._retired.clear()

    async def reload(self) -> bool:
        """Read the configuration again and apply it; True when it was applied."""
        async with self._lock:
            what = self.source.path or "the environment"
            self.notifier.reloading(f"reloading {what}")
            try:
                applied = await self._reload()
            except ConfigError as e:
                log.error("reload refused, the agent keeps its configuration: %s", e)
                applied = False
            except Exception:  # a difficulty model that does not load, ...: keep serving as before
                log.exception("reload of %s failed, the agent keeps its configuration", what)
                applied = False
            self.notifier.notify(READY=1, STATUS=f"serving; reload {'applied' if applied else 'refused'}")
            return applied

    async def _reload(self) -> bool:
        new = await asyncio.to_thread(self.source.load)
        p = plan(self.config, new)
        if p.restart:
            log.warning("reload: needs a restart, left as it runs: %s", describe(p.diff, p.restart))
        # from here on nothing awaits: a request (or a fleet switch's thresholds) sees the old
        # settings or the new ones, never a mix; a difficulty model is a small JSON file
        esc = self.escalator
        cascade = dataclasses.replace(esc.config, **p.cascade) if p.cascade else esc.config
        policy = policy_config(cascade) if p.cascade else esc.policy
        upstream = Upstream(new.upstream, self.config.cascade.device) if p.upstream else None
        esc.config, esc.policy = cascade, policy
        running = self.config
        self.config = dataclasses.replace(
            running, cascade=dataclasses.replace(new.cascade, device=running.cascade.device),
            upstream=running.upstream if "upstream.url" in p.restart else new.upstream)
        if upstream is not None:
            old = esc.upstream
            esc.upstream = upstream
            self.outbox.use_upstream(upstream)
            self._retired.add(old)
            self._spawn(self._close_when_idle(old), "close-upstream")
        if p.applied:
            log.info("reload applied: %s", describe(p.diff, p.applied))
        else:
            log.info("reload: nothing to apply from %s", self.source.path or "the environment")
        return True

    async def _close_when_idle(self, old: Upstream) -> None:
        quiet = 0
        while quiet < IDLE_CHECKS:
            await asyncio.sleep(IDLE_CHECK_S)
            quiet = quiet + 1 if idle(old) else 0
        self._retired.discard(old)
        await old.close()
        log.info("the previous cloud client (%s) is closed", old.base_url)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
