"""The gateway's batch runner: one background task that moves batches through their states
(``batch.state``) and runs their lines through the gateway's own pipeline (``GatewayService.begin``:
quotas, budgets, the result cache, KV admission, routing, as an online request of the batch's key,
in the ``batch`` class), a few at a time and only into spare capacity: no line starts while an
online request waits for KV room, while a worker's engine has requests waiting, once the decode
pool's KV use passes ``kv_share``, or (where compute is the limit, as on a CPU) while
``online_busy`` online requests are in flight. The spare slots are shared across tenants (each
goes to the tenant with the fewest lines in flight, in turn), oldest batch first within one.
A line refused for a reason that passes (a quota, a budget, its SLO, no capacity) goes back to
pending and its tenant, alone, is held off a while (doubling up to ``backoff_max_s``); after
``max_refusals`` refusals of its own (a quota, a budget, its SLO: not the pool's capacity, which
only backs off until the completion window ends) the line ends in the error file with the last one. A line refused for
its content (a 4xx) is answered in the error file; one that fails on the cloud's side (5xx) is
tried ``_SERVER_ATTEMPTS`` times. A line whose run ends any other way (a failure of ours, the
gateway stopping) goes back to pending in ``finally``: no line stays running. Every call of the
store runs in a worker thread: a wait for its lock never stalls the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from cascade import errors
from cascade.openai_format import formatter_for
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cascade.structured.contract import contract_off_loop
from cascade.web import parse_body
from cloud_tier.gateway.batch.jsonl import ENDPOINTS, MAX_LINE_BYTES, file_errors, parse_lines
from cloud_tier.gateway.batch.state import InvalidTransition, Status, next_status
from cloud_tier.gateway.batch.store import BatchStore
from cloud_tier.gateway.foreign.routing import pressure
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.tenants.keys import ApiKey

log = logging.getLogger(__name__)

_PASSING = {429, 503}  # refusals that pass: the line runs again later ...
_FINAL_CODES = {"tokens_exceed_quota"}  # ... but not these, which never will
# the pool, not the line nor its tenant, is short: wait (backing off), without using up the
# line's refusals; the completion window still ends such a line
_POOL_CODES = {"pool_saturated", "no_workers", "kv_capacity", "no_capacity"}
_SERVER_ATTEMPTS = 3  # a line that fails on the cloud's side (5xx) is tried this often


@dataclass(frozen=True)
class RunnerConfig:
    concurrency: int = 4  # lines in flight at once
    kv_share: float = 0.5  # start lines only while some worker's KV use is under this share
    online_busy: int = 0  # ... and while fewer online requests than this are in flight (0: no such limit)
    max_lines: int = 50_000
    interval_s: float = 0.2  # between looks at the batches while some are open
    idle_interval_s: float = 5.0  # ... and while none is (a batch created through this gateway wakes it at once)
    backoff_s: float = 1.0  # after a passing refusal, no new line of its tenant for this long, doubling ...
    backoff_max_s: float = 60.0  # ... up to this
    max_refusals: int = 10  # a line refused this often ends with the refusal as its answer
    max_line_bytes: int = MAX_LINE_BYTES
    sweep_every_s: float = 60.0  # between deletions of expired files


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
    schema = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    try:
        req = parse_body(schema, body)
        await contract_off_loop(req, endpoint)
        svc.check_model(req.model)
        result = await svc.begin(key, endpoint, body, req, None, request_id, "batch")
        return 200, await result.whole(endpoint, formatter_for(endpoint, svc.model_id, req)), request_id
    except errors.APIError as e:
        return e.status, e.body(), request_id
    except Exception:  # a bug of ours, answered as the app shell would answer it (the line is not lost)
        log.exception("batch line failed")
        return 500, errors.APIError(500, "Internal server error.", "server_error").body(), request_id


Line = tuple[str, int]  # (batch id, index)


class BatchRunner:
    def __init__(self, svc: GatewayService, store: BatchStore, config: RunnerConfig, clock=time.time):
        self.svc = svc
        self.store = store
        self.config = config
        self.clock = clock
        self.in_flight: dict[Line, tuple[str, asyncio.Task]] = {}  # -> (tenant, task)
        self.refusals: Counter[Line] = Counter()
        self.pool_waits: Counter[Line] = Counter()  # refusals for the pool's capacity: back-off only
        self.server_failures: Counter[Line] = Counter()
        self.hold_until: dict[str, float] = {}  # tenant -> monotonic time before which none of its lines start
        self.turns: dict[str, int] = {}  # tenant -> when one of its lines last started (a count)
        self.next_sweep = 0.0

    async def run(self) -> None:
        requeued = await asyncio.to_thread(self.store.requeue_running)
        if requeued:
            log.info("%d batch lines left running by the last gateway run again (or end, if cancelled)", requeued)
        try:
            while True:
                self.store.created.clear()  # before the look: a batch created during it wakes the wait below
                busy = True
                try:
                    busy = await self.step()
                except Exception:  # never let the runner die: the batches wait for the next look
                    log.exception("batch runner step failed")
                if busy or self.in_flight:
                    await asyncio.sleep(self.config.interval_s)
                else:  # nothing open: no look (a thread and a query) five times a second for nothing
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.store.created.wait(), self.config.idle_interval_s)
        finally:
            for _, task in self.in_flight.values():
                task.cancel()  # each puts its line back (the store's state is what the next start reads)
            await asyncio.gather(*(task for _, task in self.in_flight.values()), return_exceptions=True)

    async def step(self) -> bool:
        """One look at the open batches; whether there were any."""
        ready = []
        rows = await asyncio.to_thread(self.store.open_batches)
        for row in rows:
            status = Status(row["status"])
            if status is Status.VALIDATING:
                await self._validate(row)
                continue
            counts = await asyncio.to_thread(self.store.counts, row["id"])
            nxt = next_status(status, counts["pending"], counts["running"], self.clock(), row["expires_at"])
            if nxt is Status.EXPIRED:
                self._stop_lines(row["id"])
                await asyncio.to_thread(self.store.expire, row["id"])
                self._forget(row["id"])
            elif nxt in (Status.FINALIZING, Status.CANCELLED):
                await asyncio.to_thread(self.store.finish, row["id"],
                                        Status.COMPLETED if nxt is Status.FINALIZING else nxt)
                self._forget(row["id"])
            elif status is Status.IN_PROGRESS and counts["pending"]:
                ready.append(row)
        await self._start_lines(ready)
        if time.monotonic() >= self.next_sweep:
            self.next_sweep = time.monotonic() + self.config.sweep_every_s
            swept = await asyncio.to_thread(self.store.sweep_expired)
            if swept:
                log.info("deleted %d expired batch files", swept)
        return bool(rows)

    async def _validate(self, row: dict) -> None:
        gone = [{"code": "file_not_found", "message": "The input file was deleted.", "param": "input_file_id",
                 "line": None}]
        try:
            problems = await asyncio.to_thread(self._check, row)
            if problems is None:
                await asyncio.to_thread(self.store.fail, row["id"], gone)
            elif problems:
                await asyncio.to_thread(self.store.fail, row["id"], problems)
            elif not await asyncio.to_thread(self._start, row):
                await asyncio.to_thread(self.store.fail, row["id"], gone)
        except InvalidTransition:  # cancelled while it was being validated
            pass

    def _check(self, row: dict) -> list[dict] | None:
        with self.store.open_content(row["tenant"], row["input_file_id"]) as chunks:
            if chunks is None:
                return None
            return file_errors(chunks, row["endpoint"], self.config.max_lines, self.config.max_line_bytes)

    def _start(self, row: dict) -> bool:
        """Its lines stored as they are read from the file again (never all in memory)."""
        with self.store.open_content(row["tenant"], row["input_file_id"]) as chunks:
            if chunks is None:
                return False
            self.store.start(row["id"], parse_lines(chunks, row["endpoint"], self.config.max_line_bytes))
            return True

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

    async def _start_lines(self, rows: list[dict]) -> None:
        """Claim lines into the spare slots, one at a time to the tenant with the fewest lines in
        flight (ties: the one whose turn is oldest), from its oldest batch with lines pending."""
        now = time.monotonic()
        self.hold_until = {t: until for t, until in self.hold_until.items() if until > now}
        queues: dict[str, list[dict]] = {}
        for row in rows:  # oldest first
            if row["tenant"] not in self.hold_until:
                queues.setdefault(row["tenant"], []).append(row)
        if not queues:
            return
        mine = len(self.in_flight)
        online = max(0, sum(w.in_flight for w in self.svc.pool.workers.values()) - mine)
        free = spare_slots(self.config, mine, online, self.svc.admission.waiting, self._shares())
        running = Counter(tenant for tenant, _ in self.in_flight.values())
        while free > 0 and queues:
            tenant = min(queues, key=lambda t: (running[t], self.turns.get(t, 0)))
            row = queues[tenant][0]
            claimed = await asyncio.to_thread(self.store.claim, row["id"], 1)
            if not claimed:
                queues[tenant].pop(0)
                if not queues[tenant]:
                    del queues[tenant]
                continue
            ((index, custom_id, body),) = claimed
            self.turns[tenant] = max(self.turns.values(), default=0) + 1
            running[tenant] += 1
            free -= 1
            self.in_flight[row["id"], index] = (tenant, asyncio.create_task(self._run(row, index, custom_id, body)))

    def _stop_lines(self, batch_id: str) -> None:
        for (bid, _), (_, task) in list(self.in_flight.items()):
            if bid == batch_id:
                task.cancel()

    def _forget(self, batch_id: str) -> None:
        for counter in (self.refusals, self.server_failures, self.pool_waits):
            for line in [line for line in counter if line[0] == batch_id]:
                del counter[line]

    async def _run(self, row: dict, index: int, custom_id: str | None, body: dict) -> None:
        line = (row["id"], index)
        settled = False
        try:
            key = self._key(row)
            if key is None:
                status, answer, request_id = 401, errors.unauthorized("The batch's API key was revoked.").body(), ""
            else:
                status, answer, request_id = await run_line(self.svc, key, ENDPOINTS[row["endpoint"]], body)
            if self._passes(line, status, answer):
                tries = self.refusals[line] + self.server_failures[line] + self.pool_waits[line]
                wait = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** min(tries - 1, 30))
                tenant = row["tenant"]
                self.hold_until[tenant] = max(self.hold_until.get(tenant, 0.0), time.monotonic() + wait)
            else:
                for counter in (self.refusals, self.server_failures, self.pool_waits):
                    counter.pop(line, None)
                await asyncio.to_thread(self.store.record, row["id"], index, custom_id, status, answer, request_id)
                settled = True
        finally:
            self.in_flight.pop(line, None)
            if not settled:  # a passing refusal, a failure of ours, the runner stopping: the line goes back
                try:
                    await asyncio.to_thread(self.store.release, *line)
                except Exception:  # the next start's requeue_running puts it back
                    log.exception("batch line %s could not be put back", line)

    def _passes(self, line: Line, status: int, answer: dict) -> bool:
        """Whether a refusal is one to run the line again for, later (each kind a bounded number of times)."""
        code = (answer.get("error") or {}).get("code")
        if status in _PASSING and code in _POOL_CODES:
            self.pool_waits[line] += 1
            return True
        if status in _PASSING and code not in _FINAL_CODES:
            self.refusals[line] += 1
            return self.refusals[line] < self.config.max_refusals
        if status >= 500:
            self.server_failures[line] += 1
            return self.server_failures[line] < _SERVER_ATTEMPTS
        return False

    def _key(self, row: dict) -> ApiKey | None:
        with contextlib.suppress(StopIteration):
            key = next(k for k in self.svc.keys.list(row["tenant"]) if k.key_id == row["key_id"])
            return None if key.revoked else key
        return None
