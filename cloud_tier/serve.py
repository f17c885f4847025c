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


def run(config: CloudConfig, config_path: str | None = None) -> None:
    import uvicorn

    from cloud_tier.gateway.http.app import build_app

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
        uvicorn.run(build_app(config, urls), host=g.host, port=g.port, log_level=config.server.log_level,
                    timeout_graceful_shutdown=5, access_log=False)
    finally:
        if children is not None:
            children.stop()
