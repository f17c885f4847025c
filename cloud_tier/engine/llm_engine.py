"""The engine: ``schedule() -> execute(batch) -> update(output)`` per step, plus the offline
``generate`` that runs steps until every prompt is done.

    engine = LLMEngine.from_model("smollm2-135m", dtype="float32")
    outs = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import torch

from cloud_tier.engine.calibrate import calibrate_step_cost
from cloud_tier.engine.draft import Draft
from cloud_tier.engine.guided import Guides
from cloud_tier.engine.handoff import KVCapacityError, KVHandoff, KVLayout, model_identity
from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.kv_moves import KVMover, measure_copy_s_per_byte
from cloud_tier.engine.model_files import eos_ids, load_tokenizer, tier_dir
from cloud_tier.engine.model_runner import ModelRunner
from cloud_tier.engine.models.loader import load_model, read_config
from cloud_tier.engine.models.quantize import quantize_model
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine.request import Request, RequestStatus, ServiceLevel
from cloud_tier.engine.sampler import TokenLogprobs
from cloud_tier.engine.scheduler import Scheduler
from cloud_tier.engine.scheduling.output import SchedulerOutput
from cloud_tier.engine.spec.speculation import Speculation
from cloud_tier.engine.swap import SwapSpace
from cloud_tier.engine.tracked import TrackedRequest
from cloud_tier.engine.window_kv import window_group
from cloud_tier.engine_config import EngineConfig, resolve_dtype
from cloud_tier.sampling import SamplingParams
from model_distribution.artifacts.model_dirs import resolve_model_dir
from model_distribution.artifacts.tokenizer_identity import model_tokenizer_identity

log = logging.getLogger(__name__)


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
        if config.weight_dtype == "int8":  # before the runner packs what stays in float
            quantize_model(self.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = eos_ids(self.model_dir, self.tokenizer, hf_config)
        self.guides = Guides(self.tokenizer, self.model.config["vocab_size"], self.eos_token_ids)
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
        # KV computed with INT8 weights is not the float model's: a pair must agree on the weights too
        weights = config.dtype if config.weight_dtype == "auto" else config.weight_dtype
        name = self.model_dir.name if config.weight_dtype == "auto" else f"{self.model_dir.name}+w{weights}"
        self.model_identity = model_identity(name, config.dtype, self.kv_layout)
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
        self.speculation = Speculation(config.speculative, config.num_speculative_tokens, config.ngram_min,
                                       config.ngram_max, self.model.config["vocab_size"], self.max_model_len,
                                       supported=window is None)
        self.kv_mover = KVMover(self.runner, self.kv, swap, tier_dir(config))
        self._tracked: dict[str, TrackedRequest] = {}
        self._handoffs: dict[str, tuple[list[TokenLogprobs], bytes | None]] = {}
        self.stalled = False  # the last step ran nothing while requests wait (KV held for transfers)
        log.info("engine ready: %s (%s, weights %s, KV %s, %s), %d KV blocks of %d tokens (%.0f MiB)",
                 self.model_dir.name, config.dtype, weights, kv_dtype, config.device, num_blocks, config.block_size,
                 num_blocks * per_block / 2**20)

    @classmethod
    def from_model(cls, model: str, **kwargs) -> LLMEngine:
        """``model``: a catalogue name (``smollm2-135m``), a .gguf path or an HF directory;
        ``kwargs``: any EngineConfig field."""
        return cls(EngineConfig(model=model, **kwargs))

    # -- requests ------------------------------------------------------------------------

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     arrival_time: float | None = None, slo: ServiceLevel | None = None,
                     draft: Draft | None = None) -> Request:
        """Tokenize and validate a prompt into a request record (raises ValueError). Safe to call
        from another thread than the one stepping the engine. ``slo``: its class, targets and
        deadline (a ``time.monotonic()`` time); ``draft``: tokens a device generated after the
        prompt, verified in the first step (a ``DraftError`` naming the field if malformed). A guided
        request's grammar is compiled here (``GrammarRefused``, a ValueError, if it cannot be)."""
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
        if params.guided is not None:
            req.guide = self.guides.matcher(params.guided)
        if draft is not None:
            self.speculation.attach(req, draft)
        return req

    def add(self, req: Request) -> str:
        """Queue a request made by ``make_request`` (ValueError if refused; SLOMissError, a
        ValueError, if it would miss its TTFT target)."""
        self.scheduler.add_request(req)
        self.speculation.added(req)
        self.guides.count(req)
        self._tracked[req.request_id] = TrackedRequest.start(req, self.tokenizer)
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
        if req.sampling_params.guided is not None:  # its matcher at its first token
            req.guide = self.guides.matcher(req.sampling_params.guided, req.output_token_ids)
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
        self.guides.count(req)
        if sampler_state is not None:
            self.runner.sampler.set_state(req.request_id, sampler_state)
        tracked = self._tracked[req.request_id] = TrackedRequest.start(req, self.tokenizer)
        return self._process(tracked, req.output_token_ids[:1], logprobs, time.monotonic())

    def calibrate(self, prefill_tokens: int = 128, decodes: int = 8, context: int = 32, repeats: int = 3) -> None:
        """Teach the scheduler's step-cost model this machine's speed (``calibrate_step_cost``)."""
        calibrate_step_cost(self.runner, self.kv, self.scheduler, self.max_model_len, prefill_tokens, decodes,
                            context, repeats)

    def _check_one_kv_group(self) -> None:
        if self.kv.window is not None:
            raise ValueError("KV handoff needs one block table for all layers: this engine has kv_window_blocks")

    def tokenizer_identity(self) -> str:
        """This model's tokenizer identity, from its source GGUF (or HF directory): a device's draft
        is meaningful here only if its model's is the same (``model_tokenizer_identity``)."""
        return model_tokenizer_identity(self.config.model)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One batch: returns an output for every request that got tokens or finished. A request
        that cannot go on ends with finish_reason "error" (its output says why); the others and
        the engine go on."""
        self.speculation.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        outputs = self._ended_early(scheduled)
        self.stalled = scheduled.is_empty and self.scheduler.has_unfinished()
        if scheduled.is_empty:
            self.kv_mover.before_step(scheduled)  # swap-outs of a step that runs nothing else
            return outputs
        try:
            result, elapsed = self._execute(scheduled)
        except Exception as e:  # which request broke the batch is unknown: it all fails, unwritten KV unused
            log.exception("a step of %d requests failed", len(scheduled.scheduled))
            return outputs + self._fail_all(scheduled, f"the engine step failed: {e!r}")
        self.scheduler.observe_step(scheduled, elapsed)
        self.speculation.observe(scheduled, result.accepted, result.failed)
        self.scheduler.update(scheduled, result.sampled, result.accepted)
        return outputs + self._step_outputs(scheduled, result)

    def _execute(self, scheduled: SchedulerOutput):
        """Move the step's KV (swaps, the tier), run the forward; its result and its seconds."""
        self.kv_mover.before_step(scheduled)
        started = time.perf_counter()
        result = self.runner.execute(scheduled)
        elapsed = time.perf_counter() - started
        self._observe_prefill(scheduled, elapsed)
        return result, elapsed

    def _fail_all(self, scheduled: SchedulerOutput, why: str) -> list[RequestOutput]:
        failed = (self._fail(s.request, why) for s in scheduled.scheduled)
        return [out for out in failed if out is not None]

    def _step_outputs(self, scheduled: SchedulerOutput, result) -> list[RequestOutput]:
        """The outputs of the requests that ran: a token each, or an error for one whose sampling
        (``result.failed``) or output side failed, that request alone."""
        outputs = []
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
                    out = self._process(tracked, s.request.output_token_ids[len(tracked.output.token_ids):],
                                        result.logprobs.get(rid), now)
                except Exception as e:  # a bug on this request's output side fails it alone
                    log.exception("the output of %s failed", rid)
                    out = self._fail(s.request, f"its output failed: {e!r}")
            else:
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _ended_early(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Final outputs of the requests the scheduler ended before this step (``TrackedRequest.end_early``)."""
        outputs = []
        for req in (*scheduled.expired, *scheduled.rejected):
            tracked = self._tracked.get(req.request_id)
            self._handoffs.pop(req.request_id, None)
            self._forget(req.request_id)
            if tracked is not None:
                outputs.append(tracked.end_early())
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
        return None if tracked is None else tracked.fail(why)

    def _process(self, t: TrackedRequest, tokens: list[int], logprobs, now: float) -> RequestOutput:
        """This step's new tokens of ``t`` (more than one where proposed tokens were accepted;
        ``logprobs``: the last one's, the only one then) into its output."""
        req = t.request
        t.take_tokens(tokens, logprobs, now)
        if t.detok.stopped:  # a stop string, even on the token that also hit max_tokens
            if req.is_finished:
                self.scheduler.release(req.request_id)  # no transfer: it ends here
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        if req.status == RequestStatus.FINISHED_TRANSFERRED:
            self._handoffs[req.request_id] = (list(t.output.new_logprobs),
                                              self.runner.sampler.get_state(req.request_id))
        if req.is_finished:
            t.finish()
            self.speculation.finished(req)
            self._forget(req.request_id)
        t.output.text = t.detok.text
        return t.output

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
                **{"spec_" + k: v for k, v in dataclasses.asdict(self.speculation.counts).items()},
                **{"guided_" + k: v for k, v in dataclasses.asdict(self.guides.counts).items()},
                "grammar_compiles": self.guides.compiles,
                **({"kv_tier_" + k: v for k, v in dataclasses.asdict(self.kv.tier.stats).items()}
                   if self.kv.tier is not None else {})}

