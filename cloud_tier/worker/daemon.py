"""``cascade cloud worker``: serve one engine with uvicorn until stopped."""

from __future__ import annotations

import logging

from cloud_tier.config import CloudConfig

log = logging.getLogger(__name__)

# Idle keep-alive connections stay open this long, well past the gateway's pool expiry
# (cloud_tier.gateway.workers.http_pool.KEEPALIVE_EXPIRY_S), so the gateway always drops an idle one first:
# at equal timeouts (uvicorn's 5 s and httpx's) a burst that came as the server closed the idle
# connections of the one before reused some as they closed (ReadError, a 502 for each).
KEEP_ALIVE_S = 30


def run(config: CloudConfig) -> None:
    import uvicorn

    from cloud_tier.worker.app import build_app

    log.info("cloud worker (%s) on http://%s:%d, model %s", config.worker.role, config.server.host,
             config.server.port, config.engine.model)
    check_model(config.engine.model)
    uvicorn.run(build_app(config), host=config.server.host, port=config.server.port,
                log_level=config.server.log_level, timeout_graceful_shutdown=5, access_log=False,
                timeout_keep_alive=KEEP_ALIVE_S)


def check_model(model: str) -> None:
    """The model found (a packaged one assembled, a GGUF converted) and of an architecture the engine
    runs, before uvicorn starts: ModelNotFound or NotImplementedError here reach the command line as
    one line and exit 2 (inside the app's startup they were a traceback)."""
    from cloud_tier.engine.models.loader import model_class, read_config
    from model_distribution.artifacts.model_dirs import resolve_model_dir

    model_class(read_config(resolve_model_dir(model)))
