"""Devices, groups and desired state in the registry's database, and the signed desired-state
document a device checks."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from model_distribution.fleet.desired import BadDocument, desired_document, verify_desired
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry, RegistryError
from tests.unit.test_registry import make_gguf


@pytest.fixture
def fleet(tmp_path):
    reg, store = Registry(tmp_path / "fleet"), DeviceStore(tmp_path / "fleet")
    yield reg, store
    reg.close()
    store.close()


def test_enrol_authenticate_and_refuse_a_second_enrolment(fleet):
    _, store = fleet
    secret = store.add("kiosk-7", ["kiosks", "lobby", "kiosks"])
    assert store.authenticate("kiosk-7", secret) and not store.authenticate("kiosk-7", secret + "x")
    assert not store.authenticate("kiosk-8", secret)
    assert store.get("kiosk-7").groups == ["kiosks", "lobby"]
    with pytest.raises(RegistryError, match="enrolled already"):
        store.add("kiosk-7", [])
    with pytest.raises(RegistryError):
        store.add("bad/id", [])


def test_assign_a_group_bumps_each_devices_revision(fleet, tmp_path):
    reg, store = fleet
    for d, g in [("k1", "kiosks"), ("k2", "kiosks"), ("v1", "vans")]:
        store.add(d, [g])
    m, _ = reg.push(make_gguf(tmp_path / "m.gguf"), "tiny", "1.0.0")
    changed = store.assign(m, group="kiosks")
    assert [(d.device_id, d.desired, d.desired_rev) for d in changed] == [("k1", "tiny@1.0.0", 1),
                                                                          ("k2", "tiny@1.0.0", 1)]
    assert store.get("v1").desired is None
    assert store.assign(m, device_id="k1")[0].desired_rev == 2
    with pytest.raises(RegistryError, match="no device in group"):
        store.assign(m, group="nobody")


def test_the_desired_document_is_signed_for_one_device(fleet, tmp_path):
    reg, store = fleet
    repo = Repository(tmp_path / "fleet")
    repo.init()
    store.add("k1", ["kiosks"])
    m, _ = reg.push(make_gguf(tmp_path / "m.gguf"), "tiny", "1.0.0")
    (dev,) = store.assign(m, device_id="k1")
    doc = desired_document(dev, m, repo.desired_key())
    payload = verify_desired(doc, repo.desired_public_key(), "k1")
    assert (payload["model"], payload["version"], payload["sha256"], payload["rev"]) == ("tiny", "1.0.0", m.sha256, 1)
    with pytest.raises(BadDocument, match="not 'k2'"):
        verify_desired(doc, repo.desired_public_key(), "k2")
    forged = desired_document(dev, m, Ed25519PrivateKey.generate())
    with pytest.raises(BadDocument, match="not signed"):
        verify_desired(forged, repo.desired_public_key(), "k1")
    tampered = doc.replace(b'"payload": "', b'"payload": "e30')
    with pytest.raises(BadDocument):
        verify_desired(tampered, repo.desired_public_key(), "k1")


def _record(rid, ts, uptime, cloud, edge, ok, failed, pending=0):
    return {"id": rid, "ts": ts, "uptime_s": uptime, "kind": "telemetry",
            "decisions": {"cloud/hard_prompt": cloud, "edge/confident": edge},
            "requests": {"/v1/chat/completions/200": ok, "/v1/chat/completions/500": failed},
            "queue": {"pending": pending}}


def test_telemetry_is_kept_once_per_record_id_and_summarised_over_the_agents_run(fleet):
    import time

    _, store = fleet
    store.add("kiosk-7", ["kiosks"])
    now = time.time()
    assert store.telemetry("kiosk-7", _record("a", now - 600, 100, 5, 5, 10, 0))
    assert not store.telemetry("kiosk-7", _record("a", now - 600, 100, 5, 5, 10, 0))  # a duplicate
    assert store.telemetry("kiosk-7", _record("b", now, 700, 8, 11, 18, 2, pending=3))
    d = store.list(serving=True)[0]
    # the difference between the two records of this run: 3 of 9 decisions cloud, 2 of 10 requests failed
    assert (d.serving["requests"], d.serving["escalation_rate"], d.serving["error_rate"], d.serving["backlog"]) == (
        10, round(3 / 9, 4), 0.2, 3)
    assert store.list()[0].serving == {}  # only when asked: the publisher lists devices often
    # the agent restarted (uptime went back): the counters start again, the old run is not subtracted
    store.telemetry("kiosk-7", _record("c", now + 60, 30, 1, 3, 4, 0))
    d = store.get("kiosk-7")
    assert store.serving("kiosk-7")["escalation_rate"] == 0.25 and store.serving("kiosk-7")["requests"] == 4
    assert d.online is None
    store.seen("kiosk-7", "online")
    assert store.get("kiosk-7").online is True
    store.seen("kiosk-7", "offline")
    assert store.get("kiosk-7").to_dict()["online"] is False


@pytest.mark.parametrize("record", [[], "x", {"no": "id"}, {"id": None}])
def test_a_telemetry_record_that_is_not_an_object_with_an_id_is_refused(fleet, record):
    _, store = fleet
    store.add("kiosk-7", [])
    with pytest.raises(ValueError):
        store.telemetry("kiosk-7", record)


@pytest.mark.parametrize("reported", [
    {"state": 5, "model": ["x"], "done": "a lot", "total": 0, "reason": {"no": "text"}},
    {"state": "DOWNLOADING", "done": 10**30, "total": -1, "model": "\x1b[2Jm" * 50},
    {"state": "DOWNLOADING", "done": 5, "total": 10, "reason": "r" * 10000},
    {"state": ["ACTIVE"]},
    {"state": "ACTIVE", "at": float("nan")},
])
def test_a_bad_report_is_refused_and_one_kept_before_reports_were_checked_cannot_break_the_listing(
        tmp_path, monkeypatch, capsys, reported):
    import argparse
    import json

    from cascade_cli import fleet_devices
    from model_distribution.protocol.device_messages import RefusedMessage

    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    monkeypatch.delenv("CASCADE_FLEET_URL", raising=False)
    store = DeviceStore(tmp_path / "fleet")
    store.add("kiosk-7", [])
    with pytest.raises(RefusedMessage):
        store.report("kiosk-7", reported)
    with pytest.raises(RefusedMessage):
        store.telemetry("kiosk-7", {"id": "t1", "ts": "soon", "uptime_s": None, "decisions": {"cloud/x": "many"},
                                    "requests": [], "queue": {"pending": "lots"}})
    # what an older control plane kept as devices sent it: read back leniently, never raised
    store._db.execute("UPDATE devices SET reported = ?, last_event = ? WHERE device_id = 'kiosk-7'",
                      (json.dumps(reported), '{"event": NaN}'))
    store._db.execute("INSERT INTO telemetry VALUES ('kiosk-7', 'old', 1e300, 0, '{\"ts\": Infinity, "
                      "\"requests\": {\"chat/500\": NaN}}')")
    assert store.get("kiosk-7").reported is None or isinstance(store.get("kiosk-7").reported, dict)
    store.close()
    args = argparse.Namespace(group=None, json=False, url=None, admin_key=None)
    assert fleet_devices.cmd_devices_list(args) == 0
    out = capsys.readouterr().out
    assert "kiosk-7" in out and "\x1b" not in out and max(len(line) for line in out.splitlines()) < 700
    assert fleet_devices.cmd_devices_list(argparse.Namespace(group=None, json=True, url=None, admin_key=None)) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


def test_secrets_are_kept_as_a_keyed_hash_and_old_scrypt_hashes_still_check(fleet):
    from model_distribution.fleet.device_secrets import _hash_secret, check_secret

    _, store = fleet
    secret = store.add("kiosk-7", [])
    stored = store._db.execute("SELECT secret_hash FROM devices").fetchone()[0]
    assert stored.startswith("sha256$") and secret not in stored
    old = _hash_secret(secret, kind="scrypt")  # what stores made before this kept
    assert check_secret(secret, old) and not check_secret(secret + "x", old)
    assert not check_secret(secret, "md5$AAAA$BBBB") and not check_secret(secret, "garbage")


def test_a_device_message_nested_past_the_parser_is_logged_and_counted_not_raised(tmp_path, caplog):
    """A hostile device's payload must not raise out of the MQTT callback (it would stop the loop)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from model_distribution.control_plane.inbox import DeviceInbox
    from model_distribution.control_plane.publisher import DesiredPublisher
    devices = DeviceStore(tmp_path)
    devices.add("d1", [])
    metrics = CollectorRegistry()
    publisher = DesiredPublisher(None, devices, Ed25519PrivateKey.generate(), "mqtt://127.0.0.1:1",
                                 inbox=DeviceInbox(devices, metrics))
    deep, deeper = b"[" * 5_000 + b"]" * 5_000, b"[" * 50_000 + b"]" * 50_000
    for payload in (deep, deeper):
        for kind in ("reported", "telemetry", "events"):
            publisher._on_message(SimpleNamespace(topic=f"cascade/v1/default/devices/d1/{kind}", payload=payload))

    def refused(kind, reason):
        return metrics.get_sample_value("cascade_fleet_device_messages_refused_total",
                                        {"kind": kind, "reason": reason}) or 0
    assert refused("reported", "not_json") == refused("telemetry", "not_json") == 1  # nested past the bound
    assert refused("reported", "too_large") == refused("telemetry", "too_large") == 1  # refused before parsing
    assert refused("events", "too_large") == 2
    assert "refused a reported message" in caplog.text  # logged once a minute per device, counted always
    with pytest.raises(BadDocument):
        key = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
        verify_desired(b'{"payload": ' + deeper + b"}", key, "d1")
