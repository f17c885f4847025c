"""The ShareGPT loader (incremental parse of a truncated JSON array, vLLM-style sampling) and
the serving benchmark's metrics and SSE handling, without a server."""

from __future__ import annotations

import asyncio
import io
import json
import math

import httpx
import pytest

from cascade.eval.sharegpt import (
    SHAREGPT_RECORDS,
    Conversation,
    Turn,
    iter_json_array,
    load_conversations,
    parse_conversations,
    sample_requests,
)
from testkit.loadgen import (
    LatencyStats,
    RequestOutcome,
    arrival_times,
    compute_metrics,
    send_one,
)


def record(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


TRICKY = record(1, ("human", 'a "quoted" {brace} and ] bracket, \\ backslash'),
                ("gpt", "nested: {\"x\": [1, {\"y\": \"}\"}]} and unicode \u00e9\u4e2d"))


def truncated_array(records: list[dict], cut_tail: str) -> str:
    """A pretty-printed array of ``records`` followed by a record cut off after ``cut_tail``."""
    body = json.dumps(records, indent=2, ensure_ascii=False)
    return body[:-2] + ",\n  " + cut_tail  # drop "\n]", append the partial record


@pytest.mark.parametrize("chunk_chars", [7, 64, 1 << 20])
def test_truncated_array_keeps_complete_records_and_drops_the_cut_one(chunk_chars):
    records = [record(0, ("human", "hi"), ("gpt", "hello")), TRICKY,
               record(2, ("human", "x" * 300), ("gpt", "y"))]
    text = truncated_array(records, '{"id": "r3", "conversations": [{"from": "human", "value": "cut {')
    assert list(iter_json_array(io.StringIO(text), chunk_chars)) == records


@pytest.mark.parametrize("chunk_chars", [3, 1 << 20])
def test_complete_array_and_cut_numbers(chunk_chars):
    assert list(iter_json_array(io.StringIO(' [ {"a": 1} , [2], "s" ] '), chunk_chars)) == [
        {"a": 1}, [2], "s"]
    # "12345" cut by a chunk boundary still parses as a number: it must be read whole.
    assert list(iter_json_array(io.StringIO("[12345, 678"), chunk_chars)) == [12345]
    assert list(iter_json_array(io.StringIO("[]"), chunk_chars)) == []


def test_cut_right_after_a_record_or_a_comma():
    assert list(iter_json_array(io.StringIO('[{"a": 1}'))) == [{"a": 1}]
    assert list(iter_json_array(io.StringIO('[{"a": 1},\n'))) == [{"a": 1}]


def test_malformed_json_raises():
    with pytest.raises(ValueError):
        list(iter_json_array(io.StringIO('{"not": "an array"}')))
    with pytest.raises(ValueError):
        list(iter_json_array(io.StringIO('[{"a": 1} {"b": 2}]')))


def test_parse_conversations_reads_turns_and_honours_limit():
    text = truncated_array([TRICKY, record(2, ("human", "q"))], '{"id": "r3"')
    convs = parse_conversations(io.StringIO(text))
    assert [c.id for c in convs] == ["r1", "r2"]
    assert convs[0].turns[0] == Turn("human", 'a "quoted" {brace} and ] bracket, \\ backslash')
    assert [c.id for c in parse_conversations(io.StringIO(text), limit=1)] == ["r1"]


class WordTokenizer:
    def encode(self, text: str) -> list[str]:
        return text.split()


def conv(i: int, *turns: tuple[str, str]) -> Conversation:
    return Conversation(f"c{i}", tuple(Turn(r, v) for r, v in turns))


def test_sampling_pairs_first_human_turn_with_its_reply_and_applies_the_limits():
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    convs = [
        conv(0, ("human", words(5)), ("gpt", words(10)), ("human", words(50)), ("gpt", words(9))),
        conv(1, ("gpt", words(8)), ("human", words(6)), ("gpt", words(7))),  # starts with gpt
        conv(2, ("human", words(3)), ("gpt", words(10))),  # prompt too short
        conv(3, ("human", words(5)), ("gpt", words(3))),  # output too short
        conv(4, ("human", words(30)), ("gpt", words(10))),  # prompt too long (> 20)
        conv(5, ("human", words(20)), ("gpt", words(2040))),  # over 2048 together
        conv(6, ("human", words(5))),  # one turn
    ]
    got = sample_requests(10, seed=0, tokenizer=WordTokenizer(), max_prompt_tokens=20,
                          conversations=convs)
    assert sorted((r.prompt_len, r.output_len) for r in got) == [(5, 10), (6, 7)]
    capped = sample_requests(10, seed=0, tokenizer=WordTokenizer(), max_prompt_tokens=20,
                             max_output_tokens=8, conversations=convs)
    assert sorted((r.prompt_len, r.output_len) for r in capped) == [(5, 8), (6, 7), (20, 8)]


def test_sampling_is_a_seeded_shuffle():
    convs = [conv(i, ("human", f"p{i} a b c"), ("gpt", "r a b c")) for i in range(50)]
    first = sample_requests(10, 7, WordTokenizer(), conversations=convs)
    assert first == sample_requests(10, 7, WordTokenizer(), conversations=convs)
    assert first != sample_requests(10, 8, WordTokenizer(), conversations=convs)
    assert len(first) == 10


def test_packaged_sharegpt_file_has_17671_complete_records():
    convs = load_conversations()  # about 1.5 s
    assert len(convs) == SHAREGPT_RECORDS == 17_671
    assert (convs[0].id, convs[-1].id) == ("QWJhYvA_0", "hlWUIwT_0")
    assert sum(len(c.turns) >= 2 for c in convs) == 17_400


def outcome(ttft: float, itl: list[float], e2e: float, tokens: int, prompt: int = 10,
            success: bool = True) -> RequestOutcome:
    return RequestOutcome(prompt_len=prompt, output_len=tokens, success=success, ttft_s=ttft,
                          itl_s=itl, e2e_s=e2e, output_tokens=tokens)


def test_metrics_from_hand_made_records():
    outcomes = [
        outcome(0.1, [0.02, 0.02, 0.02], 0.16, 4),  # tpot (0.16 - 0.1) / 3 = 0.02
        outcome(0.3, [0.05], 0.4, 2),  # tpot 0.1
        outcome(0.2, [], 0.2, 1),  # one token: no tpot
        outcome(9.9, [9.9], 99.0, 50, prompt=1000, success=False),  # failures do not count
    ]
    m = compute_metrics(outcomes, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(18.5)
    assert m.ttft.mean == pytest.approx(200.0)
    assert m.ttft.p50 == pytest.approx(200.0)
    assert m.ttft.p90 == pytest.approx(280.0)  # linear interpolation between 200 and 300
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(60.0)
    assert m.tpot.p99 == pytest.approx(20.0 + 0.99 * 80.0)
    assert m.itl.count == 4 and m.itl.mean == pytest.approx(27.5)
    assert m.itl.p50 == pytest.approx(20.0)
    assert m.e2e.p99 == pytest.approx(200 + 0.98 * 200)  # [160, 200, 400], rank 1.98


def test_metrics_of_nothing_are_nan():
    assert math.isnan(LatencyStats.of([]).mean)
    m = compute_metrics([outcome(0.1, [], 0.1, 1, success=False)], duration_s=1.0)
    assert m.completed == 0 and m.request_throughput == 0 and math.isnan(m.e2e.p50)


def test_arrivals_are_seeded_poisson_or_all_at_once():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, 0)
    assert times == arrival_times(2000, 10.0, 0) and times[0] == 0.0
    assert times == sorted(times)
    assert 1999 / times[-1] == pytest.approx(10.0, rel=0.1)


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def stream_into(body: bytes, status: int = 200) -> RequestOutcome:
    async def go() -> RequestOutcome:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        result = RequestOutcome(prompt_len=3, output_len=8)
        async with httpx.AsyncClient(transport=transport) as client:
            await send_one(client, "http://test/v1/chat/completions", {}, result)
        return result

    return asyncio.run(go())


def test_stream_counts_content_chunks_and_prefers_usage():
    role = {"choices": [{"delta": {"role": "assistant"}}]}
    tok = {"choices": [{"delta": {"content": "x"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}
    got = stream_into(sse(role, tok, tok, tok, usage, "[DONE]"))
    assert got.success and got.output_tokens == 5 and got.server_prompt_tokens == 9
    assert len(got.itl_s) == 2 and got.ttft_s is not None
    completion = {"choices": [{"text": "y"}]}
    assert stream_into(sse(completion, completion, "[DONE]")).output_tokens == 2


def test_http_errors_and_sse_error_events_are_failures_with_the_message():
    failed = stream_into(json.dumps({"error": {"message": "too long"}}).encode(), status=400)
    assert not failed.success and failed.error == "HTTP 400: too long"
    tok = {"choices": [{"delta": {"content": "x"}}]}
    broken = stream_into(sse(tok, {"error": {"message": "generation failed: boom"}}, "[DONE]"))
    assert not broken.success and "generation failed: boom" in broken.error
