"""The app shell every server shares (cascade.web.build_openai_app): the routers' routes served
as declared (their prefixes and dependencies kept, ahead of FastAPI's own), and RequestRoute
endpoints called as they are, their errors OpenAI-style, their bodies in the OpenAPI document."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.testclient import TestClient

from cascade import errors
from cascade.protocol import ChatCompletionRequest
from cascade.web import RequestRoute, build_openai_app, openapi, parse_body, read_json, require_api_key


def app_of(*routers, api_key: str = ""):
    config = SimpleNamespace(server=SimpleNamespace(api_key=api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield

    return build_openai_app("test", lifespan, config, "cloud", *routers)


def test_routes_keep_their_prefix_and_their_routers_dependencies():
    ops, v1 = APIRouter(), APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @ops.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        return {"id": model}

    with TestClient(app_of(ops, v1, api_key="sesame")) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        r = c.get("/v1/models/org/name", headers={"authorization": "Bearer sesame"})
        assert r.json() == {"id": "org/name"} and r.headers["x-cascade-tier"] == "cloud"
        refused = c.get("/v1/models/org/name")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert c.get("/nowhere").json()["error"]["type"] == "not_found_error"
        assert c.get("/docs").status_code == 200 and "/v1/models/{model}" in c.get("/openapi.json").json()["paths"]


def test_a_request_route_is_called_as_it_is_and_documented_as_declared():
    generation = APIRouter(prefix="/v1", route_class=RequestRoute)

    @generation.post("/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest),
                     responses=openapi.errors(400, 413))
    async def chat(request: Request):
        req = parse_body(ChatCompletionRequest, await read_json(request, 1000))
        if req.model != "m":
            raise errors.model_not_found(req.model)
        return Response(b'{"ok":true}', media_type="application/json", headers={"X-Seen": req.messages[0].text()})

    with TestClient(app_of(generation)) as c:
        ok = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert (ok.json(), ok.headers["x-seen"], ok.headers["x-cascade-tier"]) == ({"ok": True}, "hi", "cloud")
        missing = c.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": ""}]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert c.post("/v1/chat/completions", content=b"{").json()["error"]["code"] == "invalid_json"
        assert c.post("/v1/chat/completions", json={"model": "m"}).json()["error"]["param"] == "messages"
        assert c.post("/v1/chat/completions", content=b"x" * 1001).status_code == 413
        assert c.get("/v1/chat/completions").status_code == 405
        doc = c.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
        assert "requestBody" in doc and {"400", "413"} <= set(doc["responses"])


@pytest.mark.parametrize("endpoint", ["path", "query", "dependency", "body", "response_model"])
def test_a_request_route_refuses_an_endpoint_that_needs_fastapis_handler(endpoint):
    r = APIRouter(route_class=RequestRoute)
    declare = {
        "path": lambda: r.get("/x/{item}")(lambda request, item: None),
        "query": lambda: r.get("/x")(lambda request, q: None),
        "dependency": lambda: r.get("/x", dependencies=[Depends(require_api_key)])(lambda request: None),
        "body": lambda: r.post("/x")(_takes_a_body),
        "response_model": lambda: r.get("/x", response_model=dict)(lambda request: None),
    }[endpoint]
    with pytest.raises(TypeError, match="Request alone"):
        declare()


def _takes_a_body(request: Request, body: ChatCompletionRequest):
    return None
