"""A real vLLM (its CPU build) behind the gateway, and a mixed pool of vLLM and our worker. The
last test kills the session's vLLM: keep it last, and no later module may use ``vllm_worker``."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from tests.conftest import Server, create_key, gateway_count
from tests.integration.faulty_openai import FaultyOpenAIWorker

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory, vllm_worker):
    home = tmp_path_factory.mktemp("gw-vllm")
    g = Server(home, ["cloud", "serve"], "--workers", vllm_worker.url,  # its kind is detected
               env={"CASCADE_CLOUD_GATEWAY_WORKER_MAX_WAITING": "2"}).wait_healthy(120)
    g.home = home
    yield g
    g.stop()


def client_of(g, tenant: str, *args: str, timeout: float = 120) -> openai.OpenAI:
    key = create_key(g.home, "--tenant", tenant, *args)
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key=key, max_retries=0, timeout=timeout)


def test_vllm_is_detected_and_the_openai_client_streams_and_not_through_it_with_keys(gw, vllm_worker):
    assert httpx.get(f"{gw.url}/healthz", timeout=10).json()["workers"][vllm_worker.url]["type"] == "vllm"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="csk-nope", max_retries=0).chat.completions.create(
            model="smollm2-135m", messages=CHAT, max_tokens=2)
    c = client_of(gw, "vllm-basic")
    assert [m.id for m in c.models.list().data] == ["smollm2-135m"]
    whole = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=10, temperature=0)
    direct = openai.OpenAI(base_url=f"{vllm_worker.url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == direct.choices[0].message.content  # passed through unchanged
    chunks = list(c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert all(ch.usage is None for ch in chunks)


def test_quotas_are_charged_from_vllms_usage(gw):
    c = client_of(gw, "vllm-usage", "--tpm", "100000")
    r = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=7, temperature=0.8, stream=True,
                                  stream_options={"include_usage": True})
    usage = list(r)[-1].usage
    deadline = time.monotonic() + 10
    while gateway_count(gw, "vllm-usage", "cascade_gateway_completion_tokens_total") == 0 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert gateway_count(gw, "vllm-usage", "cascade_gateway_prompt_tokens_total") == usage.prompt_tokens
    assert gateway_count(gw, "vllm-usage", "cascade_gateway_completion_tokens_total") == usage.completion_tokens


def test_a_small_vllm_kv_budget_makes_the_gateway_shed_with_429_while_admitted_requests_finish(gw, vllm_worker):
    c = client_of(gw, "vllm-shed", timeout=300)
    long = [{"role": "user", "content": "Tell me a story about the sea. " * 60}]  # ~600 tokens of 1,920

    def one(_):
        try:
            r = c.chat.completions.with_raw_response.create(model="smollm2-135m", messages=long, max_tokens=64,
                                                            extra_body={"ignore_eos": True})
            return 200, r.parse().choices[0].finish_reason, None
        except openai.RateLimitError as e:
            return 429, None, e.response.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    shed = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert shed and served, results
    assert all(r[2] and int(r[2]) >= 1 for r in shed)  # Retry-After on every 429
    assert all(r[1] == "length" for r in served)  # the admitted ones ran to their end
    vllm_worker.wait_idle()
    time.sleep(1.5)  # a fresh scrape: the pool is free again
    assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2).choices


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, vllm_worker, cloud_worker):
    """vLLM and our worker behind pass-through proxies (which record what each was sent)."""
    proxies = {"vllm": FaultyOpenAIWorker(vllm_worker.url).start(),
               "ours": FaultyOpenAIWorker(cloud_worker.url).start()}
    home = tmp_path_factory.mktemp("gw-mixed")
    g = Server(home, ["cloud", "serve"], "--workers", ",".join(p.url for p in proxies.values())).wait_healthy(120)
    g.home = home
    yield g, proxies
    g.stop()
    for p in proxies.values():
        p.stop()


def test_a_mixed_pool_sends_a_shared_prefix_to_the_worker_that_holds_it_unless_it_is_overloaded(mixed, vllm_worker,
                                                                                               cloud_worker):
    g, proxies = mixed
    kinds = {w["type"] for w in httpx.get(f"{g.url}/healthz", timeout=10).json()["workers"].values()}
    assert kinds == {"vllm", "cascade"}
    c = client_of(g, "mixed")
    system = {"role": "system", "content": "You are the help desk of a hardware store. " * 30}
    for q in ("Do you sell nails?", "When do you open?", "Is there parking?", "Can I return a drill?"):
        c.chat.completions.create(model="smollm2-135m", messages=[system, {"role": "user", "content": q}],
                                  max_tokens=2, temperature=0)
    got = {name: len(p.bodies) for name, p in proxies.items()}
    holder = max(got, key=got.get)
    assert got[holder] == 4, got  # affinity: every one went where the prefix is
    other = "ours" if holder == "vllm" else "vllm"
    # now load the holder directly (not through the gateway) until its own numbers show it overloaded
    target = vllm_worker.url if holder == "vllm" else cloud_worker.url
    busy = openai.OpenAI(base_url=f"{target}/v1", api_key="x", max_retries=0, timeout=300)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        load = [pool.submit(busy.chat.completions.create, model="smollm2-135m", messages=CHAT, max_tokens=200,
                            extra_body={"ignore_eos": True}) for _ in range(6)]
        time.sleep(2.5)  # two scrapes
        before = len(proxies[other].bodies)
        c.chat.completions.create(model="smollm2-135m", messages=[system, {"role": "user", "content": "Hi?"}],
                                  max_tokens=2, temperature=0)
        assert len(proxies[other].bodies) == before + 1  # the holder is overloaded: affinity gave way
        for f in load:
            f.result()


# the gateway-only install: neither torch nor transformers can be imported
NO_TORCH = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "sys.modules['cloud_tier.engine'] = None; from cascade_cli.main import main; sys.exit(main())")


def test_the_gateway_in_front_of_vllm_needs_neither_torch_nor_transformers(tmp_path, vllm_worker):
    import sys

    from cascade.processes import free_port, spawn, stop, wait_healthy

    port, log = free_port(), tmp_path / "gateway.log"
    proc = spawn([sys.executable, "-c", NO_TORCH, "--log-level", "WARNING", "cloud", "serve", "--workers",
                  vllm_worker.url, "--port", str(port)], env={"CASCADE_HOME": str(tmp_path)}, log=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 120, "gateway without torch", log=log)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=create_key(tmp_path, "--tenant", "no-torch"), max_retries=0,
                          timeout=120)
        assert list(c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=3, stream=True))
    finally:
        stop(proc)
    assert "Traceback" not in log.read_text()


def test_a_killed_vllm_worker_stops_receiving_traffic_and_the_client_gets_a_clean_error(tmp_path, vllm_worker,
                                                                                        cloud_worker):
    """LAST: it kills the session's vLLM."""
    g = Server(tmp_path, ["cloud", "serve"], "--workers", f"{vllm_worker.url},{cloud_worker.url}").wait_healthy(120)
    g.home = tmp_path
    try:
        c = client_of(g, "vllm-killed", timeout=60)
        stream = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        # whichever worker it went to, kill vLLM mid-way: a stream on it ends with an error event, not a hang
        t0 = time.monotonic()
        next(iter(stream))
        vllm_worker.kill()
        try:
            for _ in stream:
                pass
        except openai.APIError:
            pass  # the in-band error event after the first byte
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while httpx.get(f"{g.url}/healthz", timeout=10).json()["workers"][vllm_worker.url]["healthy"]:
            assert time.monotonic() < deadline, "the dead vLLM is still counted healthy"
            time.sleep(0.2)
        for _ in range(3):  # all of it goes to the worker that is left
            assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=2).choices
    finally:
        g.stop()
