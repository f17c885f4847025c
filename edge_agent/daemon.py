"""``cascade edge run``: serve the edge agent's API with uvicorn until stopped."""

from __future__ import annotations

import logging

from edge_agent.config import EdgeConfig

log = logging.getLogger(__name__)


def run(config: EdgeConfig) -> None:
    """Serve until stopped. Raises ModelNotFound before binding if the model is not here."""
    import uvicorn

    from cascade.config import cascade_home
    from edge_agent.server.app import build_app
    from model_distribution.catalog import Catalog

    catalog = Catalog(cascade_home(), config.model.search_paths)
    catalog.get(config.model.name)  # fail fast, with the models that are here named
    app = build_app(config, catalog)
    log.info("edge agent on http://%s:%d (model %s)", config.server.host, config.server.port,
             config.model.name)
    uvicorn.run(app, host=config.server.host, port=config.server.port,
                log_level=config.server.log_level, timeout_graceful_shutdown=5)
