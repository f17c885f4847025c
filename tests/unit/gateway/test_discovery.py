"""Worker discovery through the Kubernetes API: only ready pods, by role, from recorded pod lists
(``kubectl get pods -o json`` output, in data/) and from the official client calling a loopback
server that answers the list calls with those recordings."""

import asyncio
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from cascade.config import ConfigError
from cloud_tier.gateway.workers.discovery import (
    Discovered,
    KubernetesDiscovery,
    follow,
    pod_is_ready,
    pods_to_workers,
)

DATA = Path(__file__).parent / "data"
WORKERS = json.loads((DATA / "k8s-pods-workers.json").read_text())
VLLM_PREFILL = json.loads((DATA / "k8s-pods-vllm-prefill.json").read_text())
VLLM_DECODE = json.loads((DATA / "k8s-pods-vllm-decode.json").read_text())
WORKER_SELECTOR = "app.kubernetes.io/part-of=cascade,app.kubernetes.io/component=worker"

# the ready pods of k8s-pods-workers.json; left out: an evicted prefill pod, a decode pod whose
# readiness probe fails, a pending vLLM pod (no node, no IP) and a terminating one
READY_WORKERS = [
    Discovered("http://10.244.1.17:8000", "prefill", "cascade", "cascade/cascade-prefill-7d9f8b6c4-x2k9q"),
    Discovered("http://10.244.2.23:8000", "decode", "cascade", "cascade/cascade-decode-5b7c9d8f6-m4n7p"),
    Discovered("http://10.244.4.31:8000", "both", "vllm", "cascade/vllm-worker-6c8d7f9b5-h3j6k"),
    Discovered("http://10.244.6.12:8000", "both", "vllm", "cascade/vllm-tp-worker-84f6b7d9c-k2p5s"),
    Discovered("http://10.244.7.8:30000", "both", "sglang", "cascade/sglang-worker-5d4c8b7f6-w9t3m"),
]


def pod_named(pods: dict, name: str) -> dict:
    return copy.deepcopy(next(p for p in pods["items"] if p["metadata"]["name"] == name))


def test_only_running_ready_pods_with_an_ip_that_are_not_terminating_are_workers():
    assert pods_to_workers(WORKERS) == READY_WORKERS


def test_role_comes_from_the_label_else_both_and_the_kind_from_the_worker_type_label():
    by_url = {d.url: (d.role, d.worker_type) for d in pods_to_workers(WORKERS)}
    assert by_url["http://10.244.1.17:8000"] == ("prefill", "cascade")
    assert by_url["http://10.244.4.31:8000"] == ("both", "vllm")  # no cascade.dev/role label
    unlabelled = pod_named(WORKERS, "vllm-worker-6c8d7f9b5-h3j6k")
    del unlabelled["metadata"]["labels"]["cascade.dev/worker-type"]
    assert pods_to_workers([unlabelled]) == [
        Discovered("http://10.244.4.31:8000", "both", "", "cascade/vllm-worker-6c8d7f9b5-h3j6k")]


def test_a_role_given_by_the_selector_overrides_the_pods_label():
    # vllm-prefill-...-h8m4d carries cascade.dev/role=decode, but the prefill selector matched it
    assert [(d.url, d.role) for d in pods_to_workers(VLLM_PREFILL, role="prefill")] == [
        ("http://10.244.10.6:8000", "prefill"), ("http://10.244.8.14:8000", "prefill")]
    with pytest.raises(ValueError, match="role must be one of"):
        pods_to_workers(VLLM_PREFILL, role="verifier")


def test_the_port_named_http_is_used_else_the_default_port():
    urls = [d.url for d in pods_to_workers(WORKERS, port=9000)]
    assert "http://10.244.7.8:30000" in urls  # sglang: containerPort 30000 named http
    assert "http://10.244.6.12:9000" in urls  # the TP worker declares no ports
    assert "http://10.244.2.23:8000" in urls  # ports http 8000 and kv 8200
    assert all(u.startswith("https://") for u in (d.url for d in pods_to_workers(WORKERS, scheme="https")))


