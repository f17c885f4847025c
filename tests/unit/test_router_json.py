"""The router's JSON: a round trip; bad router files refused with the key named (at agent start a
ConfigError, which `cascade edge run` prints as one line and exits 2 on); check_calibration
carries a good router inline (from the file an edge.toml names, or inline), refuses bad ones;
the fleet side writes it to a file of the device's; the pure decisions with a router."""

from __future__ import annotations

import json
import math

import pytest

from cascade.calibration import CalibrationError, CascadeConfig, check_calibration, load_router
from cascade.config import ConfigError
from cascade.policy.confidence import Confidence, ConfidenceConfig
from cascade.policy.decide import PolicyConfig, RequestSignals, after_router, decide
from cascade.policy.router import PROMPT_FEATURES, Router, RouterError, Stage, prompt_features
from edge_agent.config import EdgeConfig


def stage(weights: dict[str, float], bias: float = 0.0) -> Stage:
    return Stage(weights, {k: 0.0 for k in weights}, {k: 1.0 for k in weights}, bias)


def router(**kw) -> Router:
    args = {"edge_model": "smollm2-135m", "edge_sha256": "", "window": 4, "stage1": stage({"code": 2.0}, -1.0),
            "stage2": stage({"code": 1.0, "lp_min": -1.5}), "stage1_threshold": 0.9, "stage2_threshold": 0.6,
            "target_escalation": 0.3}
    return Router(**(args | kw))


def good() -> dict:
    return router().to_json()


def test_a_router_round_trips_through_json():
    r = router(edge_sha256="ab" * 32)
    again = Router.from_json(json.loads(json.dumps(r.to_json(), allow_nan=False)))
    assert again == r
    feats = prompt_features("def f(x):\n    return x")
    assert again.stage1.score(feats) == r.stage1.score(feats)


def _edit(path: list[str], value):
    data = good()
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize("data,names", [
    (_edit(["stage1", "weights", "code"], math.nan), "stage1.weights.code"),
    (_edit(["stage2", "weights", "lp_min"], math.inf), "stage2.weights.lp_min"),
    (_edit(["stage1", "weights", "lp_min"], 1.0), "lp_min"),  # an uncertainty feature before generating
    (_edit(["stage2", "weights", "bogus_feature"], 1.0), "bogus_feature"),
    (_edit(["stage2", "weights", "code"], "1.0"), "stage2.weights.code"),
    (_edit(["stage2", "scale", "code"], 0.0), "stage2.scale.code"),
    (_edit(["stage2", "scale", "code"], 5e-324), "stage2.scale.code"),  # a term would overflow: NaN scores
    (_edit(["window"], "16"), "window"),
    (_edit(["window"], True), "window"),
    (_edit(["stage1_threshold"], math.nan), "stage1_threshold"),
    (_edit(["stage2_threshold"], None), "stage2_threshold"),
    (_edit(["edge_model"], 5), "edge_model"),
    (_edit(["edge_model"], KeyError), "edge_model"),
    (_edit(["stage2"], KeyError), "stage2"),
    (_edit(["stage2", "mean"], KeyError), "stage2"),
    (_edit(["format"], "other/1"), "format"),
    ({**good(), "extra": 1}, "extra"),
    ([1, 2], "object"),
])
def test_a_bad_router_is_refused_naming_the_key(data, names):
    with pytest.raises(RouterError, match=names.replace(".", r"\.")):
        Router.from_json(data)


def test_a_router_with_too_many_features_is_refused():
    data = good()
    data["stage1"]["weights"] = {f"f{i}": 1.0 for i in range(200)}
    with pytest.raises(RouterError, match="stage1.weights"):
        Router.from_json(data)


