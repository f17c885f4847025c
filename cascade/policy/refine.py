"""Refinement: an app that accepts a degraded local answer (the cloud could not be reached)
may ask for the cloud's answer as well (``"refine": true``); the request is then also queued
for the cloud, and the local answer points at it."""

from __future__ import annotations


def wants_refinement(degraded: bool, requested: bool, upstream: bool) -> bool:
    """Queue a refinement: the local answer was degraded, the app asked, and a cloud exists."""
    return degraded and requested and upstream