def test_each_readiness_rule_alone_keeps_a_pod_out():
    ready = pod_named(WORKERS, "cascade-decode-5b7c9d8f6-m4n7p")
    assert pod_is_ready(ready)
    no_ip = copy.deepcopy(ready)
    del no_ip["status"]["podIP"]
    terminating = copy.deepcopy(ready)
    terminating["metadata"]["deletionTimestamp"] = "2026-11-02T10:41:03Z"
    not_ready = copy.deepcopy(ready)
    next(c for c in not_ready["status"]["conditions"] if c["type"] == "Ready")["status"] = "False"
    no_conditions = copy.deepcopy(ready)
    del no_conditions["status"]["conditions"]
    succeeded = copy.deepcopy(ready)
    succeeded["status"]["phase"] = "Succeeded"
    for pod in (no_ip, terminating, not_ready, no_conditions, succeeded):
        assert not pod_is_ready(pod)
        assert pods_to_workers([pod]) == []


def test_an_ipv6_pod_ip_is_bracketed_in_the_url():
    pod = pod_named(WORKERS, "cascade-decode-5b7c9d8f6-m4n7p")
    pod["status"]["podIP"] = "fd00:10:244::17"
    assert pods_to_workers([pod])[0].url == "http://[fd00:10:244::17]:8000"


def test_a_pod_with_an_unknown_role_or_worker_type_label_is_left_out_with_a_warning(caplog):
    bad_role = pod_named(WORKERS, "cascade-decode-5b7c9d8f6-m4n7p")
    bad_role["metadata"]["labels"]["cascade.dev/role"] = "decoder"
    bad_type = pod_named(WORKERS, "vllm-worker-6c8d7f9b5-h3j6k")
    bad_type["metadata"]["labels"]["cascade.dev/worker-type"] = "tgi"
    assert pods_to_workers([bad_role, bad_type]) == []
    assert "cascade.dev/role='decoder'" in caplog.text and "cascade.dev/worker-type='tgi'" in caplog.text


def test_the_clients_model_objects_give_the_same_workers_as_the_json():
    # the recorded JSON read the way the official client reads an API answer: V1PodList objects
    pod_list = client.ApiClient().deserialize(json.dumps(WORKERS), "V1PodList", "application/json")
    assert isinstance(pod_list.items[0], client.V1Pod)
    assert pods_to_workers(pod_list) == READY_WORKERS
    assert pods_to_workers(pod_list.items) == READY_WORKERS


# --- KubernetesDiscovery through the official client, against recorded answers on loopback -------------

class RecordedPodLists:
    """Answers GET /api/v1/namespaces/<ns>/pods?labelSelector=S with the recording for S (a dict
    {selector: pod list}, replaceable while serving), 404 for any other path or selector, and
    ``status`` instead when set; records the selectors asked for."""

    def __init__(self, namespace: str, lists: dict[str, dict]):
        self.lists = lists
        self.status = 200
        self.asked: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlparse(self.path)
                selector = parse_qs(url.query).get("labelSelector", [""])[0]
                outer.asked.append(selector)
                body = outer.lists.get(selector)
                code = outer.status
                if url.path != f"/api/v1/namespaces/{namespace}/pods" or body is None:
                    code, body = 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
                elif code != 200:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    def api(self) -> client.CoreV1Api:
        cfg = client.Configuration(host=f"http://127.0.0.1:{self.server.server_address[1]}")
        return client.CoreV1Api(client.ApiClient(cfg))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_discovery_lists_the_namespaces_pods_by_selector_through_the_api():
    with RecordedPodLists("cascade", {WORKER_SELECTOR: WORKERS}) as k8s:
        discovery = KubernetesDiscovery("cascade", WORKER_SELECTOR, api=k8s.api())
        assert discovery.discover() == READY_WORKERS
        assert discovery.workers() == {d.url: d.role for d in READY_WORKERS}
        assert k8s.asked == [WORKER_SELECTOR, WORKER_SELECTOR]


