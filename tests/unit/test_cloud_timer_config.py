"""Every timer of the cloud tier's configuration is a finite number of seconds (issue 37 item 4, the class
"numbers used unchecked"): a bad one is refused by `cascade cloud serve` in one line naming its key, exit 2."""

import pytest

from cascade_cli.main import build_parser
from cloud_tier.config import GatewayConfig, WorkerConfig

POSITIVE = ("request_timeout_s", "connect_timeout_s", "first_token_timeout_s", "metrics_interval_s",
            "stale_after_s", "breaker_open_s", "health_interval_s", "startup_timeout_s", "idempotency_ttl_s",
            "idempotency_lease_s", "ttft_slo_s", "tpot_slo_s")
NON_NEGATIVE = ("retry_backoff_s", "result_cache_ttl_s")


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_cloud_serve_refuses_a_bad_request_timeout_in_one_line_naming_it(tmp_path, capsys, monkeypatch, value):
    from cloud_tier import serve

    monkeypatch.setattr(serve, "run", lambda config, path=None: None)  # never start a gateway here
    toml = tmp_path / "cloud.toml"
    toml.write_text(f"[gateway]\nrequest_timeout_s = {value}\n")
    args = build_parser().parse_args(["cloud", "serve", "--both", "1", "--config", str(toml)])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "request_timeout_s" in err


def test_every_timer_field_must_be_a_finite_number_of_seconds():
    for name in POSITIVE + NON_NEGATIVE:
        for bad in (float("nan"), float("inf"), -1.0) + ((0.0,) if name in POSITIVE else ()):
            with pytest.raises(ValueError, match=name):
                GatewayConfig(both=1, **{name: bad})
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="prefill_timeout_s"):
            WorkerConfig(prefill_timeout_s=bad)
    assert GatewayConfig(both=1, retry_backoff_s=0, result_cache_ttl_s=0).request_timeout_s == 600.0
