"""The registry's TUF repository against python-tuf's own client (ngclient), over real HTTP
from a local static server: a device that trusts the provisioned root accepts what the control
plane signed and refuses corrupted artifacts, an untrusted signer and rolled-back metadata."""

from __future__ import annotations

import functools
import hashlib
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from securesystemslib.signer import CryptoSigner
from tuf.api import exceptions

from model_distribution.registry.signing import Repository
from model_distribution.registry.tuf_client import manifest_of, verified_target


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def repo(tmp_path):
    r = Repository(tmp_path / "fleet")
    r.init()
    return r


@pytest.fixture
def server(repo):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(repo.metadata_dir)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


def publish(repo, data: bytes, name="tiny", version="1.0.0"):
    digest = hashlib.sha256(data).hexdigest()
    repo.add_target(name, version, digest, len(data), {"name": name, "version": version, "sha256": digest})
    return digest


def test_a_device_verifies_a_signed_version_and_refuses_corrupted_bytes(repo, server, tmp_path):
    data = b"model bytes" * 1000
    digest = publish(repo, data)
    info = verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.0.0")
    assert info.length == len(data) and info.hashes["sha256"] == digest
    assert manifest_of(info)["sha256"] == digest
    info.verify_length_and_hashes(data)
    with pytest.raises(exceptions.LengthOrHashMismatchError):
        info.verify_length_and_hashes(data[:-1] + b"X")


def sign_targets_with_an_untrusted_key(repo: Repository, version: int | None = None) -> None:
    """The attacker's targets (the next version, or ``version``), under the real snapshot and timestamp keys."""
    targets = repo._load("targets")
    targets.signed.version = version or targets.signed.version + 1
    repo._write(targets, CryptoSigner.generate_ed25519())
    repo._resign_snapshot({"snapshot": repo.signer("snapshot"), "timestamp": repo.signer("timestamp")})


def roll_back_targets(repo: Repository) -> int:
    """A validly signed snapshot (and timestamp) pointing at the targets before the current ones;
    the targets version it names."""
    snapshot = repo._load("snapshot")
    snapshot.signed.meta["targets.json"].version -= 1
    snapshot.signed.version += 1
    repo._write(snapshot, repo.signer("snapshot"))
    ts = repo._load("timestamp")
    ts.signed.snapshot_meta.version = snapshot.signed.version
    ts.signed.version += 1
    repo._write(ts, repo.signer("timestamp"))
    return snapshot.signed.meta["targets.json"].version


def test_targets_signed_by_a_key_the_root_does_not_trust_are_refused(repo, server, tmp_path):
    publish(repo, b"good")
    verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.0.0")
    sign_targets_with_an_untrusted_key(repo)
    with pytest.raises(exceptions.UnsignedMetadataError):
        verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.0.0")


def test_rolled_back_targets_metadata_are_refused(repo, server, tmp_path):
    publish(repo, b"v1", version="1.0.0")
    publish(repo, b"v2", version="1.1.0")
    verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.1.0")  # the device saw targets v3
    assert roll_back_targets(repo) == 2
    with pytest.raises(exceptions.BadVersionNumberError):
        verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.1.0")


def test_a_frozen_timestamp_older_than_the_one_seen_is_refused(repo, server, tmp_path):
    publish(repo, b"v1")
    old = (repo.metadata_dir / "timestamp.json").read_bytes()
    repo.refresh_timestamp()
    verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.0.0")
    (repo.metadata_dir / "timestamp.json").write_bytes(old)  # a mirror replays the older timestamp
    with pytest.raises(exceptions.BadVersionNumberError):
        verified_target(tmp_path / "device", server, repo.root_bytes(), "tiny", "1.0.0")


def test_a_device_provisioned_with_another_root_refuses_everything(repo, server, tmp_path):
    publish(repo, b"v1")
    other = Repository(tmp_path / "other")
    other.init()
    with pytest.raises(exceptions.RepositoryError):
        verified_target(tmp_path / "device", server, other.root_bytes(), "tiny", "1.0.0")
    shutil.rmtree(tmp_path / "device")


def test_init_refuses_to_overwrite_keys_and_keys_are_private(repo):
    from model_distribution.registry.signing import SigningError

    with pytest.raises(SigningError, match="exist already"):
        repo.init()
    assert all((p.stat().st_mode & 0o077) == 0 for p in repo.keys_dir.glob("*.pem"))