def test_a_router_file_that_is_not_json_too_large_or_missing_is_refused(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b"{" + b" " * (10 << 20) + b"}")
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(good()).replace('"bias": -1.0', '"bias": NaN'))
    for path, says in [(big, "over the limit"), (nan, "not valid JSON"), (tmp_path / "none.json", "cannot be read")]:
        with pytest.raises(ValueError, match=f"router: .*{says}"):
            load_router(path)


def test_a_router_path_that_is_no_regular_file_is_refused_not_read(tmp_path):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    for path in (fifo, link):  # a FIFO blocked the agent's start forever; /dev/zero ate its memory
        with pytest.raises(ValueError, match="router: .*not a regular file"):
            load_router(path)


def test_opposite_infinite_terms_give_no_opinion_not_an_escalation():
    s = Stage({"lp_min": 1.0, "lp_mean": -1.0}, {"lp_min": 0.0, "lp_mean": 0.0}, {"lp_min": 1.0, "lp_mean": 1.0}, 0.0)
    assert s.score({"lp_min": -math.inf, "lp_mean": -math.inf}) == 0.5


def test_a_fit_on_infinite_logprobs_writes_a_router_the_agent_loads():
    from cascade.eval.router_fit import matrix

    x = matrix([{"lp_min": -math.inf, "lp_mean": -1e7}, {"lp_min": -1.0, "lp_mean": math.nan}], ("lp_min", "lp_mean"))
    assert (abs(x) <= 1e6).all()


def test_an_agent_config_with_a_bad_router_file_is_a_config_error_naming_the_key(tmp_path):
    bad = tmp_path / "router.json"
    bad.write_text(json.dumps(_edit(["stage2", "weights", "bogus_feature"], 1.0)))
    edge = tmp_path / "edge.toml"
    edge.write_text(f'[cascade]\nrouter = "{bad}"\n')
    with pytest.raises(ConfigError, match=r"\[cascade\].*router.*bogus_feature"):
        EdgeConfig.load(edge)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(good()))
    edge.write_text(f'[cascade]\nrouter = "{ok}"\n')
    assert EdgeConfig.load(edge).cascade.router == str(ok)


def test_check_calibration_carries_a_router_inline_and_refuses_bad_ones(tmp_path):
    (tmp_path / "router.json").write_text(json.dumps(good()))
    from_file = check_calibration({"hold_tokens": 4, "router": "router.json"}, base_dir=tmp_path)
    assert from_file == {"hold_tokens": 4, "router": good()}
    assert check_calibration({"router": good()}) == {"router": good()}
    json.dumps(from_file, allow_nan=False)  # what a fleet manifest carries
    for bad, says in [({"router": "router.json"}, "names a file"),
                      ({"router": _edit(["stage1", "bias"], math.nan)}, "stage1.bias"),
                      ({"router": _edit(["stage2", "weights", "nope"], 1.0)}, "nope"),
                      ({"router": 7}, "router"), ({"router": "missing.json"}, "cannot be read")]:
        with pytest.raises(CalibrationError, match=says):
            check_calibration(bad, base_dir=tmp_path if bad["router"] == "missing.json" else None)


def test_the_fleet_side_writes_a_versions_router_to_a_file_of_the_devices(tmp_path):
    from edge_agent.server.fleet import prepare_calibration

    config, policy = prepare_calibration(CascadeConfig(), {"sha256": "cd" * 32, "calibration": json.dumps(
        {"router": good()})}, tmp_path)
    assert json.loads((tmp_path / "calibration" / f"{'cd' * 32}.router.json").read_text()) == good()
    assert config.router.endswith(".router.json") and policy.router == router()
    with pytest.raises(CalibrationError):
        prepare_calibration(CascadeConfig(), {"calibration": {"router": _edit(["window"], 0)}}, tmp_path)


# -- the pure decisions -------------------------------------------------------------------------------

def signals(**kw) -> RequestSignals:
    return RequestSignals(**({"prompt_tokens": 10, "max_tokens": 16, "n_ctx": 2048} | kw))


