"""``cascade edge run``: serve the edge agent's API with uvicorn until stopped, as a service.

Under systemd (``Type=notify``, see edge_agent/service_unit.py) it says ``READY=1`` once the
model is loaded and the port listens, pings the watchdog from the event loop, and says
``STOPPING=1`` at SIGTERM. SIGTERM drains: no new connections, in-flight requests (streams too)
get ``[server] drain_timeout_s`` to finish, then the offline queue is closed and the process
exits 0. SIGHUP reloads the configuration (edge_agent/server/reload.py). Logs go to standard
output, as text or one JSON object per line."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import signal
import sys
from collections.abc import Callable

from edge_agent.config import AgentServerConfig, EdgeConfig
from edge_agent.sd_notify import Notifier
from edge_agent.server.reload import ConfigSource, hold_sighup

log = logging.getLogger(__name__)
END_GRACE_S = 2.0  # after the drain time: for the answers still in flight to write their error and end
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord's own attributes: whatever else a record carries came as ``extra=`` and goes into the JSON
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
_SYSLOG = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JSONFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, msg, the record's extra
    fields, and exc (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and k not in out})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class JournalFormatter(logging.Formatter):
    """Plain lines for journald: no timestamp (the journal stamps each line), the level as the
    ``<N>`` syslog prefix journald turns into the entry's priority."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_SYSLOG.get(record.levelno, 6)}>{record.name}: {super().format(record)}"


def under_journal(environ=os.environ, stream=sys.stdout) -> bool:
    """Whether ``stream`` is the journal's: ``$JOURNAL_STREAM`` names its device and inode."""
    want = environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


def formatter(log_format: str, journal: bool) -> logging.Formatter:
    if log_format == "json":
        return JSONFormatter()
    return JournalFormatter() if journal else logging.Formatter(TEXT_FORMAT)


def setup_logging(server: AgentServerConfig) -> None:
    """The root logger writes to standard output in ``[server] log_format``; uvicorn's loggers
    go through it (uvicorn is given no logging config of its own)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter(server.log_format, under_journal()))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, speaking to the service manager. SIGTERM (or Ctrl-C) drains and the
        process exits 0: uvicorn would re-raise the signal once it has shut down, which makes a
        clean stop look like death by signal (143)."""

        def __init__(self, config: uvicorn.Config, notifier: Notifier, serving: str, drain_s: float,
                     end_drain: Callable[[], None]):
            super().__init__(config)
            self.notifier, self.serving = notifier, serving
            self.drain_s, self.end_drain = drain_s, end_drain
            self._watchdog: asyncio.Task | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)  # the lifespan (the model loads), then the port listens
            if self.started and not self.should_exit:
                self.notifier.notify(READY=1, STATUS=f"serving {self.serving}")
                if self.notifier.watchdog_s is not None:
                    self._watchdog = asyncio.create_task(self.notifier.watchdog(), name="watchdog")

        async def shutdown(self, sockets=None) -> None:
            # uvicorn waits drain_s + END_GRACE_S, then cancels what runs (a cut stream); at drain_s
            # the answers still in flight end in-band instead, and their generations stop
            deadline = asyncio.get_running_loop().call_later(self.drain_s, self._end_drain)
            try:
                await super().shutdown(sockets)  # drain, then the lifespan's end (the queue closes)
            finally:
                deadline.cancel()
                if self._watchdog is not None:
                    self._watchdog.cancel()

        def _end_drain(self) -> None:
            n = len(self.server_state.tasks)
            if n:
                log.warning("drain time (%.0f s) is over: ending %d answer(s) with an error", self.drain_s, n)
            self.end_drain()

        def handle_exit(self, sig: int, frame) -> None:
            if self.should_exit:
                self.force_exit = self.force_exit or sig == signal.SIGINT  # a second Ctrl-C: stop now
                return
            self.should_exit = True
            n = len(self.server_state.tasks)
            drain = self.drain_s
            log.info("%s: draining %d request(s), for up to %.0f s", signal.Signals(sig).name, n, drain)
            self.notifier.notify(STOPPING=1, STATUS=f"draining {n} request(s), up to {drain:.0f} s")

    return Server


def run(config: EdgeConfig, source: ConfigSource | None = None) -> None:
    """Serve until stopped. Raises ModelNotFound (OnnxModelError, MixedOnnxRuntime for [model]
    backend onnx) before binding if the model is not here.
    ``source`` is where ``config`` came from: SIGHUP reads it again."""
    import uvicorn

    from cascade.config import cascade_home
    from edge_agent.server.app import build_app, locate_model
    from model_distribution.artifacts.catalog import Catalog

    setup_logging(config.server)
    catalog = Catalog(cascade_home(), config.model.search_paths)
    locate_model(config, catalog)  # fail fast, with the models that are here named (or why an export is not one)
    app = build_app(config, catalog, source)
    s = config.server
    serving = f"{config.model.name} on http://{s.host}:{s.port}"
    notifier = Notifier()
    notifier.notify(STATUS=f"loading {config.model.name}")
    log.info("edge agent on http://%s:%d (model %s)", s.host, s.port, config.model.name)
    uv = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, log_config=None,
                        timeout_graceful_shutdown=s.drain_timeout_s + END_GRACE_S)
    hold_sighup()  # the lifespan installs the reload handler once the agent serves
    quiet = _StartupErrorFilter(app)  # its one line comes from the command, not a traceback from uvicorn
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        _server_class()(uv, notifier, serving, s.drain_timeout_s, app.state.drain.end).run()
    except SystemExit:  # uvicorn exits 3 when the startup fails
        if getattr(app.state, "startup_error", None) is None:
            raise
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
        notifier.notify(STATUS="stopped")
        notifier.close()
    if (error := getattr(app.state, "startup_error", None)) is not None:
        raise error  # a ModelNotFound: the command prints it and exits 2


class _StartupErrorFilter(logging.Filter):
    """Drops uvicorn's report of a startup that failed on a model the agent could not load (the
    traceback, "Application startup failed"): the command says it in one line instead."""

    def __init__(self, app):
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(self.app.state, "startup_error", None) is None
