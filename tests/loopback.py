"""One HTTP client for the tests' own calls to the servers they start on loopback.

``httpx.get()`` and its siblings build a client per call, and with it a TLS context that loads the
CA bundle: ~60 ms of CPU here, even for an http:// URL. The accounting after every integration test
and the tests' polling loops made thousands of them. This client makes its TLS context once and
keeps no connection alive between requests (each opens its own, as ``httpx.get`` does), so a server
a test kills or restarts leaves nothing stale behind. httpx clients are thread-safe.
"""

from __future__ import annotations

import httpx

CLIENT = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))
get, post, stream, request = CLIENT.get, CLIENT.post, CLIENT.stream, CLIENT.request