def test_stage_one_escalates_hard_and_otherwise_asks_for_the_hold_back():
    policy = PolicyConfig(confidence=ConfidenceConfig())  # confidence thresholds off
    assert decide(signals(routed_hard=True), policy).reason == "hard"
    d = decide(signals(router_judges=True), policy)
    assert (d.tier, d.reason, d.check_confidence) == ("edge", "easy", True)
    assert decide(signals(), policy).check_confidence is False
    assert decide(signals(routed_hard=True, mode="local"), policy).reason == "local"


def test_stage_two_escalates_low_confidence_on_unsure_tokens():
    r = router(stage2=stage({"lp_min": -2.0}, -2.0), stage2_threshold=0.5)
    sure, unsure = Confidence(window=4), Confidence(window=4)
    for lp in (-0.01, -0.02, -0.01, -0.05):
        sure.add(lp, 0.1)
    for lp in (-0.01, -3.0, -0.5, -0.2):
        unsure.add(lp, 1.5)
    feats = {k: 0.0 for k in PROMPT_FEATURES}
    assert after_router(r, feats, sure, cloud_available=True) is None
    assert after_router(r, feats, unsure, cloud_available=True).reason == "low_confidence"
    d = after_router(r, feats, unsure, cloud_available=False)
    assert d.tier == "edge" and d.degraded
    assert after_router(r, feats, Confidence(window=4), True) is None  # no tokens: nothing to judge


def test_a_router_matches_its_model_by_name_and_digest():
    r = router(edge_sha256="ab" * 32)
    assert r.matches("smollm2-135m", "ab" * 32) and r.matches("smollm2-135m", "")
    assert not r.matches("smollm2-135m", "cd" * 32) and not r.matches("other", "ab" * 32)


def test_fleet_push_with_an_edge_toml_carries_the_router_it_names_inline(tmp_path):
    from model_distribution.registry.store import Registry, RegistryError
    from tests.unit.test_registry import make_gguf

    (tmp_path / "calib").mkdir()
    (tmp_path / "calib" / "router.json").write_text(json.dumps(good()))
    edge = tmp_path / "calib" / "edge.toml"  # as cascade calibrate writes it: the router by path
    edge.write_text('[cascade]\nhold_tokens = 4\nmin_mean_logprob = -inf\nrouter = "router.json"\n')
    reg = Registry(tmp_path / "fleet")
    m, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0", edge)
    assert m.calibration["router"] == good()
    json.dumps(m.to_dict(), allow_nan=False)
    with pytest.raises(RegistryError, match="stage1.bias"):
        reg.push(make_gguf(tmp_path / "b.gguf", 2.0), "tiny", "1.1.0", {"router": _edit(["stage1", "bias"], math.inf)})
    reg.close()


def test_uncertainty_features_are_quantiles_of_the_k_values():
    from cascade.policy.router import combined, uncertainty_features

    f = uncertainty_features([-0.1, -2.0, -0.5, -0.3, -1.0], [0.2, 1.5, 0.4, 0.3, 0.9], window=8)
    assert f["lp_min"] == -2.0 and f["lp_median"] == -0.5 and f["lp_first"] == -0.1
    assert f["lp_p25"] == pytest.approx(-1.0) and f["lp_p10"] == pytest.approx(-1.6)
    assert f["lp_mean"] == pytest.approx(-0.78) and f["ent_max"] == 1.5 and f["ent_mean"] == pytest.approx(0.66)
    assert f["unsure_share"] == pytest.approx(0.4) and f["finished"] == 1.0  # 5 tokens < K: it ended
    assert uncertainty_features([-0.1] * 8, [0.1] * 8, window=8)["finished"] == 0.0
    assert set(uncertainty_features([], [], 8).values()) == {0.0}
    both = combined(prompt_features("def f(x): return x"), f)
    assert both["code*lp_min"] == -2.0 and both["math*lp_min"] == 0.0
