"""A fleet command's control plane on another host (``--url``, $CASCADE_FLEET_URL): its admin API
(``/v1/fleet``) runs the same operations as the local state, so ``cascade fleet`` and ``cascade
fleet rollout`` print the same either way. The one home of the remote-call code both groups use."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CLIENT_ENV = ("CASCADE_FLEET_URL", "CASCADE_FLEET_ADMIN_KEY")  # the client's, not fleet.toml overrides


class Refused(Exception):
    """A remote call that did not go through: the message (one line) and the exit code (2: the
    caller's, an unreachable control plane or a refused key; 1: the server failed)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


class RemoteControlPlane:
    """The admin API (``/v1/fleet``) of a control plane on another host: what the local commands
    do, run there by the same operations."""

    def __init__(self, url: str, admin_key: str):
        from urllib.parse import urlsplit

        import httpx

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise Refused(f"--url must be http(s)://HOST[:PORT], got {url!r}")
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=f"{self.url}/v1/fleet", timeout=httpx.Timeout(60.0, connect=10.0),
                                   headers={"Authorization": f"Bearer {admin_key}"} if admin_key else {})

    def call(self, method: str, path: str, **kwargs) -> dict:
        import httpx

        try:
            r = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise Refused(f"cannot reach the control plane at {self.url}: {e or e.__class__.__name__}") from e
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200] or r.reason_phrase
            hint = " (--admin-key or $CASCADE_FLEET_ADMIN_KEY)" if r.status_code in (401, 403) else ""
            raise Refused(f"{self.url}: HTTP {r.status_code}: {message}{hint}", 1 if r.status_code >= 500 else 2)
        try:
            return r.json()
        except ValueError as e:
            raise Refused(f"{self.url} answered HTTP {r.status_code} with no JSON: not a cascade control plane?",
                          1) from e

    def push(self, path: str, name: str, version: str, calibration: str | None,
             min_agent_version: str | None) -> dict:
        """Stream the file as the body of ``POST /v1/fleet/models`` (checked here first, so a typo
        is not found after gigabytes went over the network)."""
        import httpx

        from cascade.calibration import CalibrationError, check_calibration
        from model_distribution.registry.store import RegistryError, check_names, read_calibration

        file = Path(path)
        if file.is_dir():  # an ONNX export: sent as the one tar the registry makes of it (same sha256)
            import tempfile

            from model_distribution.artifacts.onnx_model import OnnxModelError, pack_onnx_dir

            with tempfile.TemporaryDirectory() as tmp:
                try:
                    check_names(name, version, min_agent_version)
                    pack_onnx_dir(file, Path(tmp) / "model.tar")
                except (RegistryError, OnnxModelError) as e:
                    raise Refused(str(e)) from e
                return self.push(str(Path(tmp) / "model.tar"), name, version, calibration, min_agent_version)
        try:
            check_names(name, version, min_agent_version)
            if not file.is_file():
                raise RegistryError(f"{file} is not a file (nor an ONNX export directory)")
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(file.stat().st_size)}
            if calibration is not None:  # checked here as the control plane will, its difficulty model inline
                table = check_calibration(read_calibration(calibration), Path(calibration).expanduser().parent)
                headers["X-Cascade-Calibration"] = json.dumps(table, allow_nan=False, separators=(",", ":"))
        except (RegistryError, CalibrationError) as e:
            raise Refused(str(e)) from e
        params = {"name": name, "version": version, **({"min_agent_version": min_agent_version}
                                                         if min_agent_version else {})}

        def chunks():
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk

        # the server hashes and stores the file before it answers: allow it the time
        return self.call("POST", "/models", params=params, content=chunks(), headers=headers,
                         timeout=httpx.Timeout(60.0, connect=10.0, read=900.0))


def remote_control_plane(args) -> RemoteControlPlane | None:
    """The control plane named by ``--url`` / $CASCADE_FLEET_URL, or None: the local state."""
    url = getattr(args, "url", None) or os.environ.get("CASCADE_FLEET_URL")
    if not url:
        return None
    return RemoteControlPlane(url, getattr(args, "admin_key", None) or os.environ.get("CASCADE_FLEET_ADMIN_KEY", ""))


def exit_on_refusal(cmd):
    """A command that may run remotely: a refused call is one line on stderr and its exit code."""
    def run(args) -> int:
        try:
            return cmd(args)
        except Refused as e:
            print(f"cascade: {e}", file=sys.stderr)
            return e.exit_code
    run.__name__, run.__doc__ = cmd.__name__, cmd.__doc__
    return run


def add_remote_flags(parser) -> None:
    # SUPPRESS: `devices --url U add D` and `devices add D --url U` both work (no subparser default wins)
    parser.add_argument("--url", default=argparse.SUPPRESS,
                        help="a control plane on another host, http://HOST:8090 (default: $CASCADE_FLEET_URL; "
                             "none: the state under $CASCADE_HOME/fleet)")
    parser.add_argument("--admin-key", default=argparse.SUPPRESS,
                        help="its [server] admin_key (default: $CASCADE_FLEET_ADMIN_KEY)")
