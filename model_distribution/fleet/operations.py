"""The fleet operator's operations, one function each, shared by the two ways of running them:
``cascade fleet ...`` on the control plane's state (its host) and the control plane's admin HTTP
API (``/v1/fleet``, what ``cascade fleet ... --url`` calls). Both get the same checks, the same
errors and the same results, because both run this code.

Errors are RegistryError (the message says why), with two kinds the HTTP API answers apart:
``ImmutableVersion`` (409: other bytes under a published name@version) and ``Conflict`` /
``NotFound`` below.
"""

from __future__ import annotations

from pathlib import Path

from model_distribution.fleet.devices import Device, DeviceStore
from model_distribution.registry.signing import Repository, SigningError
from model_distribution.registry.store import ImmutableVersion, Manifest, Registry, RegistryError

__all__ = ["Conflict", "ImmutableVersion", "NotFound", "assign", "enrol", "push"]


class Conflict(RegistryError):
    """The thing exists already (a device id enrolled before): 409."""


class NotFound(RegistryError):
    """No such published version, device or group: 404."""


def push(registry: Registry, repository: Repository, path: Path | str, name: str, version: str,
         calibration: Path | str | dict | None = None, min_agent_version: str | None = None
         ) -> tuple[Manifest, bool]:
    """Publish ``path`` as ``name@version`` and sign it as a TUF target (what devices verify
    before they install). Returns the manifest and whether it was new; the same bytes again are a
    no-op (and sign the target if an earlier push stopped before it did). RegistryError /
    ImmutableVersion when refused; SigningError without keys, or when another writer holds the
    repository's lock past its timeout. The whole publish holds that lock (across processes: a
    local push beside the control plane's), so a version is listed and signed together, and a
    second push of the same version waits and finds it signed."""
    with repository.writing():
        manifest, created = registry.push(path, name, version, calibration, min_agent_version)
        if not repository.has_target(manifest.name, manifest.version):
            try:
                repository.add_target(manifest.name, manifest.version, manifest.sha256, manifest.size,
                                      manifest.signable())
            except Exception as e:  # never listed but unsigned: what devices would be refused
                if created:
                    registry.forget(manifest.name, manifest.version)
                if isinstance(e, SigningError):
                    raise
                raise SigningError(f"{manifest.ref} could not be signed: {e}"[:300]) from e
    return manifest, created


def enrol(store: DeviceStore, device_id: str, groups: list[str], fleet: str = "default") -> dict:
    """Enrol a device: its credentials (the secret is shown this once; only its hash is kept)."""
    if store.get(device_id) is not None:
        raise Conflict(f"device {device_id!r} is enrolled already")
    secret = store.add(device_id, groups, fleet)
    return {"device": device_id, "fleet": fleet, "groups": list(dict.fromkeys(groups)), "secret": secret}


def assign(registry: Registry, store: DeviceStore, ref: str, device_id: str | None = None,
           group: str | None = None) -> tuple[Manifest, list[Device]]:
    """Make published ``name@version`` the desired state of one device or of every device of a
    group (a new desired revision each); the manifest and the devices changed."""
    if (device_id is None) == (group is None):
        raise RegistryError("name one device or a group")
    name, sep, version = ref.partition("@")
    if sep and name and version and registry.get(name, version) is None:
        raise NotFound(f"{ref} is not published (see cascade fleet models)")
    manifest = registry.resolve(ref)  # RegistryError for a ref that is not name@version
    try:
        return manifest, store.assign(manifest, device_id=device_id, group=group)
    except RegistryError as e:  # nothing matched
        raise NotFound(str(e)) from e
