"""One tenant's service-level targets never throttle another's (issue 37 item 3), through `cascade
cloud serve --both 1` on SmolLM2: a request asking a target under its tenant's floor is a 400
naming it, and a tenant doing its worst within what its key allows (the tightest TPOT its floor
lets it ask, long prompts, several streams) leaves another tenant's streams starting as they do
alone."""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time

from cascade_cli.spawn import cascade_command
from tests import loopback
from tests.conftest import REPO, create_key

MODEL = "smollm2-135m"


def set_limits(home, tenant: str, *flags: str) -> None:
    subprocess.run(cascade_command("cloud", "keys", "limits", tenant, *flags, log_level=None),
                   env={**os.environ, "CASCADE_HOME": str(home)}, cwd=REPO, check=True, capture_output=True)


def post(url: str, key: str, **body):
    return loopback.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                               **body}, timeout=60)


def streams(url: str, key: str, bodies: list[dict], results: list, started: threading.Event | None = None):
    """Each body streamed at once in a thread of its own; ``results`` gets (status, seconds to the
    first token) per body; ``started`` is set at the first token of any."""
    def one(body: dict) -> None:
        sent = time.monotonic()
        with loopback.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": MODEL, "stream": True, "temperature": 0, "ignore_eos": True, **body},
                             timeout=120) as r:
            first = None
            for line in r.iter_lines():
                if first is None and '"content":"' in line:
                    first = time.monotonic() - sent
                    if started is not None:
                        started.set()
            results.append((r.status_code, first))

    threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    return threads


def test_a_target_under_the_tenants_floor_is_a_400_naming_it(engine_home, cloud_both):
    key = create_key(engine_home, "--tenant", "slo-floor")
    r = post(cloud_both.url, key, tpot_slo_s=0.001)  # the gateway's default floor: 0.02 s
    assert r.status_code == 400 and r.json()["error"]["param"] == "tpot_slo_s"
    assert r.json()["error"]["code"] == "slo_below_floor"
    r = post(cloud_both.url, key, ttft_slo_s=0.01)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttft_slo_s"
    own = create_key(engine_home, "--tenant", "slo-floor-own")
    set_limits(engine_home, "slo-floor-own", "--min-tpot-slo-s", "0.5")  # its own floor, over the default
    assert post(cloud_both.url, own, tpot_slo_s=0.3).status_code == 400
    assert post(cloud_both.url, own, tpot_slo_s=0.5).status_code == 200


def test_a_tenants_tightest_tpot_and_long_prompts_leave_anothers_first_tokens_as_alone(engine_home, cloud_both):
    a = create_key(engine_home, "--tenant", "noisy-a")
    b = create_key(engine_home, "--tenant", "quiet-b")
    set_limits(engine_home, "noisy-a", "--min-tpot-slo-s", "0.001")  # A may ask what the attack asked
    def b_bodies(word: str) -> list[dict]:  # a new word each round: no answer comes from the result cache
        return [{"messages": [{"role": "user", "content": f"Count to {i + 3} {word}."}], "max_tokens": 8,
                 "ttft_slo_s": 3} for i in range(4)]

    alone: list = []
    for t in streams(cloud_both.url, b, b_bodies("slowly"), alone):
        t.join(120)
    assert [s for s, _ in alone] == [200] * 4
    a_bodies = [{"messages": [{"role": "user", "content": f"Story {i}: " + "once upon a time " * 60}],
                 "max_tokens": 60, "tpot_slo_s": 0.001} for i in range(3)]
    noisy: list = []
    a_started = threading.Event()
    a_threads = streams(cloud_both.url, a, a_bodies, noisy, a_started)
    assert a_started.wait(60)
    beside: list = []
    for t in streams(cloud_both.url, b, b_bodies("quickly"), beside):
        t.join(120)
    for t in a_threads:
        t.join(120)
    alone_p50 = statistics.median(f for _, f in alone)
    beside_p50 = statistics.median(f for _, f in beside if f is not None)
    figures = (f"B alone {sorted(round(f, 2) for _, f in alone)}, beside A {sorted(beside)}, "
               f"A {sorted(noisy)}")
    print(figures)
    assert [s for s, _ in beside] == [200] * 4 and [s for s, _ in noisy] == [200] * 3, figures
    # B's streams start beside A's as they do alone: within 1.5x (and a step's noise on a busy 2-core machine)
    assert beside_p50 <= 1.5 * alone_p50 + 0.2, figures
