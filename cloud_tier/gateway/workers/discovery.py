"""Workers found through the Kubernetes API by label selector, for a gateway running in a cluster.

A pod is a worker only while it can take traffic: Running, its Ready condition True (its
readiness probe passes), not terminating (no ``deletionTimestamp``: a pod being drained stays
Running and Ready until its containers exit) and with a pod IP. Its role comes from the selector
that matched it (``prefill_selector``, ``decode_selector``), else from its ``cascade.dev/role``
label, else it is ``both``; its kind from its ``cascade.dev/worker-type`` label ("" when absent:
the pool detects it). The pure part, ``pods_to_workers``, takes a pod list as the API returns it
(``kubectl get pods -o json``), so it is tested on recorded lists without a cluster."""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cascade import wire
from cascade.config import ConfigError
from cloud_tier.gateway.workers.metrics_scrape import KINDS

log = logging.getLogger(__name__)

ROLE_LABEL = "cascade.dev/role"
TYPE_LABEL = "cascade.dev/worker-type"
ROLES = ("both", "prefill", "decode")
WORKER_TYPES = KINDS  # the worker pool's kinds
PORT_NAME = "http"  # a container port of this name is the worker's API port
# in a pod, the namespace it runs in (mounted with its service account token)
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MAX_POD_LIST_BYTES = 64 << 20  # one list call's answer (a pod is ~5-10 KB of JSON)


@dataclass(frozen=True, order=True)
class Discovered:
    url: str
    role: str  # prefill | decode | both
    worker_type: str = ""  # cascade | vllm | sglang | openai; "": not labelled, the pool detects it
    pod: str = ""  # namespace/name, for the logs


def pod_is_ready(pod: dict) -> bool:
    """Running, Ready, not terminating and with an IP: the only pods a request may be sent to."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    if status.get("phase") != "Running":
        return False
    try:  # an address a URL can hold, nothing else (an API answer is outside data too)
        ipaddress.ip_address(status["podIP"])
    except (ValueError, TypeError):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_port(pod: dict, default: int) -> int:
    """The container port named ``http`` (any container of the pod) when it is a port (an integer in
    1..65535), else ``default``."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if port.get("name") == PORT_NAME and type(number) is int and 0 < number <= 65535:
                return number
    return default


def pod_url(pod: dict, port: int = 8000, scheme: str = "http") -> str:
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"{scheme}://{host}:{pod_port(pod, port)}"


def pods_to_workers(pods, role: str = "", port: int = 8000, scheme: str = "http") -> list[Discovered]:
    """The ready pods of ``pods`` as workers, sorted by URL. ``pods``: a pod list as the API or
    ``kubectl get pods -o json`` gives it (a dict with ``items``), a list of such pod dicts, or
    the official client's V1PodList / V1Pod objects. ``role``: the role of every pod here (they
    matched a role's selector); "": each pod's ``cascade.dev/role`` label, else ``both``. A pod
    labelled with an unknown role or worker type is left out, with a warning: routing a
    mislabelled pod as something it is not would fail the requests sent to it."""
    if role and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    found = []
    for pod in _pod_dicts(pods):
        if not pod_is_ready(pod):
            continue
        meta = pod.get("metadata") or {}
        name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        labels = meta.get("labels") or {}
        pod_role = role or labels.get(ROLE_LABEL) or "both"
        worker_type = labels.get(TYPE_LABEL, "")
        if pod_role not in ROLES:
            log.warning("k8s discovery: pod %s left out: label %s=%r is not one of %s", name, ROLE_LABEL, pod_role,
                        ", ".join(ROLES))
            continue
        if worker_type and worker_type not in WORKER_TYPES:
            log.warning("k8s discovery: pod %s left out: label %s=%r is not one of %s", name, TYPE_LABEL,
                        worker_type, ", ".join(WORKER_TYPES))
            continue
        found.append(Discovered(pod_url(pod, port, scheme), pod_role, worker_type, name))
    return sorted(found)


def _pod_dicts(pods) -> Iterable[dict]:
    if isinstance(pods, dict):
        return pods.get("items") or []
    if isinstance(pods, list | tuple) and all(isinstance(p, dict) for p in pods):
        return pods
    # the client's model objects: to the API's own JSON shape (camelCase), as recorded lists have
    from kubernetes.client import ApiClient

    data = ApiClient().sanitize_for_serialization(pods)
    if isinstance(data, dict):
        return data.get("items") or []
    return data