def test_role_selectors_give_their_role_and_win_over_the_general_selector():
    prefill, decode = "app.kubernetes.io/name=vllm-prefill", "app.kubernetes.io/name=vllm-decode"
    both_lists = copy.deepcopy(WORKERS)
    both_lists["items"] += copy.deepcopy(VLLM_DECODE["items"])  # the decode pod matches the general selector too
    with RecordedPodLists("cascade", {prefill: VLLM_PREFILL, decode: VLLM_DECODE, WORKER_SELECTOR: both_lists}) as k8s:
        discovery = KubernetesDiscovery("cascade", WORKER_SELECTOR, prefill_selector=prefill, decode_selector=decode,
                                        api=k8s.api())
        workers = discovery.workers()
    assert workers == {
        **{d.url: d.role for d in READY_WORKERS},
        "http://10.244.8.14:8000": "prefill",
        "http://10.244.10.6:8000": "prefill",  # labelled decode; the prefill selector matched it
        "http://10.244.11.22:8000": "decode",  # no role label; also matched by the general selector
    }  # vllm-prefill-...-t3v8x is not ready


def test_a_pod_matched_by_both_role_selectors_is_left_out(caplog):
    prefill, decode = "app.kubernetes.io/name=vllm-prefill", "cascade.dev/role=decode"
    decode_list = copy.deepcopy(VLLM_DECODE)
    decode_list["items"].append(pod_named(VLLM_PREFILL, "vllm-prefill-7b5d9c8f4-h8m4d"))  # it is labelled decode
    with RecordedPodLists("cascade", {prefill: VLLM_PREFILL, decode: decode_list}) as k8s:
        workers = KubernetesDiscovery("cascade", prefill_selector=prefill, decode_selector=decode,
                                      api=k8s.api()).workers()
    assert workers == {"http://10.244.8.14:8000": "prefill", "http://10.244.11.22:8000": "decode"}
    assert "vllm-prefill-7b5d9c8f4-h8m4d left out: both the prefill and the decode selector" in caplog.text


def test_discovery_needs_a_selector_and_a_valid_port():
    with pytest.raises(ValueError, match="needs a selector"):
        KubernetesDiscovery("cascade", api=object())
    with pytest.raises(ValueError, match="port"):
        KubernetesDiscovery("cascade", WORKER_SELECTOR, port=0, api=object())


def test_an_api_error_is_raised_by_discover():
    with RecordedPodLists("cascade", {WORKER_SELECTOR: WORKERS}) as k8s:
        k8s.status = 403  # e.g. the service account lacks list on pods
        with pytest.raises(client.ApiException) as e:
            KubernetesDiscovery("cascade", WORKER_SELECTOR, api=k8s.api()).discover()
    assert e.value.status == 403


