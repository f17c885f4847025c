"""A device's side of the registry's TUF repository (signing.py): refresh the signed metadata
against the root the device was provisioned with and read one version's signed target (length,
sha256, and its manifest), over httpx with the device's credentials."""

from __future__ import annotations

from pathlib import Path

import httpx
from tuf.api.exceptions import DownloadError, DownloadHTTPError, SlowRetrievalError
from tuf.api.metadata import TargetFile
from tuf.ngclient import FetcherInterface, Updater

from model_distribution.registry.signing import SigningError, target_path


def verified_target(cache_dir: Path | str, metadata_url: str, trusted_root: bytes, name: str,
                    version: str, auth: tuple[str, str] | None = None, client: httpx.Client | None = None
                    ) -> TargetFile:
    """On a device: refresh the metadata from ``metadata_url`` against the root it trusts (kept
    in ``cache_dir``) and return the signed target info of ``name@version`` (length, hashes, and
    the manifest under ``custom``); ``auth``: the device's ``(device_id, secret)``, sent as HTTP
    Basic; ``client``: an httpx client to reuse (one per device: its connections and TLS context).
    Raises tuf's errors for anything refused (bad signatures, a rollback, expired metadata, a
    401), tuf's DownloadError for a network failure (worth trying again), and SigningError when
    the version is not a target."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    trusted = cache_dir / "root.json"
    bootstrap = trusted.read_bytes() if trusted.exists() else trusted_root
    fetcher = HTTPFetcher(client, auth)
    try:
        updater = Updater(str(cache_dir), metadata_url.rstrip("/") + "/", str(cache_dir / "targets"), None,
                          fetcher, bootstrap=bootstrap)
        updater.refresh()
    finally:
        fetcher.close()
    info = updater.get_targetinfo(target_path(name, version))
    if info is None:
        raise SigningError(f"{name}@{version} is not in the signed targets")
    return info


def manifest_of(info: TargetFile) -> dict:
    return (info.unrecognized_fields.get("custom") or {}).get("manifest") or {}


class HTTPFetcher(FetcherInterface):
    """python-tuf's metadata downloads over httpx (as the artifact download is), with the device's
    HTTP Basic credentials when it has them (the control plane's ``/v1/tuf`` wants them). Network
    failures are tuf's DownloadError kinds, with the URL and the cause."""

    def __init__(self, client: httpx.Client | None = None, auth: tuple[str, str] | None = None,
                 timeout_s: float = 30.0):
        self._own = client is None
        self._client = client or httpx.Client(timeout=timeout_s, follow_redirects=True)
        self._auth = auth

    def close(self) -> None:
        if self._own:
            self._client.close()

    def _fetch(self, url: str):
        try:
            r = self._client.send(self._client.build_request("GET", url), stream=True, auth=self._auth)
        except httpx.TimeoutException as e:
            raise SlowRetrievalError(f"GET {url}: {e!r}") from e
        except httpx.TransportError as e:
            raise DownloadError(f"GET {url}: {e!r}") from e
        if r.status_code >= 400:
            r.close()
            raise DownloadHTTPError(f"GET {url}: HTTP {r.status_code}", r.status_code)
        return self._chunks(r, url)

    @staticmethod
    def _chunks(r: httpx.Response, url: str):
        try:
            yield from r.iter_bytes(1 << 16)
        except httpx.TimeoutException as e:
            raise SlowRetrievalError(f"GET {url}: {e!r}") from e
        except httpx.TransportError as e:
            raise DownloadError(f"GET {url}: {e!r}") from e
        finally:
            r.close()
