"""The OpenAI Files and Batch API on the gateway, as the official SDK calls it: ``/v1/files``
(multipart upload of a JSONL with purpose "batch", its object, content, deletion, listing) and
``/v1/batches`` (create, retrieve, list, cancel). Thin handlers: the store (``batch.store``) keeps
the state, the runner (``batch.runner``) does the work. A file or batch of another tenant is not
found. Every call of the store runs in a worker thread (``_call``): it may wait for the store's
lock or the disk, and the event loop serves every other tenant meanwhile."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile

from cascade import errors
from cascade.web import openapi, parse_body, read_json
from cloud_tier.gateway.batch.files import StorageFull
from cloud_tier.gateway.batch.jsonl import ENDPOINTS, count_lines
from cloud_tier.gateway.batch.state import CANCELLABLE, InvalidTransition, Status, window_seconds
from cloud_tier.gateway.batch.store import BatchStore, TooManyBatches, batch_object
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.tenants.keys import ApiKey

batch_api = APIRouter(prefix="/v1")
_ERRORS = openapi.errors(400, 401, 403, 404, 409, 413, 429, 500)
_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}}


_JSONL = {200: {"description": "The file's bytes (JSONL).",
                "content": {"application/jsonl": {"schema": {"type": "string"}}}}}


class NewBatch(BaseModel):
    input_file_id: str = Field(max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


async def _parts(request: Request) -> tuple[GatewayService, BatchStore, ApiKey]:
    svc: GatewayService = request.app.state.service
    return svc, request.app.state.batches, await svc.authenticate(request.headers.get("authorization", ""))


async def _call(fn, *args):
    """A store call, in a worker thread."""
    return await asyncio.to_thread(fn, *args)


async def _batch(store: BatchStore, row: dict) -> dict:
    return batch_object(row, await _call(store.counts, row["id"]))


def _storage_full(e: StorageFull, param: str) -> errors.APIError:
    return errors.APIError(403, str(e), "invalid_request_error", param, "storage_limit_exceeded")


def _too_many(message: str) -> errors.APIError:
    return errors.APIError(429, message, "invalid_request_error", None, "too_many_active_batches")


def _not_found(what: str, ident: str) -> errors.APIError:
    return errors.APIError(404, f"No such {what} object: {ident}", "invalid_request_error", "id", "not_found")


def _page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


UPLOAD_FORM_OVERHEAD = 64 << 10  # an upload's body: the file and the form's own parts
_COUNT_CHUNK = 64 << 10  # counting a file's lines reads it in pieces this size
_EXPIRES = (3600, 30 * 86400)  # OpenAI's bounds on expires_after[seconds]


def body_too_large(limit: int) -> errors.APIError:
    return errors.APIError(413, f"The request body exceeds {limit} bytes.", "invalid_request_error", None,
                           "request_too_large")


def _too_big(limit: int) -> errors.APIError:
    return errors.APIError(413, f"The file is larger than this gateway's limit of {limit} bytes.",
                           "invalid_request_error", "file", "file_too_large")


def _expires_after(form) -> int | None:
    """OpenAI's ``expires_after`` ({anchor: created_at, seconds}) from the form, in seconds."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or not isinstance(seconds, str) or not (seconds.isascii() and seconds.isdigit()) or not (
            _EXPIRES[0] <= int(seconds) <= _EXPIRES[1]):
        raise errors.bad_request(f"expires_after must be {{anchor: 'created_at', seconds: {_EXPIRES[0]} to "
                                 f"{_EXPIRES[1]}}}.", "expires_after", "invalid_value")
    return int(seconds)


@batch_api.post("/files", openapi_extra=_UPLOAD, responses=_ERRORS)
async def upload_file(request: Request):
    svc, store, key = await _parts(request)
    limit = svc.config.batch_max_file_bytes
    try:
        form = await request.form(max_files=1, max_fields=8)
    except errors.APIError:  # the body grew past its limit while it was read
        raise
    except Exception as e:  # starlette's MultiPartException and friends: the body is not a form
        raise errors.bad_request(f"The body is not a multipart form: {e}.", "file", "invalid_form") from e
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise errors.bad_request(f"Invalid value for 'purpose': {purpose!r}; this gateway takes 'batch' files.",
                                     "purpose", "invalid_value")
        if not isinstance(upload, UploadFile):
            raise errors.bad_request("The form needs a 'file' part.", "file", "missing_file")
        if upload.size is None or upload.size > limit:
            raise _too_big(limit)
        expires = _expires_after(form)
        upload.file.seek(0)
        chunks = iter(lambda: upload.file.read(1 << 20), b"")
        try:
            return await asyncio.to_thread(store.add_file, key.tenant, purpose, upload.filename or "input.jsonl",
                                           chunks, upload.size, expires)
        except StorageFull as e:
            raise _storage_full(e, "file") from e
    finally:
        await form.close()


@batch_api.get("/files", responses=_ERRORS)
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000)):
    _, store, key = await _parts(request)
    return _page(*await _call(store.list_files, key.tenant, purpose, after, limit))