def test_follow_reports_the_workers_then_each_change_and_keeps_them_while_the_api_fails():
    changes: list[list[Discovered]] = []
    one_fewer = copy.deepcopy(WORKERS)
    one_fewer["items"] = [p for p in one_fewer["items"] if p["metadata"]["name"] != "vllm-worker-6c8d7f9b5-h3j6k"]

    async def scenario(k8s: RecordedPodLists):
        async def on_change(workers):  # a coroutine function, as the worker pool's will be
            changes.append(workers)

        task = asyncio.create_task(follow(KubernetesDiscovery("cascade", WORKER_SELECTOR, api=k8s.api()), on_change,
                                          every_s=0.01))

        async def until(predicate):
            for _ in range(500):
                if predicate():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("timed out")

        await until(lambda: len(changes) == 1)
        asked = len(k8s.asked)
        await until(lambda: len(k8s.asked) >= asked + 3)
        assert len(changes) == 1  # the same pods: no call
        k8s.status = 500
        await until(lambda: len(k8s.asked) >= asked + 6)
        k8s.lists[WORKER_SELECTOR] = one_fewer
        k8s.status = 200
        await until(lambda: len(changes) == 2)
        k8s.lists[WORKER_SELECTOR] = {"apiVersion": "v1", "items": [], "kind": "List", "metadata": {}}
        await until(lambda: len(changes) == 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with RecordedPodLists("cascade", {WORKER_SELECTOR: WORKERS}) as k8s:
        asyncio.run(scenario(k8s))
    assert changes[0] == READY_WORKERS
    assert changes[1] == [d for d in READY_WORKERS if d.url != "http://10.244.4.31:8000"]
    assert changes[2] == []  # every worker pod gone: the pool is told so


def test_follow_takes_a_plain_function_too():
    seen = []

    async def scenario(k8s):
        task = asyncio.create_task(follow(KubernetesDiscovery("cascade", WORKER_SELECTOR, api=k8s.api()),
                                          seen.append, every_s=0.01))
        for _ in range(500):
            if seen:
                break
            await asyncio.sleep(0.01)
        task.cancel()

    with RecordedPodLists("cascade", {WORKER_SELECTOR: WORKERS}) as k8s:
        asyncio.run(scenario(k8s))
    assert seen == [READY_WORKERS]


def test_outside_a_pod_the_kubeconfig_gives_the_api_server_and_the_namespace(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    with RecordedPodLists("cascade", {WORKER_SELECTOR: WORKERS}) as k8s:
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "dev",
            "clusters": [{"name": "dev", "cluster": {"server": f"http://127.0.0.1:{k8s.server.server_address[1]}"}}],
            "users": [{"name": "dev", "user": {"token": "t0ken"}}],
            "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "dev", "namespace": "cascade"}}]}))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        discovery = KubernetesDiscovery(selector=WORKER_SELECTOR)
        assert discovery.namespace == "cascade"
        assert discovery.discover() == READY_WORKERS


def test_no_cluster_and_no_kubeconfig_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="k8s discovery: not in a pod .* no usable kubeconfig"):
        KubernetesDiscovery("cascade", WORKER_SELECTOR)


# --- configuration: [gateway] k8s_* and cascade cloud serve --k8s-* --------------------------------------

def serve_config(monkeypatch, argv: list[str]):
    from cascade_cli.main import main

    got = []
    monkeypatch.setattr("cloud_tier.serve.run", lambda config, *rest: got.append(config))
    code = main(["cloud", "serve", *argv])
    return code, (got[0] if got else None)


def test_the_k8s_flags_reach_the_gateway_config(monkeypatch):
    code, config = serve_config(monkeypatch, [
        "--k8s-prefill-selector", "app.kubernetes.io/name=vllm-prefill",
        "--k8s-decode-selector", "app.kubernetes.io/name=vllm-decode", "--k8s-namespace", "inference",
        "--k8s-port", "8080"])
    assert code == 0
    g = config.gateway
    assert (g.k8s_selector, g.k8s_prefill_selector, g.k8s_decode_selector, g.k8s_namespace, g.k8s_port) == (
        "", "app.kubernetes.io/name=vllm-prefill", "app.kubernetes.io/name=vllm-decode", "inference", 8080)
    assert g.k8s_discovery


def test_k8s_discovery_is_off_unless_a_selector_is_set_and_env_sets_it_too():
    from cloud_tier.config import CloudConfig

    assert not CloudConfig.load(environ={}).gateway.k8s_discovery
    env = {"CASCADE_CLOUD_GATEWAY_K8S_SELECTOR": WORKER_SELECTOR, "CASCADE_CLOUD_GATEWAY_K8S_PORT": "9000"}
    g = CloudConfig.load(environ=env).gateway
    assert g.k8s_discovery and (g.k8s_selector, g.k8s_port) == (WORKER_SELECTOR, 9000)


def test_a_bad_k8s_port_exits_2_with_one_line(monkeypatch, capsys):
    code, config = serve_config(monkeypatch, ["--k8s-selector", WORKER_SELECTOR, "--k8s-port", "0"])
    assert (code, config) == (2, None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "k8s_port must be in 1..65535" in err
