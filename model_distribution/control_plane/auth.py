"""Who is calling the control plane: the operator (bearer ``[server] admin_key``; with none set,
loopback callers only) or an enrolled device (HTTP Basic ``device_id:secret``, its own paths only),
and how a refused operation answers. Every router of the control plane checks callers here."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import Request

from cascade import errors
from cascade.web.requests import bearer_matches
from model_distribution.control_plane.credentials import basic_credentials
from model_distribution.fleet import operations
from model_distribution.registry.store import RegistryError


def require_admin(request: Request) -> None:
    expected = request.app.state.config.server.admin_key
    if expected:
        if not bearer_matches(request, expected):
            raise errors.unauthorized()
    elif request.client is None or request.client.host not in ("127.0.0.1", "::1"):
        raise errors.APIError(403, "set [server] admin_key to use the admin endpoints from another host",
                              "permission_error", None, "admin_key_required")


async def require_device(request: Request, device_id: str | None = None) -> None:
    """The device endpoints: HTTP Basic ``device_id:secret`` of an enrolled device, which may use
    only its own ``/v1/devices/{device}/...``; or the admin key as a bearer token."""
    state = request.app.state
    admin_key = state.config.server.admin_key
    if admin_key and bearer_matches(request, admin_key):
        return
    pair = basic_credentials(request.headers.get("authorization", ""))
    client = request.client.host if request.client else "-"  # the TCP peer (a trusted proxy's X-Forwarded-For)
    ok = pair is not None and state.credentials.cached(*pair)
    if pair is not None and not ok:
        verdict = await asyncio.to_thread(state.credentials.check, pair[0], pair[1], client)
        if verdict is not True and verdict:
            raise errors.APIError(429, f"too many wrong credentials for {pair[0]!r} from this address: try again "
                                  f"in {verdict:.0f} s", "rate_limit_error", None, "too_many_failures",
                                  {"Retry-After": str(max(1, round(verdict)))})
        ok = verdict is True
    if not ok:
        raise errors.APIError(401, "a device endpoint: send the device's enrolled credentials as HTTP Basic "
                              "device_id:secret", "authentication_error", None, "invalid_credentials",
                              {"WWW-Authenticate": 'Basic realm="cascade fleet", charset="UTF-8"'})
    if device_id is not None and pair[0] != device_id:
        raise errors.APIError(403, f"device {pair[0]!r} may use only its own /v1/devices/{pair[0]}/...",
                              "permission_error", "device", "other_device")


def refused(e: RegistryError, upload: Path | None = None) -> errors.APIError:
    """A refused operation as its HTTP error: 409 for what exists already, 404 for what does not, else 400."""
    message = str(e) if upload is None else str(e).replace(str(upload), "the uploaded file")
    if isinstance(e, (operations.ImmutableVersion, operations.Conflict)):
        return errors.APIError(409, message, "invalid_request_error", None, "conflict")
    if isinstance(e, operations.NotFound):
        return errors.APIError(404, message, "invalid_request_error", None, "not_found")
    return errors.bad_request(message, None, "invalid_value")
