"""What a SIGHUP reload applies and what it leaves for a restart (edge_agent/server/reload.py)."""

from __future__ import annotations

import asyncio
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from edge_agent.config import EdgeConfig, UpstreamConfig
from edge_agent.server.reload import describe, idle, plan
from edge_agent.upstream import Upstream


def config(**sections) -> EdgeConfig:
    return EdgeConfig.load(None, sections, environ={})


CLOUD = {"upstream": {"url": "http://cloud:8080"}}


@pytest.mark.parametrize("old, new, cascade, upstream, restart", [
    ({}, {}, {}, False, []),
    ({}, {"cascade": {"min_mean_logprob": -1.0, "mode": "local"}}, {"min_mean_logprob": -1.0, "mode": "local"},
     False, []),
    ({}, {"cascade": {"device": "kiosk-2"}}, {}, False, ["cascade.device"]),
    (CLOUD, {"upstream": {"url": "http://other:8080"}}, {}, True, []),
    (CLOUD, {"upstream": {"url": "http://cloud:8080", "api_key": "k2"}}, {}, True, []),
    ({}, CLOUD, {}, False, ["upstream.url"]),  # the cloud turned on: a restart
    (CLOUD, {}, {}, False, ["upstream.url"]),  # ... or off
    ({}, {"upstream": {"timeout_s": 5.0}}, {}, False, []),  # no cloud, no client to rebuild
    ({}, {"model": {"n_ctx": 1024}, "server": {"port": 9000}, "fleet": {"broker": "mqtt://b"}}, {}, False,
     ["model.n_ctx", "server.port", "fleet.broker"]),
])
def test_a_reload_applies_cascade_and_upstream_and_leaves_the_rest_for_a_restart(old, new, cascade, upstream,
                                                                                 restart):
    p = plan(config(**old), config(**new))
    assert (p.cascade, p.upstream, sorted(p.restart)) == (cascade, upstream, sorted(restart))


def test_the_description_names_each_change_and_masks_secrets():
    p = plan(config(**CLOUD), config(upstream={"url": "http://cloud:8080", "api_key": "s3cret"},
                                     cascade={"min_token_logprob": -2.5}))
    text = describe(p.diff)
    assert "[cascade] min_token_logprob -inf -> -2.5" in text and "[upstream] api_key '' -> '***'" in text
    assert "s3cret" not in text
    assert math.isinf(config().cascade.min_token_logprob)


def test_a_cloud_client_reads_idle_only_once_its_open_stream_is_closed():
    """What decides when a reload closes the old cloud client, on a real HTTP server."""
    release = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", "4")
            self.end_headers()
            self.wfile.write(b"ab")
            self.wfile.flush()
            release.wait(10)
            self.wfile.write(b"cd")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    up = Upstream(UpstreamConfig(url=f"http://127.0.0.1:{server.server_port}"))

    async def main():
        assert idle(up)  # nothing sent yet
        async with up.client.stream("GET", up.base_url + "/models") as r:
            chunks = r.aiter_raw()
            await chunks.__anext__()
            assert not idle(up)  # a stream is open on it
            release.set()
            async for _ in chunks:
                pass
        assert idle(up)
        await up.close()

    try:
        asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()
