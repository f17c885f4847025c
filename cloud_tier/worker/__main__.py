"""``python -m cloud_tier.worker SETTINGS``: a worker that ``cascade cloud serve`` starts on its
own host (``cloud_tier.worker.processes``). An internal entry point, not a user command (that is
``cascade cloud worker``): SETTINGS is the JSON of ``cloud_tier.worker.settings``, so the worker
reads no config file and parses no flags."""

from __future__ import annotations

import logging
import sys

from cloud_tier.worker.settings import read_settings


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            raise ValueError("one argument, the worker's settings as JSON")
        config, log_level = read_settings(args[0])
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
