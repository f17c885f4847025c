"""Whether the agent uses its configured router: only one calibrated for the model it serves (the
same name, and the same GGUF sha256 when the router names one). Any other falls back to the
configured confidence thresholds, said once in the log and always in ``/healthz`` (``router``).

The GGUF's sha256 is computed once per file (about a second for a 0.5B Q4 model on one core):
at start-up when a router is configured, else in the background when `cascade calibrate` asks
for it (``/healthz?sha256=1``), so an agent that never routes never pays for it."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from cascade.policy.router import Router

log = logging.getLogger(__name__)


def file_sha256(path: str) -> str:
    """The file's sha256, "" when it is not a file (an ONNX export directory) or cannot be read."""
    p = Path(path)
    if not p.is_file():
        return ""
    try:
        with p.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return ""


class RouterGate:
    """The router in effect for a served model, given the configured one."""

    def __init__(self, model: str, path: str):
        self.model, self.path = model, path
        self._sha256: str | None = None
        self._hashing: threading.Thread | None = None
        self._lock = threading.Lock()
        self._judged: tuple[int, bool] | None = None  # (id of the router judged, whether it matches)
        self.reason = ""

    @property
    def known_sha256(self) -> str | None:
        """The digest if it was computed already (None otherwise); never starts the hash."""
        return self._sha256

    def sha256(self, wait: bool = True) -> str | None:
        """The served GGUF's sha256; with ``wait`` False, None until a background hash is done."""
        if self._sha256 is not None:
            return self._sha256
        if wait:
            digest = file_sha256(self.path)
            with self._lock:
                self._sha256 = digest
            return digest
        with self._lock:
            if self._hashing is None:
                self._hashing = threading.Thread(target=self.sha256, name="model-sha256", daemon=True)
                self._hashing.start()
        return None

    def active(self, router: Router | None) -> Router | None:
        """``router`` when it was calibrated for the served model, else None (logged once per router)."""
        if router is None:
            return None
        if self._judged is None or self._judged[0] != id(router):
            ok = router.matches(self.model, self.sha256() if router.edge_sha256 else "")
            self._judged = (id(router), ok)
            if ok:
                self.reason = ""
                log.info("router on: calibrated for %s, thresholds %.3f (before generating) / %.3f (after %d "
                         "tokens)", router.edge_model, router.stage1_threshold, router.stage2_threshold, router.window)
            else:
                what = router.edge_model + (f" (sha256 {router.edge_sha256[:12]})" if router.edge_sha256 else "")
                self.reason = (f"calibrated for {what}, this agent serves {self.model}"
                               + (f" (sha256 {(self._sha256 or '')[:12]})" if router.edge_sha256 else ""))
                log.warning("router off: it was %s; the configured confidence thresholds apply", self.reason)
        return router if self._judged[1] else None

    def status(self, router: Router | None) -> dict | None:
        """What /healthz says of the router: None without one."""
        if router is None:
            return None
        on = self.active(router) is not None
        return {"active": on, "edge_model": router.edge_model, "edge_sha256": router.edge_sha256 or None,
                "stage1_threshold": router.stage1_threshold, "stage2_threshold": router.stage2_threshold,
                "window": router.window, "reason": None if on else f"router off: {self.reason}"}
