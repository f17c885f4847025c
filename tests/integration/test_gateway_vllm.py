"""A real vLLM (its CPU build) behind the gateway, and a mixed pool of vLLM and our worker. The
last test kills the session's vLLM: keep it last, and no later module may use ``vllm_worker``."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from cascade.processes import free_port
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
    # streamed, so the load ends when the check is done: the client hangs up and the holder drops the
    # rest (waiting for 6 x 200 tokens to finish cost 34-131 s of this test and checked nothing more)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        load = [pool.submit(busy.chat.completions.create, model="smollm2-135m", messages=CHAT, max_tokens=200,
                            stream=True, extra_body={"ignore_eos": True}) for _ in range(6)]
        time.sleep(2.5)  # two scrapes
        before = len(proxies[other].bodies)
        c.chat.completions.create(model="smollm2-135m", messages=[system, {"role": "user", "content": "Hi?"}],
                                  max_tokens=2, temperature=0)
        assert len(proxies[other].bodies) == before + 1  # the holder is overloaded: affinity gave way
        streams = [f.result() for f in load]
    for s in streams:
        assert next(iter(s)).choices  # each load request was being served
        s.close()
    if holder == "vllm":
        vllm_worker.wait_idle()  # the later tests want it free; our worker is checked after every test


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


def _counter(server, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on a vLLM's /metrics whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def _pulled(server) -> float:
    """Prompt tokens whose KV ``server`` pulled from another vLLM instead of computing it."""
    return _counter(server, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def _served(server) -> float:
    return _counter(server, "vllm:request_success_total")


@pytest.fixture(scope="module", autouse=True)
def decode_vllm(request, vllm_worker, tmp_path_factory):
    """The decode half of a vLLM P/D pair; the session's vLLM (which runs the NixlConnector too) is
    the prefill half. Spawned as soon as the session's vLLM is up, when the P/D test is among those
    selected, so that its start (~1-2 min here) overlaps the tests before it; that test waits for it
    and stops it (and so does the teardown here, if it failed first)."""
    from model_distribution.artifacts.model_dirs import resolve_model_dir
    from tests.vllm_server import VllmServer

    wanted = test_a_vllm_prefill_decode_pair_through_the_gateway_moves_the_kv_over_nixl.__name__
    if not any(item.name == wanted for item in request.session.items):
        yield None
        return
    server = VllmServer(resolve_model_dir("smollm2-135m"), tmp_path_factory.mktemp("vllm-decode"), nixl=True)
    yield server
    server.stop()


def _greedy(c: openai.OpenAI, req: dict, stream: bool) -> list:
    """The answer's tokens, each with its logprob and the top two (openai's ChatCompletionTokenLogprob)."""
    if not stream:
        return c.chat.completions.create(**req).choices[0].logprobs.content
    return [t for ch in c.chat.completions.create(**req, stream=True) if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.content]


def _assert_same_greedy_answer(got: list, want: list) -> None:
    """Token for token (as text), with logprobs within bf16 noise, up to the first token whose top
    two the reference has within 0.3 nats (bf16 logits here move in steps of 0.125). After such a
    near-tie either may win: the decode server computes the last prompt token against the KV it
    pulled, another kernel path than the reference's one-pass prefill, and bf16 rounds them apart
    (seen: equal through 8-16 tokens, then a tie at margin 0 or 0.125 goes the other way)."""
    compared = 0
    for g, w in zip(got, want, strict=True):
        if w.top_logprobs[0].logprob - w.top_logprobs[1].logprob < 0.3:
            break
        assert g.token == w.token and abs(g.logprob - w.logprob) < 0.3, (compared, g, w)
        compared += 1
    assert compared >= 3, (got, want)


def test_a_vllm_prefill_decode_pair_through_the_gateway_moves_the_kv_over_nixl(tmp_path, vllm_worker, decode_vllm):
    decode = decode_vllm.wait_healthy()
    alone = openai.OpenAI(base_url=f"{vllm_worker.url}/v1", api_key="x", max_retries=0, timeout=120)

    def ask(topic: str) -> dict:  # greedy, a prompt over pd_min_prompt_chars (1024) that differs from its first block
        return {"model": "smollm2-135m", "messages": [{"role": "user", "content": f"Tell me about {topic}. " * 50}],
                "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}

    g = Server(tmp_path, ["cloud", "serve"], "--prefill", vllm_worker.url, "--decode", decode.url,
               "--kv-connector", "nixl").wait_healthy(120)
    g.home = tmp_path
    try:
        deadline = time.monotonic() + 30  # /healthz answers once one is up: wait for the prefill's first scrape too
        while not all(w["healthy"] for w in httpx.get(f"{g.url}/healthz", timeout=10).json()["workers"].values()):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        c = client_of(g, "vllm-pd")
        for stream, topic in ((False, "the sea"), (True, "the mountains")):
            req = ask(topic)
            ref = alone.chat.completions.create(**req)  # the reference: one vLLM computes all of it
            want = ref.choices[0].logprobs.content
            served, pulled = _served(vllm_worker), _pulled(decode)
            _assert_same_greedy_answer(_greedy(c, req, stream), want)
            assert _served(vllm_worker) == served + 1  # the prefill step ran on the session's vLLM ...
            # ... and the decode server took all of the prompt's KV from it over NIXL
            assert _pulled(decode) - pulled == ref.usage.prompt_tokens, stream
        served, pulled = _served(vllm_worker), _pulled(decode)
        assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=3).choices
        assert (_served(vllm_worker), _pulled(decode)) == (served, pulled)  # a short prompt: decode alone
    finally:
        g.stop()
    # a prefill worker that cannot be reached: the decode server answers alone, computing the whole
    # prompt itself, which gives exactly the reference's answer
    dead = Server(tmp_path, ["cloud", "serve"], "--prefill", f"http://127.0.0.1:{free_port()}", "--decode",
                  decode.url, "--kv-connector", "nixl", "--worker-type", "vllm").wait_healthy(120)
    dead.home = tmp_path
    try:
        req, pulled = ask("the desert"), _pulled(decode)
        got = client_of(dead, "vllm-pd-dead").chat.completions.create(**req).choices[0].message.content
        assert got == alone.chat.completions.create(**req).choices[0].message.content
        assert _pulled(decode) == pulled
    finally:
        dead.stop()
        decode.stop()


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
