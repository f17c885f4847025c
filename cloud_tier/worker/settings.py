"""The settings ``cascade cloud serve`` hands a worker it starts (``python -m cloud_tier.worker``, with
them in ``$CASCADE_WORKER_SETTINGS``): one JSON object with the whole configuration it resolved from its file, its
environment and its flags (``CloudConfig.to_dict``), and its log level."""

from __future__ import annotations

import json
from typing import Any

from cloud_tier.config import CloudConfig

SETTINGS_ENV = "CASCADE_WORKER_SETTINGS"


def worker_settings(config: CloudConfig, log_level: str) -> str:
    return json.dumps({"log_level": log_level, "config": config.to_dict()})


def read_settings(text: str) -> tuple[CloudConfig, str]:
    """The configuration and the log level in SETTINGS (ValueError, TypeError or KeyError if it is not one)."""
    data: dict[str, Any] = json.loads(text)
    return CloudConfig.from_dict(data["config"]), data["log_level"]
