"""The control plane's /metrics (Prometheus) and its rollout controller, on a real `cascade fleet
serve`: a rollout started on its state is picked up and moved (its first wave assigned), and the
metrics show rollouts by state, the rollout's devices by state and devices by reported version."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from model_distribution.rollout.controller import start_rollout
from model_distribution.rollout.spec import RolloutSpec
from model_distribution.rollout.store import RolloutStore
from tests import loopback
from tests.conftest import Server
from tests.unit.sync.test_mqtt import wait_until
from tests.unit.test_registry import make_gguf


def samples(url: str, **kw) -> dict:
    r = loopback.get(f"{url}/metrics", **kw)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_show_rollouts_their_devices_and_the_fleet_and_the_controller_moves_them(tmp_path):
    root = tmp_path / "fleet"
    Repository(root).init()
    reg, store, rollouts = Registry(root), DeviceStore(root), RolloutStore(root)
    v1, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0")
    reg.push(make_gguf(tmp_path / "b.gguf", 2.0), "tiny", "1.1.0")
    for i in range(10):
        store.add(f"k{i}", ["kiosks"])
    store.assign(v1, group="kiosks")
    store.report("k0", {"state": "ACTIVE", "model": "tiny@1.0.0"})
    server = Server(tmp_path, ["fleet", "serve"], "--no-broker",
                    env={"CASCADE_FLEET_SERVER_METRICS_KEY": "scrape-key"}).wait_healthy(60)
    try:
        assert loopback.get(f"{server.url}/metrics").status_code == 401
        auth = {"headers": {"Authorization": "Bearer scrape-key"}}
        r = start_rollout(reg, store, rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [20, 100]))

        def told():
            return [d.device_id for d in store.list() if d.desired == "tiny@1.1.0"]

        wait_until(lambda: len(told()) == 2, "the controller to assign the first wave", 30)
        m = samples(server.url, **auth)
        assert m[("cascade_fleet_rollouts", (("state", "RUNNING"),))] == 1
        labels = (("model", "tiny@1.1.0"), ("rollout", r.rollout_id))
        assert m[("cascade_fleet_rollout_devices", (*labels[:1], *labels[1:], ("state", "IN_PROGRESS")))] == 2
        assert m[("cascade_fleet_rollout_devices", (*labels[:1], *labels[1:], ("state", "QUEUED")))] == 8
        assert m[("cascade_fleet_rollout_wave", labels)] == 1
        assert m[("cascade_fleet_devices", (("model", "tiny@1.0.0"), ("state", "ACTIVE")))] == 1
        assert m[("cascade_fleet_devices_online", ())] == 0
    finally:
        server.stop()
        reg.close()
        store.close()
        rollouts.close()
