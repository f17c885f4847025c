"""The gateway's batch runner: one background task that moves batches through their states
(``batch_state``) and runs their lines through the gateway's own pipeline (``GatewayService.begin``:
quotas, budgets, the result cache, KV admission, routing, as an online request of the batch's key,
in the ``batch`` class), a few at a time and only into spare capacity: no line starts while an
online request waits for KV room, while a worker's engine has requests waiting, once the decode
pool's KV use passes ``kv_share``, or (where compute is the limit, as on a CPU) while
``online_busy`` online requests are in flight. A line refused for a reason that passes (a quota, no capacity)
goes back to pending and the runner holds off a while; one refused for its content (a 4xx) is
answered in the error file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

from cascade import errors
from cascade.openai_format import ChatFormatter, CompletionFormatter
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cascade.web import parse_body
from cloud_tier.gateway.batch_jsonl import ENDPOINTS, validate
from cloud_tier.gateway.batch_state import InvalidTransition, Status, next_status
from cloud_tier.gateway.batch_store import BatchStore
from cloud_tier.gateway.keys import ApiKey
from cloud_tier.gateway.openai_results import chunks_to_response
from cloud_tier.gateway.openai_route import pressure
from cloud_tier.gateway.service import GatewayService
from cloud_tier.gateway.streams import first_of, render_stored

log = logging.getLogger(__name__)

_PASSING = {429, 503}  # refusals that pass: the line runs again later ...
_FINAL_CODES = {"tokens_exceed_quota"}  # ... but not these, which never will
_SERVER_ATTEMPTS = 3  # a line that fails on the cloud's side (5xx) is tried this often


@dataclass(frozen=True)
class RunnerConfig:
    concurrency: int = 4  # lines in flight at once
    kv_share: float = 0.5  # start lines only while some worker's KV use is under this share
    online_busy: int = 0  # ... and while fewer online requests than this are in flight (0: no such limit)
    max_lines: int = 50_000
    interval_s: float = 0.2  # between looks at the batches
    backoff_s: float = 1.0  # after a passing refusal, no new line for this long


def spare_slots(config: RunnerConfig, in_flight: int, online_in_flight: int, online_waiting: int,
                shares: list[float]) -> int:
    """How many lines may start now: none while online requests wait, while ``online_busy`` of
    them are in flight, or while every worker is past ``kv_share`` (a share of 1.0 stands for a
    worker whose engine queues requests)."""
    if online_waiting or not shares or min(shares) >= config.kv_share:
        return 0
    if config.online_busy and online_in_flight >= config.online_busy:
        return 0
    return max(0, config.concurrency - in_flight)


async def run_line(svc: GatewayService, key: ApiKey, endpoint: str, body: dict) -> tuple[int, dict, str]:
    """One request through the pipeline, answered whole: (status code, body, request id)."""
    request_id = uuid.uuid4().hex
    schema, formatter = ((ChatCompletionRequest, ChatFormatter) if endpoint == "chat"
                         else (CompletionRequest, CompletionFormatter))
    try:
        req = parse_body(schema, body)
        svc.check_model(req.model)
        result, _ = await svc.begin(key, endpoint, body, req, None, request_id, "batch")
        if isinstance(result, dict) and "openai" in result:  # a foreign pool's stored answer
            return 200, (result["events"][0] if result["openai"] == "body"
                         else chunks_to_response(result["events"], endpoint)), request_id
        if svc.pool.foreign:
            return 200, await first_of(result), request_id
        fmt = formatter(svc.model_id, req.logprobs)
        if isinstance(result, dict):  # a result cache hit
            return 200, json.loads(render_stored(result, fmt)), request_id
        tokens = []
        try:
            async for ev in result:
                tokens.append(ev)
        finally:
            await result.aclose()
        return 200, fmt.response(tokens[:-1], tokens[-1]).model_dump(exclude_none=True), request_id
    except errors.APIError as e:
        return e.status, e.body(), request_id
    except Exception:  # a bug of ours, answered as the app shell would answer it (the line is not lost)
        log.exception("batch line failed")
        return 500, errors.APIError(500, "Internal server error.", "server_error").body(), request_id


class BatchRunner:
    def __init__(self, svc: GatewayService, store: BatchStore, config: RunnerConfig, clock=time.time):
        self.svc = svc
        self.store = store
        self.config = config
        self.clock = clock
        self.in_flight: dict[tuple[str, int], asyncio.Task] = {}
        self.server_failures: dict[tuple[str, int], int] = {}
        self.hold_until = 0.0  # monotonic: no new line before

    async def run(self) -> None:
        requeued = self.store.requeue_running()
        if requeued:
            log.info("%d batch lines left running by the last gateway run again", requeued)
        try:
            while True:
                try:
                    await self.step()
                except Exception:  # never let the runner die: the batches wait for the next look
                    log.exception("batch runner step failed")
                await asyncio.sleep(self.config.interval_s)
        finally:
            for task in self.in_flight.values():
                task.cancel()  # their lines stay running in the store: the next start runs them again
            await asyncio.gather(*self.in_flight.values(), return_exceptions=True)

    async def step(self) -> None:
        for row in self.store.open_batches():
            status = Status(row["status"])
            if status is Status.VALIDATING:
                await self._validate(row)
                continue
            counts = self.store.counts(row["id"])
            nxt = next_status(status, counts["pending"], counts["running"], self.clock(), row["expires_at"])
            if nxt is Status.EXPIRED:
                self._stop_lines(row["id"])
                self.store.expire(row["id"])
            elif nxt in (Status.FINALIZING, Status.CANCELLED):
                self.store.finish(row["id"], Status.COMPLETED if nxt is Status.FINALIZING else nxt)
            elif status is Status.IN_PROGRESS:
                self._start_lines(row)

    async def _validate(self, row: dict) -> None:
        content = self.store.file_content(row["tenant"], row["input_file_id"])
        try:
            if content is None:
                self.store.fail(row["id"], [{"code": "file_not_found", "message": "The input file was deleted.",
                                             "param": "input_file_id", "line": None}])
                return
            checked = await asyncio.to_thread(validate, content, row["endpoint"], self.config.max_lines)
            if checked.errors:
                self.store.fail(row["id"], checked.errors)
            else:
                self.store.start(row["id"], checked.lines)
        except InvalidTransition:  # cancelled while it was being validated
            pass

    def _shares(self) -> list[float]:
        now = time.monotonic()
        shares = []
        for w in self.svc.pool.by_role("decode", "both"):
            if not w.available():
                continue
            if self.svc.pool.foreign:
                shares.append(pressure(w, self.svc.routing, now))
            else:
                load = w.load()
                queued = w.report is not None and w.report.waiting > 0
                shares.append(1.0 if queued or not load.kv_blocks_total else load.kv_blocks_used / load.kv_blocks_total)
        return shares

    def _start_lines(self, row: dict) -> None:
        if time.monotonic() < self.hold_until:
            return
        mine = len(self.in_flight)
        online = max(0, sum(w.in_flight for w in self.svc.pool.workers.values()) - mine)
        n = spare_slots(self.config, mine, online, self.svc.admission.waiting, self._shares())
        if n <= 0:
            return
        for index, custom_id, body in self.store.claim(row["id"], n):
            task = asyncio.create_task(self._run(row, index, custom_id, body))
            self.in_flight[row["id"], index] = task

    def _stop_lines(self, batch_id: str) -> None:
        for (bid, _), task in list(self.in_flight.items()):
            if bid == batch_id:
                task.cancel()

    async def _run(self, row: dict, index: int, custom_id: str | None, body: dict) -> None:
        line = (row["id"], index)
        try:
            key = self._key(row)
            if key is None:
                status, answer, request_id = 401, errors.unauthorized("The batch's API key was revoked.").body(), ""
            else:
                status, answer, request_id = await run_line(self.svc, key, ENDPOINTS[row["endpoint"]], body)
            if self._passes(line, status, answer):
                self.store.release(*line)
                self.hold_until = time.monotonic() + self.config.backoff_s
                return
            self.server_failures.pop(line, None)
            self.store.record(row["id"], index, custom_id, status, answer, request_id)
        finally:
            self.in_flight.pop(line, None)

    def _passes(self, line: tuple[str, int], status: int, answer: dict) -> bool:
        """Whether a refusal is one to run the line again for, later."""
        code = (answer.get("error") or {}).get("code")
        if status in _PASSING and code not in _FINAL_CODES:
            return True
        if status >= 500:
            self.server_failures[line] = self.server_failures.get(line, 0) + 1
            return self.server_failures[line] < _SERVER_ATTEMPTS
        return False

    def _key(self, row: dict) -> ApiKey | None:
        with contextlib.suppress(StopIteration):
            key = next(k for k in self.svc.keys.list(row["tenant"]) if k.key_id == row["key_id"])
            return None if key.revoked else key
        return None
