"""The hostile-worker harness for our own workers (their NDJSON protocol): a fake worker in front
of the real one (tests/integration/fake_worker.py: the tokenizer and load pass through) that lies
about usage in its finish, sends nothing, giant or malformed lines, U+2028 inside a token, an
in-band error, no finish, and stalls at every stage. The same rules as for OpenAI-compatible
workers (tests/integration/worker_checks.py): well-formed answers, never a 500, every stream ends
with [DONE], the charge, bucket and counters bounded, the next honest request served (a scripted honest
answer between cases, the real worker's at the end)."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import Server, create_key
from tests.integration.fake_worker import FaultyWorker, Mode, finish_line, token_line
from tests.integration.worker_checks import run_harness

STALL = 1.5  # the gateway below gives up on a worker after 1 s without a byte
ASK = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name two colours."}], "max_tokens": 8}
HONEST = [token_line("Red"), token_line(","), token_line(" blue"), finish_line(9, 3)]
LIES = {"negative": (-5, -3), "huge": (10**12, 10**12), "overflow": (10**400, 1), "float": (9.5, 3.0),
        "string": ("9", "3")}
SCRIPTS = {
    "empty": dict(script=[]),
    "giant_line": dict(script=[token_line("x" * (100 << 10))]),
    "malformed": dict(script=[HONEST[0], "{not json\n"]),
    "nan_logprob": dict(script=['{"token": [1, "a", "61", NaN, 0.1, []]}\n']),
    "in_band_error": dict(script=['{"error": {"message": "boom"}}\n']),
    "no_finish": dict(script=HONEST[:2]),
    "u2028": dict(script=[token_line("a\u2028b"), finish_line(9, 1)]),
    "stall_before_headers": dict(first_delay_s=STALL, script=HONEST),
    "stall_after_headers": dict(script=[STALL, *HONEST]),
    "stall_mid_stream": dict(script=[HONEST[0], STALL, *HONEST[1:]]),
    "stall_before_finish": dict(script=[*HONEST[:-1], STALL, HONEST[-1]]),
}
CASES = [*LIES, *SCRIPTS]
FAILS = set(SCRIPTS) - {"u2028"}
MID_STREAM = {"malformed", "no_finish", "stall_mid_stream", "stall_before_finish"}


def script(case: str) -> Mode:
    if case in LIES:
        return Mode(script=[*HONEST[:-1], finish_line(*LIES[case])])
    return Mode(**SCRIPTS[case])


@pytest.fixture(scope="module")
def fake(cloud_worker):
    w = FaultyWorker(cloud_worker.url).start()
    yield w
    w.stop()


@pytest.fixture(autouse=True)
def honest_again(fake):
    fake.mode = Mode()
    yield
    fake.mode = Mode()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, fake):
    home = tmp_path_factory.mktemp("hostile-own")
    g = Server(home, ["cloud", "serve"], "--workers", fake.url, "--worker-type", "cascade",
               env={"CASCADE_CLOUD_GATEWAY_REQUEST_TIMEOUT_S": "1.0",
                    "CASCADE_CLOUD_GATEWAY_WORKER_MAX_EVENT_BYTES": "65536"}).wait_healthy(120)
    g.admin = create_key(home, "--tenant", "owner", "--admin")
    yield g
    g.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_whatever_our_worker_does_the_answer_is_well_formed_and_the_charge_bounded(gateway, fake, stream):
    # the prompt's token ids are known exactly (~20 with the template): the bound is them
    run_harness(gateway, fake, lambda: Mode(script=HONEST), {**ASK, "stream": stream}, CASES, script, FAILS,
                MID_STREAM if stream else set(), STALL, prompt_bound=64)
    fake.mode = Mode()  # the real worker behind it, through the official client
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.admin, max_retries=0, timeout=30)
    assert c.chat.completions.create(**{**ASK, "max_tokens": 4}).usage.completion_tokens >= 1


def test_a_u2028_inside_a_token_stays_in_the_text(gateway, fake):
    fake.mode = script("u2028")
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.admin, max_retries=0, timeout=10)
    assert c.chat.completions.create(**ASK).choices[0].message.content == "a\u2028b"
