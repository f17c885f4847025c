"""The control plane's Prometheus metrics, read from the registry's database at each scrape (so
they are right after a restart and across processes: the fleet commands write the same store).

    cascade_fleet_rollouts{state}                                 rollouts by state
    cascade_fleet_rollout_devices{rollout, model, state}          executions by state
    cascade_fleet_rollout_wave{rollout, model}                    the wave being rolled out (1-based)
    cascade_fleet_rollout_gate_value{rollout, wave, metric, side} the last judged value, updated vs control
    cascade_fleet_devices{state, model}                           devices by reported state and version
    cascade_fleet_devices_online                                  devices whose status is online
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from model_distribution.fleet.devices import DeviceStore
from model_distribution.rollout.states import ACTIVE_STATES
from model_distribution.rollout.store import RolloutStore


class FleetCollector:
    def __init__(self, devices: DeviceStore, rollouts: RolloutStore):
        self.devices, self.rollouts = devices, rollouts

    def collect(self):
        all_rollouts = self.rollouts.list()
        by_state = GaugeMetricFamily("cascade_fleet_rollouts", "Rollouts by state", labels=["state"])
        for state, n in Counter(r.state for r in all_rollouts).items():
            by_state.add_metric([state], n)
        yield by_state
        execs = GaugeMetricFamily("cascade_fleet_rollout_devices", "A rollout's devices by execution state",
                                  labels=["rollout", "model", "state"])
        wave = GaugeMetricFamily("cascade_fleet_rollout_wave", "The wave being rolled out (1-based)",
                                 labels=["rollout", "model"])
        gates = GaugeMetricFamily("cascade_fleet_rollout_gate_value",
                                  "The last judged serving metric of a rollout, updated devices vs the control group",
                                  labels=["rollout", "wave", "metric", "side"])
        for r in all_rollouts:
            if r.state not in ACTIVE_STATES and r is not all_rollouts[0]:
                continue  # the rollouts under way, and the latest one
            for state, n in Counter(e.state for e in self.rollouts.executions(r.rollout_id)).items():
                execs.add_metric([r.rollout_id, r.ref, state], n)
            wave.add_metric([r.rollout_id, r.ref], r.wave + 1)
            judged = [d for d in self.rollouts.decisions(r.rollout_id) if isinstance(d.get("updated"), dict)]
            if judged:
                last = judged[-1]
                for side in ("updated", "control"):
                    for metric, value in (last.get(side) or {}).items():
                        if isinstance(value, (int, float)) and metric != "requests":
                            gates.add_metric([r.rollout_id, str(last["wave"] + 1), metric, side], value)
        yield execs
        yield wave
        yield gates
        devices = self.devices.list()
        fleet = GaugeMetricFamily("cascade_fleet_devices", "Devices by reported state and model version",
                                  labels=["state", "model"])
        counts = Counter(((d.reported or {}).get("state") or "UNKNOWN", (d.reported or {}).get("model") or "-")
                         for d in devices)
        for (state, model), n in counts.items():
            fleet.add_metric([str(state)[:32], str(model)[:130]], n)
        yield fleet
        online = GaugeMetricFamily("cascade_fleet_devices_online", "Devices whose status is online")
        online.add_metric([], sum(1 for d in devices if d.online))
        yield online


def registry_for(devices: DeviceStore, rollouts: RolloutStore) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetCollector(devices, rollouts))
    return registry
