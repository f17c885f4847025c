"""``cascade cloud serve``: the gateway in front of workers it starts here (prefill, decode,
both) or of ``workers`` started elsewhere, until stopped. With ``workers`` given, nothing here
needs torch: a gateway-only install runs it."""

from __future__ import annotations

import logging
import signal

from cloud_tier.config import CloudConfig

log = logging.getLogger(__name__)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(config: CloudConfig) -> None:
    g = config.gateway
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with the default handler
    # that would end this process before the workers it started are stopped
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    urls = [u.strip() for field in (g.workers, g.prefill_workers, g.decode_workers)
            for u in field.split(",") if u.strip()]
    children = None
    if not urls and not g.k8s_discovery:
        from cloud_tier.worker.processes import WorkerProcesses

        children = WorkerProcesses(config)
    try:
        urls = urls or (children.start() if children is not None else [])
        log.info("cloud gateway on http://%s:%d in front of %s", g.host, g.port,
                 ", ".join(urls) or f"the pods k8s discovery finds ({g.k8s_selector or 'by role'})")
        _serve(config, urls)
    finally:
        if children is not None:
            children.stop()


def _serve(config: CloudConfig, urls: list[str]) -> None:
    """uvicorn's run, with the app told when a signal stops the server during its startup (uvicorn only
    notes the signal until the startup ends, and the gateway may wait minutes for its workers): the
    startup gives up at once, and the process ends as a signalled one (143), not as a failed start (3)."""
    import uvicorn

    from cloud_tier.gateway.http.app import build_app

    g = config.gateway
    server: list[uvicorn.Server] = []
    told: list[bool] = []

    def stopping() -> bool:
        if server and server[0].should_exit:
            told.append(True)
        return bool(told)

    server.append(uvicorn.Server(uvicorn.Config(build_app(config, urls, stopping=stopping), host=g.host, port=g.port,
                                                log_level=config.server.log_level, timeout_graceful_shutdown=5,
                                                access_log=False)))
    try:
        server[0].run()
    except SystemExit:
        if told:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    if not server[0].started:  # as uvicorn.run: the application's startup failed
        raise SystemExit(3)