@batch_api.get("/files/{file_id}", responses=_ERRORS)
async def get_file(request: Request, file_id: str):
    _, store, key = await _parts(request)
    found = await _call(store.get_file, key.tenant, file_id)
    if found is None:
        raise _not_found("File", file_id)
    return found


@batch_api.get("/files/{file_id}/content", responses={**_JSONL, **_ERRORS})
async def file_content(request: Request, file_id: str):
    _, store, key = await _parts(request)
    found = await _call(store.get_file, key.tenant, file_id)
    if found is None:
        raise _not_found("File", file_id)

    def chunks():  # iterated in a worker thread, a chunk at a time
        with store.open_content(key.tenant, file_id) as content:
            yield from content or ()

    return StreamingResponse(chunks(), media_type="application/jsonl",
                             headers={"content-length": str(found["bytes"])})


@batch_api.delete("/files/{file_id}", responses=_ERRORS)
async def delete_file(request: Request, file_id: str):
    _, store, key = await _parts(request)
    if not await _call(store.delete_file, key.tenant, file_id):
        raise _not_found("File", file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@batch_api.post("/batches", openapi_extra=openapi.body(NewBatch), responses=_ERRORS)
async def create_batch(request: Request):
    svc, store, key = await _parts(request)
    new = parse_body(NewBatch, await read_json(request, svc.config.max_body_bytes))
    if new.endpoint not in ENDPOINTS:
        raise errors.bad_request(f"Invalid value for 'endpoint': {new.endpoint!r}; expected one of "
                                 f"{', '.join(ENDPOINTS)}.", "endpoint", "invalid_value")
    try:
        window_s = window_seconds(new.completion_window)
    except ValueError as e:
        raise errors.bad_request(str(e), "completion_window", "invalid_value") from e
    limit = svc.config.batch_tenant_max_active
    if await _call(store.active_batches, key.tenant) >= limit:  # before the file is read to count its lines
        raise _too_many(f"This tenant has {limit} batches not yet ended, its limit; wait for one to end or "
                        "cancel one.")
    found = await _call(store.get_file, key.tenant, new.input_file_id)
    if found is None:
        raise _not_found("File", new.input_file_id)
    if found["purpose"] != "batch":
        raise errors.bad_request(f"The file {new.input_file_id} has purpose {found['purpose']!r}, not 'batch'.",
                                 "input_file_id", "invalid_file")
    lines = await asyncio.to_thread(_count, store, key.tenant, new.input_file_id, svc.config.max_body_bytes)
    if lines > svc.config.batch_max_lines:
        raise errors.bad_request(f"The input file has {lines} requests; a batch holds at most "
                                 f"{svc.config.batch_max_lines}.", "input_file_id", "too_many_requests")
    try:
        batch_id = await _call(store.create_batch, key.tenant, key.key_id, new.endpoint, new.input_file_id,
                               new.completion_window, window_s, new.metadata, limit)
    except StorageFull as e:
        raise _storage_full(e, "input_file_id") from e
    except TooManyBatches as e:
        raise _too_many(str(e)) from e
    if batch_id is None:  # deleted meanwhile
        raise _not_found("File", new.input_file_id)
    try:  # the batch as created ("validating"), read before the runner is woken to take it on
        return await _batch(store, await _call(store.batch, batch_id))
    finally:
        store.created.set()


def _count(store: BatchStore, tenant: str, file_id: str, max_line_bytes: int) -> int:
    with store.open_content(tenant, file_id, _COUNT_CHUNK) as chunks:
        return count_lines(chunks or (), max_line_bytes)


@batch_api.get("/batches", responses=_ERRORS)
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    _, store, key = await _parts(request)
    rows, more = await _call(store.list_batches, key.tenant, after, limit)
    return _page([await _batch(store, r) for r in rows], more)


@batch_api.get("/batches/{batch_id}", responses=_ERRORS)
async def get_batch(request: Request, batch_id: str):
    _, store, key = await _parts(request)
    row = await _call(store.batch, batch_id, key.tenant)
    if row is None:
        raise _not_found("Batch", batch_id)
    return await _batch(store, row)


@batch_api.post("/batches/{batch_id}/cancel", responses=_ERRORS)
async def cancel_batch(request: Request, batch_id: str):
    _, store, key = await _parts(request)
    row = await _call(store.batch, batch_id, key.tenant)
    if row is None:
        raise _not_found("Batch", batch_id)
    status = Status(row["status"])
    if status in CANCELLABLE:
        try:
            await _call(store.cancel, batch_id)
        except InvalidTransition:  # it ended meanwhile
            status = Status((await _call(store.batch, batch_id))["status"])
    if status not in (*CANCELLABLE, Status.CANCELLING, Status.CANCELLED):  # cancelling twice is no error
        raise errors.APIError(409, f"A batch that is {status} cannot be cancelled.", "invalid_request_error",
                              None, "batch_not_cancellable")
    return await _batch(store, await _call(store.batch, batch_id))
