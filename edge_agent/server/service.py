"""The edge agent's serving logic: turn an OpenAI request into a generation job, run it on a
free backend slot in a worker thread, and hand its tokens back to the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cascade import errors
from cascade.chat_template import ChatTemplateError, chat_messages
from cascade.protocol import ChatCompletionRequest, CompletionRequest
from cascade.structured.contract import TEXT, OutputContract
from cascade.structured.grammar import check, contract_param, grammar_of
from cascade.structured.matcher import GrammarRefused
from edge_agent.backends.base import Backend, Finish, GenerationOptions, TokenEvent
from edge_agent.config import EdgeConfig
from edge_agent.server.metrics import EdgeMetrics
from edge_agent.server.slots import SlotPool, TooManyWaiting

log = logging.getLogger(__name__)


class LocalRun:
    """A local generation's events (``async for``). Its slot reservation is given back however it
    ends: by the generator once it has started, or by ``aclose()`` (or, as a last resort, by
    garbage collection) when nobody ever iterated it, e.g. a request refused after its slot was
    reserved. An async generator that never started runs no ``finally``, hence this wrapper."""

    def __init__(self, events: AsyncIterator, give_back: Callable[[], None]):
        self._events = events
        self._give_back: Callable[[], None] | None = give_back
        self._loop = asyncio.get_running_loop()

    def __aiter__(self) -> LocalRun:
        return self

    async def __anext__(self):
        self._give_back = None  # from here the generator owns the reservation
        return await self._events.__anext__()

    async def aclose(self) -> None:
        self._settle()
        await self._events.aclose()

    def _settle(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __del__(self):
        if self._give_back is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._settle)


@dataclass
class LocalJob:
    """One request, ready to generate: its prompt tokens and sampling options."""

    kind: str  # "chat" | "completion"
    prompt_tokens: list[int]
    options: GenerationOptions
    contract: OutputContract = TEXT  # what the answer's shape must be (response_format, tools)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)


class EdgeService:
    """Owns the backends (one per slot), the wait for a slot and the request metrics."""

    def __init__(self, config: EdgeConfig, backends: list[Backend], model_names: set[str],
                 metrics: EdgeMetrics):
        if not backends:
            raise ValueError("at least one backend is needed")
        self.config = config
        self.backends = backends
        self.model_names = model_names
        self.metrics = metrics
        self.pool: SlotPool[Backend] = SlotPool(backends, config.queue.max_waiting)
        self.description = backends[0].description
        self.decode_tok_s = 0.0  # moving average of one slot's decode speed (0: not measured yet)
        self._running: dict[threading.Thread, tuple[LocalJob, Backend]] = {}  # until each thread ends

    @property
    def model_id(self) -> str:
        return self.description.name

    def close(self, join_timeout_s: float = 30.0) -> None:
        """Stop every generation, wait for its thread to leave the backend, then unload. A backend
        a thread still uses after ``join_timeout_s`` is left loaded: freeing llama.cpp under a
        running decode crashes the process."""
        running = dict(self._running)
        for job, _ in running.values():
            job.cancel.set()
        deadline = time.monotonic() + join_timeout_s
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = {id(b) for t, (_, b) in running.items() if t.is_alive()}
        for b in self.backends:
            if id(b) in busy:
                log.error("a generation did not stop within %.0f s; its model is not unloaded", join_timeout_s)
                continue
            b.unload()

    # -- request -> job --------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise errors.model_not_found(model)

    def chat_job(self, req: ChatCompletionRequest, contract: OutputContract = TEXT) -> LocalJob:
        self.check_model(req.model)
        backend = self.backends[0]
        tools = [t.openai() for t in contract.tools] if contract.calls_tools else None
        try:
            prompt = backend.apply_chat_template(chat_messages(req.messages), tools)
        except ChatTemplateError as e:
            raise errors.bad_request(str(e), "messages") from e
        tokens = backend.chat_prompt_tokens(prompt)
        stops = tuple(req.stop_list()) + backend.chat_stop_strings()
        options = self._options(req, len(tokens), req.token_limit(), stops,
                                req.top_logprobs or 0, "messages", self._grammar(contract))
        return LocalJob("chat", tokens, options, contract)

    def _grammar(self, contract: OutputContract) -> str | None:
        """The grammar the device holds ``contract``'s answer to (None: free text, or the agent's
        ``constrain`` is off); a 400 when the device cannot enforce it: coded as the gateway codes it
        (``unsupported_schema_keyword``, ``invalid_schema``), or ``schema_unsupported`` when it cannot be
        compiled here within the bounds. The cascade escalates these when it has a cloud."""
        if not contract.structured or not self.config.cascade.constrain:
            return None
        backend = self.backends[0]
        param = contract_param(contract)
        try:
            grammar = grammar_of(contract, backend.special_tool_tags)
            check(grammar, param)
            backend.grammars().matcher(grammar)  # compiled once here, cached for the generation
        except (GrammarRefused, NotImplementedError) as e:
            raise errors.bad_request(f"The device cannot enforce '{param}': {e}", param, "schema_unsupported") from e
        return grammar

    def completion_job(self, req: CompletionRequest, contract: OutputContract = TEXT) -> LocalJob:
        self.check_model(req.model)
        backend = self.backends[0]
        if isinstance(req.prompt, str):
            tokens = backend.tokenize(req.prompt)
        else:
            tokens = list(req.prompt)
            vocab = self.description.n_vocab
            if any(t < 0 or t >= vocab for t in tokens):
                raise errors.bad_request(f"prompt token ids must be in [0, {vocab}).", "prompt")
        options = self._options(req, len(tokens), req.token_limit(), tuple(req.stop_list()),
                                req.logprobs or 0, "prompt", self._grammar(contract))
        return LocalJob("completion", tokens, options, contract)

    def _options(self, req, n_prompt: int, max_tokens: int | None, stops: tuple[str, ...],
                 top_logprobs: int, prompt_param: str, grammar: str | None = None) -> GenerationOptions:
        n_ctx = self.description.n_ctx
        if n_prompt >= n_ctx:
            raise errors.bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, your "
                f"{prompt_param} resulted in {n_prompt} tokens.", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.config.queue.default_max_tokens, n_ctx - n_prompt)
        elif n_prompt + max_tokens > n_ctx:
            raise errors.bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} in "
                f"the completion). Please reduce the length of the {prompt_param} or completion.",
                "max_tokens", "context_length_exceeded")
        return GenerationOptions(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            stop=stops,
            repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            top_logprobs=top_logprobs,
            grammar=grammar,
        )

    # -- running ---------------------------------------------------------------------------

    def admit(self) -> asyncio.Future[Backend]:
        """A place in line for a slot, or 429 with Retry-After when the queue is full."""
        try:
            reservation = self.pool.reserve()
        except TooManyWaiting as e:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise errors.too_many_requests(
                "The edge agent's queue is full; retry later.", e.retry_after_s, "queue_full") from e
        self.metrics.observe_queue(self.pool)
        return reservation

    def swap(self, backends: list[Backend], model_names: set[str]) -> SlotPool[Backend]:
        """Serve ``backends`` from now on (a model switch): new requests get their slots; requests
        holding or waiting for a slot of the old pool finish there. Returns the old pool, whose
        backends the caller unloads once it is idle."""
        old = self.pool
        self.backends, self.model_names = backends, model_names
        self.pool = SlotPool(backends, self.config.queue.max_waiting)
        self.description = backends[0].description
        self.decode_tok_s = 0.0
        self.metrics.observe_queue(self.pool)
        return old

    def run(self, job: LocalJob, reservation: asyncio.Future[Backend]) -> LocalRun:
        """The job's events, generated on the reserved slot. Closing them (``aclose``), whether
        iteration started or not, gives the reservation back (to the pool it came from, even if
        the model was switched meanwhile)."""
        pool = self.pool
        return LocalRun(self._generate(job, reservation, pool), lambda: self._give_back(reservation, pool))

    def _give_back(self, reservation: asyncio.Future[Backend], pool: SlotPool[Backend]) -> None:
        pool.cancel(reservation)
        self.metrics.observe_queue(self.pool)

    async def _generate(self, job: LocalJob, reservation: asyncio.Future[Backend],
                        pool: SlotPool[Backend]) -> AsyncIterator[TokenEvent | Finish]:
        """Wait for the reserved slot, generate in a worker thread, yield its events.

        If the consumer stops early (client gone), the generation is cancelled and the slot
        returns to the pool once the worker thread has stopped touching the backend.
        """
        loop = asyncio.get_running_loop()
        try:
            backend = await reservation
        except BaseException:
            pool.cancel(reservation)
            self.metrics.observe_queue(self.pool)
            raise
        self.metrics.observe_queue(self.pool)
        events: asyncio.Queue = asyncio.Queue()
        started = time.perf_counter()

        def work() -> None:
            try:
                for event in backend.generate(job.prompt_tokens, job.options, job.cancel):
                    loop.call_soon_threadsafe(events.put_nowait, event)
            except BaseException as e:  # delivered to the consumer, which re-raises it
                loop.call_soon_threadsafe(events.put_nowait, e)
            finally:
                self._running.pop(thread, None)
                try:
                    loop.call_soon_threadsafe(self._release, pool, backend, started)
                except RuntimeError:  # the loop is closed: the process is stopping
                    pass

        thread = threading.Thread(target=work, name="edge-generate", daemon=True)
        self._running[thread] = (job, backend)
        thread.start()
        m = self.metrics
        first = last = None
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                t = time.perf_counter()
                if isinstance(event, Finish):
                    self._observe_finish(job, event, t, first, last)
                else:
                    m.generation_tokens.inc()
                    if last is None:
                        first = t
                        m.ttft.observe(t - job.arrived)
                    else:
                        m.itl.observe(t - last)
                    last = t
                yield event
                if isinstance(event, Finish):
                    return
        finally:
            job.cancel.set()  # no-op once finished; stops a generation nobody reads any more

    def _observe_finish(self, job: LocalJob, event: Finish, t: float, first: float | None,
                        last: float | None) -> None:
        """A finished generation's metrics, and the decode rate (a moving average) its tokens show."""
        m = self.metrics
        m.prompt_tokens.inc(event.prompt_tokens)
        m.cached_prompt_tokens.inc(event.cached_tokens)
        m.e2e.observe(t - job.arrived)
        log.debug("generated %d token(s) (%s) after a %d-token prompt (%d cached) in %.2f s, first "
                  "token at %s s", event.completion_tokens, event.finish_reason, event.prompt_tokens,
                  event.cached_tokens, t - job.arrived,
                  "-" if first is None else f"{first - job.arrived:.3f}")
        if first is not None and last is not None and last > first and event.completion_tokens > 1:
            rate = (event.completion_tokens - 1) / (last - first)
            self.decode_tok_s = rate if not self.decode_tok_s else 0.8 * self.decode_tok_s + 0.2 * rate

    def _release(self, pool: SlotPool[Backend], backend: Backend, started: float) -> None:
        pool.release(backend, time.perf_counter() - started)
        self.metrics.observe_queue(self.pool)
