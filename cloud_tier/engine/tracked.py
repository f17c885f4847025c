"""The engine's output side of one request: its detokenizer and the ``RequestOutput`` it
reports, assembled step by step (a token, an early end, an error). No scheduling here: the
engine decides when a request ends, this says what its output then reads."""

from __future__ import annotations

from dataclasses import dataclass

from cloud_tier.engine.detokenizer import IncrementalDetokenizer
from cloud_tier.engine.outputs import RequestOutput
from cloud_tier.engine.request import Request, RequestStatus


@dataclass
class TrackedRequest:
    request: Request
    detok: IncrementalDetokenizer
    output: RequestOutput

    @classmethod
    def start(cls, request: Request, tokenizer) -> TrackedRequest:
        params = request.sampling_params
        return cls(request, IncrementalDetokenizer(tokenizer, params.stop, params.include_stop_str_in_output),
                   RequestOutput(request.request_id, list(request.prompt_token_ids), arrival_time=request.arrival_time,
                                 logprobs=[] if params.logprobs is not None else None))

    def take_tokens(self, tokens: list[int], logprobs, now: float) -> None:
        """This step's tokens (and the last one's logprobs) into the output and the detokenizer,
        up to a stop string's: the rest is not output (the request ends with it)."""
        req, out = self.request, self.output
        out.new_token_ids, out.new_logprobs, out.delta_text = [], [], ""
        for token in tokens:
            out.new_token_ids.append(token)
            out.token_ids.append(token)
            # as vLLM: the stop token is in token_ids, its text only if asked for
            hidden = (req.status == RequestStatus.FINISHED_STOPPED and req.is_stop_token(token)
                      and not req.sampling_params.include_stop_str_in_output)
            out.delta_text += "" if hidden else self.detok.add(token)
            if self.detok.stopped:
                break
        if logprobs is not None and len(tokens) == 1:
            out.new_logprobs = [logprobs]
            if out.logprobs is not None:
                out.logprobs.append(logprobs)
        if out.first_token_time is None:
            out.first_token_time = now
        spec = req.spec
        # accepted counts the draft's tokens the answer keeps: not those past a stop string, stop token or EOS
        out.draft_offered, out.draft_accepted, out.draft_skipped = (spec.offered, min(spec.accepted,
                                                                    len(out.token_ids)), spec.skipped)

    def finish(self) -> None:
        """The request ended with this step's token: the held-back text and its finish reason."""
        out = self.output
        out.delta_text += self.detok.finish()
        out.finished = True
        out.finish_reason = self.request.status.finish_reason
        out.num_cached_tokens = max(self.request.num_cached_tokens, 0)

    def end_early(self) -> RequestOutput:
        """The final output of a request the scheduler ended before a step: past its deadline
        (finish "length" with what it has, ``truncated="deadline"``) or refused for a TTFT target
        that passed while it queued (``retry_after_s`` set)."""
        req, out = self.request, self.output
        out.new_token_ids, out.new_logprobs = [], []
        out.delta_text = self.detok.finish()
        out.text = self.detok.text
        out.finished, out.finish_reason = True, req.status.finish_reason
        out.num_cached_tokens = max(req.num_cached_tokens, 0)
        if req.truncated:
            out.truncated = req.truncated
        else:
            out.retry_after_s = 1.0
            out.error = "its time-to-first-token target passed, or would pass, while it waited"
        return out

    def fail(self, why: str) -> RequestOutput:
        """The final output of a request that ended with an error."""
        out = self.output
        out.new_token_ids, out.new_logprobs, out.delta_text = [], [], ""
        out.finished, out.finish_reason, out.error = True, self.request.status.finish_reason, why
        out.num_cached_tokens = max(self.request.num_cached_tokens, 0)
        return out
