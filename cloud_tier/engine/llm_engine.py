"""The engine: ``schedule() -> execute(batch) -> update(output)`` per step, plus the offline
``generate`` that runs steps until every prompt is done.

    engine = LLMEngine.from_model("smollm2-135m", dtype="float32")
    outs = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cloud_tier.engine.detokenizer import IncrementalDetokenizer
from cloud_tier.engine.handoff import KVCapacityError, KVHandoff, KVLayout, model_identity
from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.kv_moves import KVMover, measure_copy_s_per_byte
from cloud_tier.engine.model_runner import ModelRunner
from cloud_tier.engine.models.loader import load_model, read_config
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine.request import Request, RequestStatus, ServiceLevel
from cloud_tier.engine.sampler import TokenLogprobs
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from cloud_tier.engine.swap import SwapSpace
from cloud_tier.engine.window_kv import window_group
from cloud_tier.engine_config import EngineConfig, resolve_dtype
from cloud_tier.sampling import SamplingParams
from model_distribution.artifacts.model_dirs import resolve_model_dir

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """The engine's output-side state of one request."""

    request: Request
    detok: IncrementalDetokenizer
    output: RequestOutput


class LLMEngine:
    def __init__(self, config: EngineConfig):
        # "auto" resolved here, once: the KV layout and model identity name the dtype that runs
        config = self.config = replace(config, dtype=resolve_dtype(config.dtype, config.device))
        self.model_dir = resolve_model_dir(config.model)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)  # EngineConfig checked the name
        hf_config = read_config(self.model_dir)
        self.max_model_len = min(config.max_model_len, hf_config.get("max_position_embeddings", config.max_model_len))
        self.model = load_model(self.model_dir, self.dtype, self.device, self.max_model_len)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, self.tokenizer, hf_config)
        per_block = ModelRunner.bytes_per_block(self.model, config.block_size, self.dtype, config.kv_cache_dtype)
        window, per_block, window_bytes = window_group(config, self.model.layer_windows(), per_block)
        num_blocks = config.num_kv_blocks or max(1, (config.kv_cache_memory_bytes - window_bytes) // per_block)
        if num_blocks * config.block_size < self.max_model_len:  # one such request could never run
            raise ValueError(f"the KV cache holds {num_blocks * config.block_size} tokens ({num_blocks} blocks of "
                             f"{config.block_size}), less than max_model_len {self.max_model_len}: raise the KV "
                             f"budget ({num_blocks * per_block} bytes) or lower max_model_len")
        num_layers, n_kv, head_dim = self.model.kv_shape
        kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        self.kv_layout = KVLayout(config.block_size, kv_dtype, num_layers, n_kv, head_dim)
        self.model_identity = model_identity(self.model_dir.name, config.dtype, self.kv_layout)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching and window is None,
                                 model_identity=self.model_identity, tier_blocks=config.kv_tier_bytes // per_block,
                                 window=window)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.dtype,
                                  self.device, config.seed, config.kv_cache_dtype,
                                  config.kv_window_blocks if window is not None else 0,
                                  self.kv.get_window_block_ids)
        # read_blocks covers one group: with two, a preempted request is recomputed
        mode = config.preemption_mode if window is None else "recompute"
        swap = SwapSpace(mode, config.swap_space_bytes, per_block)
        if mode != "recompute":
            swap.copy_s_per_byte = measure_copy_s_per_byte(self.runner, num_blocks)
        self.scheduler = Scheduler(replace(config.scheduler, max_model_len=self.max_model_len), self.kv, swap=swap)
        self.kv_mover = KVMover(self.runner, self.kv, swap, _tier_dir(config))
        self._tracked: dict[str, _Tracked] = {}
        self._handoffs: dict[str, tuple[list[TokenLogprobs], bytes | None]] = {}
        self.stalled = False  # the last step ran nothing while requests wait (KV held for transfers)
        log.info("engine ready: %s (%s, KV %s, %s), %d KV blocks of %d tokens (%.0f MiB)", self.model_dir.name,
                 config.dtype, kv_dtype, config.device, num_blocks, config.block_size, num_blocks * per_block / 2**20)

    @classmethod
    def from_model(cls, model: str, **kwargs) -> LLMEngine:
        """``model``: a catalogue name (``smollm2-135m``), a .gguf path or an HF directory;
        ``kwargs``: any EngineConfig field."""
        return cls(EngineConfig(model=model, **kwargs))

    # -- requests ------------------------------------------------------------------------

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     arrival_time: float | None = None, slo: ServiceLevel | None = None) -> Request:
        """Tokenize and validate a prompt into a request record (raises ValueError). Safe to call
        from another thread than the one stepping the engine. ``slo``: its class, targets and
        deadline (a ``time.monotonic()`` time)."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model.config["vocab_size"]
        if not token_ids or any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be non-empty and in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens; this model's maximum context "
                             f"length is {self.max_model_len} tokens")
        req = Request(request_id or uuid.uuid4().hex, token_ids, params, eos_token_ids=self.eos_token_ids,
                      priority=priority, arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                      slo=slo or ServiceLevel())
        self.scheduler.check_admissible(req)  # reads only the configuration: safe on any thread
        return req

    def add(self, req: Request) -> str:
        """Queue a request made by ``make_request`` (ValueError if refused; SLOMissError, a
        ValueError, if it would miss its TTFT target)."""
        self.scheduler.add_request(req)
        params = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        out = RequestOutput(req.request_id, list(req.prompt_token_ids), arrival_time=req.arrival_time,
                            logprobs=[] if params.logprobs is not None else None)
        self._tracked[req.request_id] = _Tracked(req, detok, out)
        return req.request_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue a prompt (text, or token ids); returns its request id."""
        return self.add(self.make_request(prompt, params, request_id, priority))

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self.release_kv(request_id)
        self._forget(request_id)

    def abort_request(self, req: Request) -> bool:
        """Abort ``req`` itself, if this engine holds it: not another request that has its id
        (``req`` may have been refused as a duplicate). Whether it did."""
        rid = req.request_id
        if self.scheduler.requests.get(rid) is not req and self.scheduler.held.get(rid) is not req:
            return False
        self.abort(rid)
        return True

    # -- disaggregation: hand a prefilled request over, or adopt one ----------------------

    def export_kv(self, request_id: str) -> KVHandoff:
        """What a decode worker needs to continue a request that finished here with status
        FINISHED_TRANSFERRED (made with ``kv_transfer=True``). Its blocks stay held until
        ``release_kv``."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} holds no KV for a transfer")
        self._check_one_kv_group()
        logprobs, state = self._handoffs.get(request_id, ([], None))
        return KVHandoff(req, logprobs, state, self.runner.read_blocks(self.kv.get_block_ids(request_id)))

    def release_kv(self, request_id: str) -> None:
        """Free the KV of a handed-over request (after the transfer, or when it failed)."""
        self.scheduler.release(request_id)
        self._handoffs.pop(request_id, None)

    def adopt(self, req: Request, kv: torch.Tensor, logprobs: TokenLogprobs | None = None,
              sampler_state: bytes | None = None, num_cached_tokens: int = 0) -> RequestOutput:
        """Continue a request prefilled elsewhere: ``req`` carries its prompt and first token,
        ``kv`` its prompt's blocks. Returns the output for the first token; later steps go on
        from there. KVCapacityError (nothing changed) if the blocks do not fit now; ValueError
        (nothing changed) if ``kv`` is not in this cache's layout or the request is refused."""
        self._check_one_kv_group()
        num_blocks = self.kv.blocks_for_tokens(req.num_prompt_tokens)
        self.runner.check_payload(kv, num_blocks)
        if not self.scheduler.adopt(req):
            raise KVCapacityError(f"{num_blocks} KV blocks needed, {self.kv.num_free_blocks} free")
        try:
            self.kv_mover.save_evicted()  # what its blocks held goes to the tier before it is overwritten
            self.runner.write_blocks(self.kv.get_block_ids(req.request_id), kv)
        except Exception:  # the prompt's blocks are hashed already: keep them out of the prefix cache
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            raise
        req.num_cached_tokens = num_cached_tokens
        if sampler_state is not None:
            self.runner.sampler.set_state(req.request_id, sampler_state)
        params = req.sampling_params
        tracked = _Tracked(req, IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output),
                           RequestOutput(req.request_id, list(req.prompt_token_ids), arrival_time=req.arrival_time,
                                         logprobs=[] if params.logprobs is not None else None))
        self._tracked[req.request_id] = tracked
        return self._process(tracked, req.output_token_ids[0], logprobs, time.monotonic())

    def calibrate(self, prefill_tokens: int = 128, decodes: int = 8, context: int = 32, repeats: int = 3) -> None:
        """Teach the scheduler's step-cost model this machine's speed before the first request
        (a server calls this once at start): steps of one decode, of ``decodes`` decodes, of a
        prefill and of both, each timed at its best of ``repeats`` runs after a warm-up, over free
        blocks of the cache (nothing is cached yet: the KV written is never read). Without it the
        model starts from a prior and learns from the first steps, too late for the TTFT
        estimates of a burst that comes at once."""
        bs = self.config.block_size
        prefill_tokens = min(prefill_tokens, self.max_model_len - 1, self.kv.num_blocks * bs // 2)
        per_decode = self.kv.blocks_for_tokens(context)
        decodes = max(2, min(decodes, (self.kv.num_blocks - self.kv.blocks_for_tokens(prefill_tokens)) // per_decode))
        if (self.kv.num_free_blocks < self.kv.num_blocks or prefill_tokens < 2 or context >= self.max_model_len
                or self.kv.window is not None):
            return  # the cache is in use (or too small, or in two groups): learn from the steps instead
        blocks = iter(range(self.kv.num_blocks))
        prefill = Request("calibrate-prefill", [0] * prefill_tokens, SamplingParams(temperature=0.0))
        prefill_blocks = [next(blocks) for _ in range(self.kv.blocks_for_tokens(prefill_tokens))]
        decoding = []
        for i in range(decodes):
            r = Request(f"calibrate-decode-{i}", [0] * context, SamplingParams(temperature=0.0))
            r.num_computed_tokens = context - 1
            decoding.append(ScheduledRequest(r, 1, [next(blocks) for _ in range(per_decode)]))
        half = ScheduledRequest(prefill, prefill_tokens // 2, prefill_blocks)
        # four short prompts in one step: what each prefill chunk costs beyond its tokens
        quarter = min(context, max(2, prefill_tokens // 4))
        chunks = [ScheduledRequest(Request(f"calibrate-chunk-{i}", [0] * quarter, SamplingParams(temperature=0.0)),
                                   quarter, d.block_ids) for i, d in enumerate(decoding[:4])]
        steps = [decoding[:1], decoding, [ScheduledRequest(prefill, prefill_tokens, prefill_blocks)], [half, *decoding],
                 chunks]
        try:
            for scheduled in steps:
                out = SchedulerOutput(scheduled=scheduled)
                times = []
                for _ in range(repeats + 1):
                    started = time.perf_counter()
                    self.runner.execute(out)
                    times.append(time.perf_counter() - started)
                for _ in range(4):  # worth a few steps: the first requests' estimates lean on it
                    self.scheduler.observe_step(out, min(times[1:]))
        finally:
            for r in (prefill, *(d.request for d in (*decoding, *chunks))):
                self.runner.sampler.forget(r.request_id)
        c = self.scheduler.cost
        log.info("step cost: %.1f ms + %.3f ms per prefill token + %.2f ms per prefill chunk + %.2f ms per decode",
                 1e3 * c.base_s, 1e3 * c.per_prefill_token_s, 1e3 * c.per_prefill_seq_s, 1e3 * c.per_decode_s)

    def _check_one_kv_group(self) -> None:
        if self.kv.window is not None:
            raise ValueError("KV handoff needs one block table for all layers: this engine has kv_window_blocks")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One batch: returns an output for every request that got tokens or finished. A request
        that cannot go on ends with finish_reason "error" (its output says why); the others and
        the engine go on."""
        scheduled = self.scheduler.schedule()
        outputs = self._ended_early(scheduled)
        self.stalled = scheduled.is_empty and self.scheduler.has_unfinished()
        if scheduled.is_empty:
            self.kv_mover.before_step(scheduled)  # swap-outs of a step that runs nothing else
            return outputs
        try:
            self.kv_mover.before_step(scheduled)
            started = time.perf_counter()
            result = self.runner.execute(scheduled)
            elapsed = time.perf_counter() - started
            self._observe_prefill(scheduled, elapsed)
        except Exception as e:  # which request broke the batch is unknown: it all fails, unwritten KV unused
            log.exception("a step of %d requests failed", len(scheduled.scheduled))
            failed = (self._fail(s.request, f"the engine step failed: {e!r}") for s in scheduled.scheduled)
            return outputs + [out for out in failed if out is not None]
        self.scheduler.observe_step(scheduled, elapsed)
        self.scheduler.update(scheduled, result.sampled)
        now = time.monotonic()
        for s in scheduled.scheduled:
            rid = s.request.request_id
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            if rid in result.failed:
                out = self._fail(s.request, result.failed[rid])
            elif rid in result.sampled:
                try:
                    out = self._process(tracked, result.sampled[rid], result.logprobs.get(rid), now)
                except Exception as e:  # a bug on this request's output side fails it alone
                    log.exception("the output of %s failed", rid)
                    out = self._fail(s.request, f"its output failed: {e!r}")
            else:
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _ended_early(self, scheduled) -> list[RequestOutput]:
        """Final outputs of the requests the scheduler ended before this step: past their deadline
        (finish "length" with what they have, ``truncated="deadline"``) or refused for a TTFT
        target that passed while they queued (``retry_after_s`` set)."""
        outputs = []
        for req in (*scheduled.expired, *scheduled.rejected):
            tracked = self._tracked.get(req.request_id)
            self._handoffs.pop(req.request_id, None)
            self._forget(req.request_id)
            if tracked is None:
                continue
            out = tracked.output
            out.new_token_ids, out.new_logprobs = [], []
            out.delta_text = tracked.detok.finish()
            out.text = tracked.detok.text
            out.finished, out.finish_reason = True, req.status.finish_reason
            out.num_cached_tokens = max(req.num_cached_tokens, 0)
            if req.truncated:
                out.truncated = req.truncated
            else:
                out.retry_after_s = 1.0
                out.error = "its time-to-first-token target passed, or would pass, while it waited"
            outputs.append(out)
        return outputs

    def _fail(self, req: Request, why: str) -> RequestOutput | None:
        """End ``req`` with an error, its blocks freed and kept out of the prefix cache; its
        final output (None if nothing tracks it)."""
        rid = req.request_id
        log.warning("request %s failed: %s", rid, why)
        if req.is_finished:  # it ended in this step's update: only a held prefill still has blocks
            self.scheduler.release(rid)
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
        self._handoffs.pop(rid, None)
        tracked = self._tracked.get(rid)
        self._forget(rid)
        if tracked is None:
            return None
        out = tracked.output
        out.new_token_ids, out.new_logprobs, out.delta_text = [], [], ""
        out.finished, out.finish_reason, out.error = True, req.status.finish_reason, why
        out.num_cached_tokens = max(req.num_cached_tokens, 0)
        return out

    def _process(self, t: _Tracked, token: int, logprobs, now: float) -> RequestOutput:
        req, out = t.request, t.output
        out.new_token_ids = [token]
        out.token_ids.append(token)
        # as vLLM: the stop token is in token_ids, its text only if asked for
        hidden = (req.status == RequestStatus.FINISHED_STOPPED and req.is_stop_token(token)
                  and not req.sampling_params.include_stop_str_in_output)
        out.delta_text = "" if hidden else t.detok.add(token)
        out.new_logprobs = [logprobs] if logprobs is not None else []
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append(logprobs)
        if out.first_token_time is None:
            out.first_token_time = now
        if t.detok.stopped:  # a stop string, even on the token that also hit max_tokens
            if req.is_finished:
                self.scheduler.release(req.request_id)  # no transfer: it ends here
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        if req.status == RequestStatus.FINISHED_TRANSFERRED:
            self._handoffs[req.request_id] = (list(out.new_logprobs),
                                              self.runner.sampler.get_state(req.request_id))
        if req.is_finished:
            out.delta_text += t.detok.finish()
            out.finished = True
            out.finish_reason = req.status.finish_reason
            out.num_cached_tokens = max(req.num_cached_tokens, 0)
            self._forget(req.request_id)
        out.text = t.detok.text
        return out

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.runner.sampler.forget(request_id)

    def _observe_prefill(self, out, seconds: float) -> None:
        """Feed the recompute cost estimate from steps that are mostly prefill."""
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        if prefill * 2 >= out.num_batched_tokens:
            self.scheduler.swap.observe_prefill(seconds, out.num_batched_tokens)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run ``prompts`` to completion as one continuous batch; outputs in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # -- introspection -------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def stats(self) -> dict:
        s = self.scheduler
        return {"kv_blocks_total": self.kv.num_blocks, "kv_blocks_free": self.kv.num_free_blocks,
                "kv_usage": self.kv.usage, "waiting": s.num_waiting,
                "running": s.num_running, "preemptions": s.num_preemptions,
                "prefix_cache_queries": self.kv.stats.queries, "prefix_cache_hits": self.kv.stats.hits,
                "slo_rejected": sum(s.num_rejected.values()), "deadline_expired": s.num_expired,
                "step_base_s": s.cost.base_s, "step_prefill_token_s": s.cost.per_prefill_token_s,
                "step_decode_s": s.cost.per_decode_s, "step_prefill_seq_s": s.cost.per_prefill_seq_s,
                **{"preemptions_" + k: v for k, v in dataclasses.asdict(s.swap.stats).items()},
                **({"kv_tier_" + k: v for k, v in dataclasses.asdict(self.kv.tier.stats).items()}
                   if self.kv.tier is not None else {})}


def _tier_dir(config: EngineConfig) -> Path:
    if config.kv_tier_path:
        return Path(config.kv_tier_path).expanduser()
    from cascade.config import cascade_home

    return cascade_home() / "engine"


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _eos_ids(model_dir: Path, tokenizer, hf_config: dict) -> frozenset[int]:
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, hf_config):
        eos = source.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