class KubernetesDiscovery:
    """The ready worker pods of ``namespace`` matched by the selectors (Kubernetes label selectors,
    e.g. ``app.kubernetes.io/part-of=cascade,app.kubernetes.io/component=worker``). A pod matched by
    a role's selector has that role, whatever its label says; one matched by both role selectors
    is left out (a misconfiguration). ``namespace`` "": the gateway pod's own, else the kubeconfig
    context's, else ``default``. ``api``: a ``kubernetes.client.CoreV1Api``; None: built from the
    in-cluster service account, else from the kubeconfig. The calls block: from a coroutine, run
    ``discover`` in a thread (``follow`` does)."""

    def __init__(self, namespace: str = "", selector: str = "", prefill_selector: str = "",
                 decode_selector: str = "", port: int = 8000, scheme: str = "http", api=None,
                 timeout_s: float = 10.0):
        if not (selector or prefill_selector or decode_selector):
            raise ValueError("k8s discovery needs a selector, a prefill selector or a decode selector")
        if not 0 < port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.selectors = [(s, r) for s, r in ((prefill_selector, "prefill"), (decode_selector, "decode"),
                                              (selector, "")) if s]
        self.port = port
        self.scheme = scheme
        self.timeout_s = timeout_s
        self.api = api if api is not None else _core_api()
        self.namespace = namespace or _default_namespace()

    def list_pods(self, selector: str) -> dict:
        """One list call, its body as the API's JSON (not the client's model objects: the same
        shape as the recorded lists the tests feed ``pods_to_workers``, and cheaper to read)."""
        response = self.api.list_namespaced_pod(self.namespace, label_selector=selector,
                                                _preload_content=False, _request_timeout=self.timeout_s)
        try:  # bounded while read: one byte past the limit is enough to refuse it (wire's too_large)
            data = response.read(MAX_POD_LIST_BYTES + 1)
        finally:
            response.release_conn()
        return wire.loads(data, limit=MAX_POD_LIST_BYTES)

    def discover(self) -> list[Discovered]:
        """The workers now, sorted by URL. Raises what the API call raises (ApiException,
        urllib3's errors): the caller keeps what it had."""
        by_url: dict[str, Discovered] = {}
        role_of: dict[str, str] = {}  # url -> the role selector that matched it
        conflicting: set[str] = set()
        for selector, role in self.selectors:
            for d in pods_to_workers(self.list_pods(selector), role, self.port, self.scheme):
                if role and role_of.get(d.url, role) != role:
                    conflicting.add(d.url)
                if d.url not in by_url:  # role selectors come first: they win over the labels
                    by_url[d.url] = d
                    if role:
                        role_of[d.url] = role
        for url in conflicting:
            log.warning("k8s discovery: pod %s left out: both the prefill and the decode selector match it",
                        by_url.pop(url).pod)
        return sorted(by_url.values())

    def workers(self) -> dict[str, str]:
        """url -> role of the workers now."""
        return {d.url: d.role for d in self.discover()}


async def follow(discovery, on_change: Callable[[list[Discovered]], Awaitable[None] | None],
                 every_s: float = 5.0) -> None:
    """Call ``on_change(workers)`` with the discovered workers now, then whenever they change,
    until cancelled. ``on_change`` may be a coroutine function. The blocking list calls run in a
    thread. A failed call keeps the last set (an API server restarting must not empty the pool):
    the first failure and the recovery are logged, not every retry."""
    last: list[Discovered] | None = None
    failing = False
    while True:
        try:
            found = await asyncio.to_thread(discovery.discover)
        except Exception as e:  # ApiException, urllib3's connection errors, a bad body: all mean "try again"
            if not failing:
                log.warning("k8s discovery failed (keeping the %d workers known): %s", len(last or []), e)
            failing = True
        else:
            if failing:
                log.info("k8s discovery works again")
            failing = False
            if found != last:
                log.info("k8s discovery: %d workers: %s", len(found), ", ".join(f"{d.url} ({d.role})" for d in found))
                last = found
                result = on_change(found)
                if inspect.isawaitable(result):
                    await result
        await asyncio.sleep(every_s)


def _core_api():
    """A CoreV1Api on its own configuration (the client's global default is left alone): the
    service account when in a pod, else the kubeconfig."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException as in_cluster:
        try:
            config.load_kube_config(_kubeconfig(), client_configuration=cfg, persist_config=False)
        except (config.ConfigException, OSError) as e:
            raise ConfigError(f"k8s discovery: not in a pod ({in_cluster}) and no usable kubeconfig ({e})") from e
    return client.CoreV1Api(client.ApiClient(cfg))


def _kubeconfig() -> str | None:
    # $KUBECONFIG as it is now (the client reads it once, when first imported); None: ~/.kube/config
    return os.environ.get("KUBECONFIG") or None


def _default_namespace() -> str:
    try:
        return _NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        pass
    from kubernetes import config

    try:
        _, context = config.list_kube_config_contexts(_kubeconfig())
    except (config.ConfigException, OSError):  # no kubeconfig, or no current context: the API's default
        return "default"
    return (context or {}).get("context", {}).get("namespace") or "default"
