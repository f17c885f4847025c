"""A prefill/decode handoff between two engines in one process, as a P/D pair's workers do it over
a transport: the prefill engine samples the first token, its KV is exported and adopted by the
decode engine (with the sampler's state), released on the prefill side, and decoded to the end."""

from __future__ import annotations


def hand_over(prefill, decode, req, *, check_integrity: bool = False) -> tuple:
    """Run ``req`` (made by ``prefill.make_request``) through a handoff from ``prefill`` to
    ``decode``: (the prefill's last output, the decode side's final output). With
    ``check_integrity`` each engine's KV invariants are checked after every step."""
    req.kv_transfer = True
    prefill.add(req)
    first = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = out
        if check_integrity:
            prefill.check_integrity()
    handoff = prefill.export_kv(req.request_id)
    new = decode.make_request(req.prompt_token_ids, req.sampling_params, req.request_id)
    new.append_token(req.output_token_ids[0])
    final = decode.adopt(new, handoff.kv.clone(), None, handoff.sampler_state)
    prefill.release_kv(req.request_id)
    while decode.has_unfinished_requests():
        for out in decode.step():
            final = out
        if check_integrity:
            decode.check_integrity()
    return first, final
