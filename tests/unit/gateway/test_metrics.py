"""The gateway's metrics with and without tenant labels."""

from prometheus_client import generate_latest

from cloud_tier.gateway.pipeline.metrics import GatewayMetrics


def test_per_tenant_by_default():
    m = GatewayMetrics()
    m.of(m.requests, "acme", "chat", "ok").inc()
    m.of(m.ttft, "acme").observe(0.1)
    text = generate_latest(m.registry).decode()
    assert 'cascade_gateway_requests_total{endpoint="chat",outcome="ok",tenant="acme"} 1.0' in text
    assert 'tenant="acme"' in text.split("cascade_gateway_time_to_first_token_seconds_count")[1].split("\n")[0]


def test_without_tenant_labels_no_tenant_is_named():
    m = GatewayMetrics(tenant_labels=False)
    for tenant in ("acme", "globex"):
        m.of(m.requests, tenant, "chat", "ok").inc()
        m.of(m.tokens_in, tenant).inc(5)
        m.of(m.ttft, tenant).observe(0.1)
    text = generate_latest(m.registry).decode()
    assert "acme" not in text and "globex" not in text and "tenant=" not in text
    assert 'cascade_gateway_requests_total{endpoint="chat",outcome="ok"} 2.0' in text
    assert "cascade_gateway_prompt_tokens_total 10.0" in text


def test_the_blocks_committed_on_each_worker_are_a_gauge():
    from types import SimpleNamespace

    from cloud_tier.gateway.workers.pool import Worker

    w = Worker("http://w1", role="decode", healthy=True, committed_blocks=7)
    m = GatewayMetrics()
    m.refresh(SimpleNamespace(workers={w.url: w}), SimpleNamespace(waiting=0))
    text = generate_latest(m.registry).decode()
    assert 'cascade_gateway_worker_committed_blocks{role="decode",worker="http://w1"} 7.0' in text
