"""``cascade cloud worker``: serve one engine with uvicorn until stopped."""

from __future__ import annotations

import logging

from cloud_tier.config import CloudConfig

log = logging.getLogger(__name__)


def run(config: CloudConfig) -> None:
    import uvicorn

    from cloud_tier.worker.app import build_app

    log.info("cloud worker (%s) on http://%s:%d, model %s", config.worker.role, config.server.host,
             config.server.port, config.engine.model)
    uvicorn.run(build_app(config), host=config.server.host, port=config.server.port,
                log_level=config.server.log_level, timeout_graceful_shutdown=5, access_log=False)
