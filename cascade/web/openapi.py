"""The OpenAPI documents of our servers. Their bodies are parsed by hand (``read_json`` +
``parse_body``, for OpenAI-style 400/413 errors), so FastAPI sees neither the bodies nor the
errors in the handlers' signatures; the routes declare them with ``body``, ``errors``,
``generation`` and ``queued``, and ``install_openapi`` completes the document.

    @v1.post("/chat/completions", openapi_extra=body(ChatCompletionRequest),
             responses={**generation(ChatCompletion), **errors(400, 404, 413)})
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel

from cascade.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_DEFS = "x-cascade-schemas"  # a body's definitions, from the route to components/schemas

_MEANINGS = {
    400: "The body is not a JSON object, or a parameter is missing or invalid.",
    401: "The API key is missing or invalid.",
    403: "The API key lacks the scope this endpoint needs.",
    404: "The model (or the resource) does not exist.",
    409: "A request with this Idempotency-Key is still in progress.",
    413: "The body exceeds the server's size limit.",
    422: "This Idempotency-Key was used with a different request.",
    429: "A rate limit, a quota or a full queue: retry after Retry-After seconds.",
    500: "An unexpected server error.",
    502: "A cloud worker failed or ended the generation without finishing.",
    503: "No capacity: no healthy worker, the engine stopped, or the cloud is unreachable.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}


class QueuedRequest(BaseModel):
    """The edge agent's 202: the request is stored for the cloud; poll ``location`` for it."""

    id: str
    object: Literal["cascade.request"] = "cascade.request"
    state: Literal["queued"] = "queued"
    location: str
    cascade: dict[str, Any]


def body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` for a route that parses ``model`` from its JSON body by hand."""
    schema = model.model_json_schema(ref_template=_REF)
    defs = {**schema.pop("$defs", {}), model.__name__: schema}
    content = {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}
    return {"requestBody": {"required": True, "content": content}, _DEFS: defs}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the OpenAI-style error bodies (``cascade.errors.APIError``)
    that a route answers with these statuses."""
    return {s: {"model": ErrorResponse, "description": _MEANINGS[s],
                **({"headers": _RETRY_AFTER} if s in (429, 503) else {})} for s in statuses}


def generation(model: type[BaseModel], chunk: str | None = None) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for the 200 of a generation route: ``model`` as JSON, or, when ``chunk``
    names the streamed object, server-sent events of it (``stream: true``)."""
    ok: dict[str, Any] = {"model": model, "description": f"A {model.__name__}."}
    if chunk:
        ok["description"] += f" With `stream: true`, server-sent events: `data: <{chunk} JSON>`, then `data: [DONE]`."
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: ok}


def queued() -> dict[int | str, dict[str, Any]]:
    """``responses=`` for the edge agent's 202: stored for the cloud, to be polled at Location."""
    location = {"Location": {"description": "Where to poll the request's state.", "schema": {"type": "string"}}}
    return {202: {"model": QueuedRequest, "headers": location,
                  "description": "The cloud is unreachable and the request was queued for it."}}


def install_openapi(app: FastAPI) -> None:
    """Complete ``app``'s OpenAPI document when it is first generated: the request bodies'
    definitions go into ``components/schemas``, and FastAPI's 422 for a failed validation
    becomes the 400 that ``install_error_handlers`` answers instead."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _complete(generate())
        return app.openapi_schema

    app.openapi = openapi


def _complete(doc: dict[str, Any]) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for item in doc.get("paths", {}).values():
        for op in item.values():
            if _DEFS in op:
                _merge(schemas, op)
            responses = op.get("responses", {})
            if "HTTPValidationError" in str(responses.get("422")):
                del responses["422"]
                bad = ErrorResponse.model_json_schema(ref_template=_REF)
                schemas.update(bad.pop("$defs", {}))
                schemas.setdefault(ErrorResponse.__name__, bad)
                responses.setdefault("400", {"description": _MEANINGS[400], "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=ErrorResponse.__name__)}}}})
    if "HTTPValidationError" not in str(doc["paths"]):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)


def _merge(schemas: dict[str, Any], op: dict[str, Any]) -> None:
    """Move ``op``'s body definitions into ``schemas``. One that a response already defines
    differently (its serialization schema) becomes ``<name>-Input``, as FastAPI names them."""
    defs = op.pop(_DEFS)
    names = {n: f"{n}-Input" for n, s in defs.items() if schemas.get(n, s) != s}
    if names:
        defs = _renamed(defs, names)
        op["requestBody"] = _renamed(op["requestBody"], names)
    for name, schema in defs.items():
        if schemas.setdefault(name, schema) != schema:
            raise ValueError(f"two different schemas are named {name!r}")


def _renamed(obj: Any, names: dict[str, str]) -> Any:
    """``obj`` with its definitions and ``$ref``s to them renamed by ``names``."""
    if isinstance(obj, list):
        return [_renamed(v, names) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        if k == "$ref" and v.startswith(_REF.format(model="")):
            name = v.removeprefix(_REF.format(model=""))
            v = _REF.format(model=names.get(name, name))
        out[names.get(k, k)] = _renamed(v, names)
    return out
