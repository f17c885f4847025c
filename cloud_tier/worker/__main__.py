"""``python -m cloud_tier.worker``: a worker that ``cascade cloud serve`` starts on its own host
(``cloud_tier.worker.processes``). An internal entry point, not a user command (that is ``cascade cloud
worker``): its settings are the JSON of ``cloud_tier.worker.settings`` in ``$CASCADE_WORKER_SETTINGS``
(not the command line, which every user of the host can read), so it reads no config file and parses
no flags."""

from __future__ import annotations

import logging
import os
import sys

from cloud_tier.worker.settings import SETTINGS_ENV, read_settings


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    settings = os.environ.pop(SETTINGS_ENV, None)  # not handed on to anything the worker starts
    try:
        if args or settings is None:
            raise ValueError(f"no arguments, and the worker's settings as JSON in ${SETTINGS_ENV}")
        config, log_level = read_settings(settings)
    except (ValueError, TypeError, KeyError) as e:
        print(f"cloud_tier.worker: bad settings: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to a worker is noise
    from cloud_tier.worker import daemon
    from model_distribution.artifacts.catalog import ModelNotFound

    try:
        daemon.run(config)
    except (ModelNotFound, NotImplementedError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
