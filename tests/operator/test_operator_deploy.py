"""deploy/: every kustomization renders with `kubectl kustomize`, every core object validates against the
Kubernetes 1.32 schema (kubernetes-validate), and the cross-object wiring a schema cannot see holds:
config keys vs $(VAR) uses, hostPaths vs config, probes/resources, RBAC scope, webhook <-> Service <->
Certificate <-> caBundle injection, router selector <-> the label the webhook adds.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from operator_helpers import by_kind, configmap, load_yaml, one, render, workloads

from operator_patch.options import _FLAGS, add_config_args, config_from_args
from operator_patch.patch import ENDPOINT_LABEL, mutate

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["base", "router", "monitoring", "overlays/hyperpod-g6e", "overlays/hyperpod-p5", "overlays/hyperpod-p5-mp",
           "overlays/dev", "overlays/dev-insecure"]
K8S_VERSION = "1.32"
CRD_KINDS = {"Issuer", "Certificate", "InferenceEndpointConfig", "PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module", params=TARGETS)
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


# A hand-written subset of the InferenceEndpointConfig v1 CRD schema (fields we use, from the
# operator notes in shared/reference/operator-bench.md §A1): required fields and the enums.
IEC_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.sagemaker.aws.amazon.com/v1"},
        "spec": {
            "type": "object",
            "required": ["modelName", "modelSourceConfig", "worker"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "instanceType": {"type": "string", "pattern": "^ml\\."},
                "kvCacheSpec": {"type": "object", "additionalProperties": False, "properties": {
                    "cacheConfigFile": {"type": "string"},
                    "enableL1Cache": {"type": "boolean"}, "enableL2Cache": {"type": "boolean"},
                    "l2CacheSpec": {"type": "object", "additionalProperties": False, "properties": {
                        "l2CacheBackend": {"type": "string", "pattern": "(?i)^(redis|tieredstorage)$"},
                        "l2CacheLocalUrl": {"type": "string"}}}}},
                "intelligentRoutingSpec": {"type": "object", "properties": {
                    "enabled": {"type": "boolean"},
                    "routingStrategy": {"enum": ["prefixaware", "kvaware", "session", "roundrobin"]}}},
                "worker": {
                    "type": "object",
                    "required": ["image", "modelInvocationPort", "modelVolumeMount", "resources"],
                    "properties": {
                        "args": {"type": "array", "items": {"type": "string"}},
                        "environmentVariables": {"type": "array", "items": {
                            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
                        "modelInvocationPort": {"type": "object", "required": ["containerPort", "name"],
                                                "properties": {"name": {"enum": ["http", "grpc"]},
                                                               "containerPort": {"type": "integer"}}},
                        "modelVolumeMount": {"type": "object", "required": ["name", "mountPath"]},
                    },
                },
            },
        },
    },
}


def test_every_object_validates(docs: list[dict[str, Any]]) -> None:
    kinds = set()
    for d in docs:
        kinds.add(d["kind"])
        if d["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert kinds <= CRD_KINDS | {"Namespace", "ConfigMap", "Service", "StatefulSet", "DaemonSet", "Deployment",
                                 "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget",
                                 "MutatingWebhookConfiguration", "ClusterRole", "ClusterRoleBinding",
                                 "NetworkPolicy"}, kinds
    for iec in by_kind(docs, "InferenceEndpointConfig"):
        jsonschema.validate(iec, IEC_SCHEMA)
    for issuer in by_kind(docs, "Issuer"):
        assert issuer["apiVersion"] == "cert-manager.io/v1" and "selfSigned" in issuer["spec"]
    for cert in by_kind(docs, "Certificate"):
        assert cert["apiVersion"] == "cert-manager.io/v1"
        assert {"secretName", "issuerRef", "dnsNames"} <= set(cert["spec"])


def test_containers_have_probes_resources_and_defined_vars(docs: list[dict[str, Any]]) -> None:
    cms = {c["metadata"]["name"]: c.get("data") or {} for c in by_kind(docs, "ConfigMap")}
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        volumes.update({t["metadata"]["name"]: t for t in w["spec"].get("volumeClaimTemplates") or []})
        for c in pod["containers"]:
            where = f"{w['kind']}/{w['metadata']['name']}/{c['name']}"
            assert c.get("readinessProbe") and c.get("livenessProbe"), where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where
            assert c["image"].split(":")[0].endswith("kvtier"), where
            defined = {e["name"] for e in c.get("env") or []}
            for ref in c.get("envFrom") or []:
                name = ref["configMapRef"]["name"]
                assert name in cms, f"{where}: envFrom {name} is not rendered"
                defined |= set(cms[name])
            words = [str(x) for x in (c.get("command") or []) + (c.get("args") or [])]
            for var in re.findall(r"\$\((\w+)\)", " ".join(words)):
                assert var in defined, f"{where}: $({var}) is not defined"
            for var in re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", " ".join(words)):  # shell-expanded
                assert var in defined, f"{where}: ${var} is not defined"
            for m in c.get("volumeMounts") or []:
                assert m["name"] in volumes, f"{where}: mount {m['name']} has no volume"
                if m.get("mountPropagation") == "Bidirectional":
                    assert (c.get("securityContext") or {}).get("privileged"), \
                        f"{where}: Bidirectional propagation is allowed only in privileged containers"
            named_ports = {p.get("name") for p in c.get("ports") or []}
            for probe in (c["readinessProbe"], c["livenessProbe"]):
                port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
                assert port is None or isinstance(port, int) or port in named_ports, where


def test_command_entry_points_exist(docs: list[dict[str, Any]]) -> None:
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            cmd = c["command"]
            if cmd[0] == "sh":
                assert re.search(r"exec (\w+) ", c["args"][0]).group(1) in scripts
            else:
                assert cmd[0] in scripts, cmd


def test_paths_and_ports_follow_config(docs: list[dict[str, Any]]) -> None:
    if not by_kind(docs, "DaemonSet"):
        pytest.skip("no l2fs components in this target")
    cfg = configmap(docs, "kvtier-config")["data"]
    for ds in by_kind(docs, "DaemonSet"):
        pod = ds["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["data"]["hostPath"]["path"] == cfg["L2FS_DATA_DIR"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["data"]["mountPath"] == cfg["L2FS_DATA_DIR"]  # same path: short-circuit I/O
        assert pod["tolerations"] and pod["nodeSelector"]
    mnt = one(docs, "DaemonSet", "l2fs-mount")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in mnt["volumes"]}["mnt"]["hostPath"]["path"] == cfg["L2FS_MOUNT_PATH"]
    assert cfg["KVTIER_HOST_PATH"] == cfg["L2FS_MOUNT_PATH"]
    assert cfg["KVTIER_MASTER"] == cfg["L2FS_MASTER"]
    ports = {
        ("StatefulSet", "l2fs-master", "grpc"): "L2FS_MASTER_PORT",
        ("StatefulSet", "l2fs-master", "metrics"): "L2FS_MASTER_METRICS_PORT",
        ("DaemonSet", "l2fs-worker", "grpc"): "L2FS_WORKER_PORT",
        ("DaemonSet", "l2fs-worker", "metrics"): "L2FS_WORKER_METRICS_PORT",
        ("DaemonSet", "l2fs-worker", "data"): "L2FS_WORKER_DATA_PORT",
        ("Deployment", "kvtier-webhook", "https"): "KVTIER_WEBHOOK_PORT",
    }
    for (kind, name, port), key in ports.items():
        c = one(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}[port] == int(cfg[key]), (name, port)
    master_ss = one(docs, "StatefulSet", "l2fs-master")
    svc = one(docs, "Service", master_ss["spec"]["serviceName"])
    host, port = cfg["L2FS_MASTER"].split(":")
    assert host == f"l2fs-master-0.{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    for name in ("l2fs-master", "l2fs-worker"):
        ann = one(docs, "StatefulSet" if name == "l2fs-master" else "DaemonSet", name)["spec"]["template"]["metadata"]
        assert ann["annotations"]["prometheus.io/scrape"] == "true"


def test_webhook_wiring(docs: list[dict[str, Any]]) -> None:
    hooks = by_kind(docs, "MutatingWebhookConfiguration")
    if not hooks:
        pytest.skip("no webhook in this target")
    (mwc,) = hooks
    (hook,) = mwc["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [{"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["deployments"], "scope": "Namespaced"}]
    ref = hook["clientConfig"]["service"]
    svc = one(docs, "Service", ref["name"])
    assert svc["metadata"]["namespace"] == ref["namespace"]
    assert ref["port"] in {p["port"] for p in svc["spec"]["ports"]} and ref["path"] == "/mutate"
    cert_ns, cert_name = mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    cert = one(docs, "Certificate", cert_name)
    assert cert["metadata"]["namespace"] == cert_ns
    assert f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc" in cert["spec"]["dnsNames"]
    issuer = one(docs, cert["spec"]["issuerRef"]["kind"], cert["spec"]["issuerRef"]["name"])
    assert issuer["metadata"]["namespace"] == cert_ns
    dep = one(docs, "Deployment", "kvtier-webhook")
    secrets = [v["secret"]["secretName"] for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert secrets == [cert["spec"]["secretName"]]
    assert dep["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
    # the KVTIER_* settings the webhook reads parse into a valid PatchConfig (names match options.py)
    cfg = configmap(docs, "kvtier-config")["data"]
    env_keys = {"KVTIER_" + f.lstrip("-").replace("-", "_").upper() for f in _FLAGS}
    assert {k for k in cfg if k.startswith("KVTIER_") and k != "KVTIER_WEBHOOK_PORT"} <= env_keys
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    ns = parser.parse_args([])
    for key, value in cfg.items():
        if key in env_keys:
            setattr(ns, next(f for flag, (f, _) in _FLAGS.items() if "KVTIER_" + flag.lstrip("-").replace(
                "-", "_").upper() == key), value)
    patch_cfg = config_from_args(ns)
    # what the webhook injects matches the mount DaemonSet's host path
    out = mutate(load_yaml("rendered-v3.2-stripped.yaml"), patch_cfg)
    vols = {v["name"]: v for v in out["spec"]["template"]["spec"]["volumes"]}
    mnt = one(docs, "DaemonSet", "l2fs-mount")["spec"]["template"]["spec"]
    if patch_cfg.mode == "mount":  # the endpoint's own directory under it (l2fs mount --endpoints), not all of it
        endpoint = out["spec"]["template"]["metadata"]["labels"]["kvtier.io/endpoint"]
        assert vols[patch_cfg.volume_name]["hostPath"]["path"] == {v["name"]: v for v in mnt["volumes"]}["mnt"][
            "hostPath"]["path"] + "/" + endpoint
    # plugin mode: the pod's hostPath vs the rendered worker's socket and data dirs is
    # test_operator_consumers.py::test_plugin_pods_see_the_workers_socket_not_the_data_dir


def test_rbac_is_least_privilege(docs: list[dict[str, Any]]) -> None:
    # two cluster-wide grants: the webhook may read (get) InferenceEndpointConfigs, the l2fs master may create
    # TokenReviews (how it checks workers' projected tokens), nothing else
    grants = {"kvtier-webhook-read-iec": ([{"apiGroups": ["inference.sagemaker.aws.amazon.com"],
                                            "resources": ["inferenceendpointconfigs"], "verbs": ["get"]}],
                                          "kvtier-webhook"),
              "kvtier-l2fs-tokenreview": ([{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                                            "verbs": ["create"]}], "l2fs-master")}
    for cr in by_kind(docs, "ClusterRole"):
        assert cr["rules"] == grants[cr["metadata"]["name"]][0]
    for crb in by_kind(docs, "ClusterRoleBinding"):
        sa = grants[crb["roleRef"]["name"]][1]
        assert crb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "kvtier"}]
    sas = {(s["metadata"].get("namespace"), s["metadata"]["name"]) for s in by_kind(docs, "ServiceAccount")}
    for role in by_kind(docs, "Role"):
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    for rb in by_kind(docs, "RoleBinding"):
        one(docs, "Role", rb["roleRef"]["name"])
        for s in rb["subjects"]:
            assert (s.get("namespace", rb["metadata"].get("namespace")), s["name"]) in sas
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        sa = spec.get("serviceAccountName")
        if sa not in ("kvtier-router", "kvtier-webhook", "l2fs-master"):  # only these talk to the API server
            assert spec.get("automountServiceAccountToken") is False, w["metadata"]["name"]
        if sa == "l2fs-worker":  # its only token (none when insecure): audience l2fs, for the master's TokenReview
            for v in spec["volumes"]:
                assert "projected" not in v or v["projected"]["sources"] == [{"serviceAccountToken": {
                    "path": "token", "audience": "l2fs", "expirationSeconds": 3600}}]


def test_g6e_example_endpoint_matches_router_and_webhook() -> None:
    docs = render("overlays/hyperpod-g6e")
    iec = one(docs, "InferenceEndpointConfig", "qwen2-7b")
    ns = iec["metadata"]["namespace"]
    assert one(docs, "Namespace", ns)["metadata"]["labels"]["kvtier.io/l2fs-webhook"] == "enabled"
    assert iec["metadata"]["annotations"]["kvtier.io/l2fs"] == "enabled"
    router_cfg = configmap(docs, "kvtier-router-config")
    assert router_cfg["metadata"]["namespace"] == ns
    assert router_cfg["data"]["ROUTER_SELECTOR"] == f"{ENDPOINT_LABEL}={iec['metadata']['name']}"
    assert int(router_cfg["data"]["ROUTER_ENGINE_PORT"]) == iec["spec"]["worker"]["modelInvocationPort"]["containerPort"]
    assert router_cfg["data"]["ROUTER_L2FS_MASTER"] == configmap(docs, "kvtier-config")["data"]["L2FS_MASTER"]
    assert router_cfg["data"]["ROUTER_L2FS_PREFIX"] == configmap(docs, "kvtier-config")["data"]["KVTIER_PREFIX"]
    # the router's L2 lookup builds the file names of the mode the webhook gives the replicas
    assert router_cfg["data"]["ROUTER_L2FS_MODE"] == configmap(docs, "kvtier-config")["data"]["KVTIER_MODE"]
    router = one(docs, "Deployment", "kvtier-router")
    assert router["metadata"]["namespace"] == ns and one(docs, "Role", "kvtier-router")["metadata"]["namespace"] == ns
    for ds in by_kind(docs, "DaemonSet"):
        assert ds["spec"]["template"]["spec"]["nodeSelector"] == {
            "node.kubernetes.io/instance-type": iec["spec"]["instanceType"]}


def test_overlay_settings_take_effect() -> None:
    p5 = configmap(render("overlays/hyperpod-p5"), "kvtier-config")["data"]
    assert p5["KVTIER_MODE"] == "plugin" and p5["L2FS_DATA_CAPACITY"] == "20T"
    dev = render("overlays/dev")
    assert configmap(dev, "kvtier-config")["data"]["L2FS_DATA_CAPACITY"] == "20G"
    assert one(dev, "Deployment", "kvtier-webhook")["spec"]["replicas"] == 1
    assert all(c["image"] == "kvtier:dev" for w in workloads(dev) for c in w["spec"]["template"]["spec"]["containers"])


def _help(cmd: list[str]) -> str:
    exe = Path(sys.executable).with_name(cmd[0])
    out = subprocess.run([str(exe), *cmd[1:], "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_flags_exist_in_the_components() -> None:
    """Every --flag the manifests pass is one the component's own parser accepts (catches renames)."""
    docs = render("overlays/hyperpod-g6e")
    helps: dict[tuple[str, ...], str] = {}
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            if c["command"][0] == "sh":
                words = c["args"][0].split("exec ", 1)[1].split()
                cmd, flags = tuple(words[:2]), [x for x in words if x.startswith("--")]
            else:
                command = [str(x) for x in c["command"]]
                if command[:3] == ["kvtier", "tokens", "exec"]:  # the worker's wrapper, then the real command
                    wrapper, command = command[:command.index("--")], command[command.index("--") + 1:]
                    helps.setdefault(tuple(wrapper[:3]), _help(wrapper[:3]))
                    for flag in (x for x in wrapper if x.startswith("--")):
                        assert re.search(rf"{re.escape(flag)}\b", helps[tuple(wrapper[:3])]), flag
                cmd = tuple(command[:2])
                flags = [x for x in c["args"] if str(x).startswith("--")]
            if cmd not in helps:
                helps[cmd] = _help(list(cmd))
            for flag in flags:
                assert re.search(rf"{re.escape(flag)}\b", helps[cmd]), f"{' '.join(cmd)} has no {flag}"
    assert set(helps) == {("l2fs", "master"), ("l2fs", "worker"), ("l2fs", "mount"), ("kvtier", "webhook"),
                          ("kvtier", "router")}
