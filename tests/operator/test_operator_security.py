"""Secure defaults of the rendered manifests (issue 13.8) and the router <-> webhook wiring (issue 11.3).

No cluster and no CNI run here: NetworkPolicies are checked statically (every selector selects the pods
it means, every port it opens is a named port of those pods, nothing else is open), as are tokens,
privileges and bind addresses. What a CNI would then enforce is not tested.
"""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import by_kind, configmap, one, render, workloads

from operator_patch.patch import KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME, PatchConfig

SECURE = ["base", "overlays/hyperpod-g6e", "overlays/hyperpod-p5", "overlays/dev"]
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {t: render(t) for t in SECURE + ["overlays/dev-insecure", "router"]}


def pods(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod template metadata, pod spec) of every workload."""
    return [(w["metadata"]["name"], w["spec"]["template"]["metadata"], w["spec"]["template"]["spec"])
            for w in workloads(docs)]


def env_of(c: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in c.get("env") or [] if e["name"] == name]


def l2fs_containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, c) for n, _, spec in pods(docs) if n in ("l2fs-master", "l2fs-worker", "l2fs-mount", "kvtier-router")
            for c in spec["containers"]]


def test_token_is_required_unless_explicitly_insecure(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for target in SECURE + ["router"]:
        docs = rendered[target]
        found = l2fs_containers(docs)
        assert found, target
        for name, c in found:
            tokens = env_of(c, "L2FS_TOKEN")
            assert len(tokens) == 1, (target, name)
            ref = tokens[0]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "l2fs-token" and ref["key"] == "token" and not ref.get("optional"), (target, name)
        if by_kind(docs, "DaemonSet"):
            cfg = configmap(docs, "kvtier-config")["data"]
            assert cfg["KVTIER_TOKEN_SECRET"] == "l2fs-token"  # the webhook adds it to plugin-mode pods
    insecure = rendered["overlays/dev-insecure"]
    assert all(not env_of(c, "L2FS_TOKEN") for _, c in l2fs_containers(insecure))
    assert configmap(insecure, "kvtier-config")["data"]["KVTIER_TOKEN_SECRET"] == ""
    # the webhook's own parser takes the empty value as "no token" (not as a secret named '')
    assert PatchConfig(mode="plugin", token_secret="").token_secret == ""


def test_router_api_key_one_replica_tokenizer_and_event_ports(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for target in ("router", "overlays/hyperpod-g6e"):
        docs = rendered[target]
        dep = one(docs, "Deployment", "kvtier-router")
        # 2 routers agree without sharing state only with --prefix-affinity (measured: docs/results.md)
        assert dep["spec"]["replicas"] == 2
        assert {"name": "KVTIER_ROUTER_PREFIX_AFFINITY", "value": "1"} in dep["spec"]["template"]["spec"]["containers"][0]["env"]
        spec = dep["spec"]["template"]["spec"]
        c = spec["containers"][0]
        key = env_of(c, "KVTIER_ROUTER_API_KEY")[0]["valueFrom"]["secretKeyRef"]
        assert key == {"name": "kvtier-router-api-key", "key": "api-key"}
        cfg = configmap(docs, "kvtier-router-config")["data"]

        def flag(name: str, c: dict[str, Any] = c, cfg: dict[str, str] = cfg) -> str:
            args = [str(a) for a in c["args"]]
            value = args[args.index(name) + 1]
            return cfg[value[2:-1]] if value.startswith("$(") and value[2:-1] in cfg else value

        # the names the webhook gives vLLM's event ports are the ones the router resolves
        assert flag("--k8s-kv-events-port") == KV_EVENTS_PORT_NAME
        assert flag("--k8s-kv-replay-port") == KV_REPLAY_PORT_NAME
        # --tokenizer is a directory the init container fills from the model source, mounted read-only
        tok = flag("--tokenizer")
        init = {i["name"]: i for i in spec["initContainers"]}["tokenizer"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert tok in mounts and {m["mountPath"]: m["name"] for m in init["volumeMounts"]}[tok] == mounts[tok]
        assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[mounts[tok]]
        assert "$ROUTER_TOKENIZER_S3_URI" in init["args"][0] and cfg["ROUTER_TOKENIZER_S3_URI"].startswith("s3://")
    g6e = rendered["overlays/hyperpod-g6e"]
    iec = one(g6e, "InferenceEndpointConfig", "qwen2-7b")["spec"]["modelSourceConfig"]
    cfg = configmap(g6e, "kvtier-router-config")["data"]
    assert cfg["ROUTER_TOKENIZER_S3_URI"].rstrip("/") == \
        f"s3://{iec['s3Storage']['bucketName']}/{iec['modelLocation']}"
    assert cfg["ROUTER_TOKENIZER_S3_REGION"] == iec["s3Storage"]["region"]
    kv = configmap(g6e, "kvtier-config")["data"]
    assert int(kv["KVTIER_KV_EVENTS_PORT"]) == PatchConfig().kv_events_port
    assert int(kv["KVTIER_KV_REPLAY_PORT"]) == PatchConfig().kv_replay_port
    assert kv["KVTIER_KV_LOAD_FAILURE_POLICY"] == "recompute"


def test_servers_bind_the_pod_ip(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for target in SECURE + ["router"]:
        for name, _, spec in pods(rendered[target]):
            for c in spec["containers"]:
                words = [str(w) for w in (c.get("command") or []) + (c.get("args") or [])]
                assert not any("0.0.0.0" in w for w in words), (target, name)
                if "--host" in words:
                    assert words[words.index("--host") + 1] == "$(POD_IP)", (target, name)
                    assert env_of(c, "POD_IP")[0]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


# what each pod keeps, and why (docs/deploy.md "Security"): only the FUSE mount is privileged; only the
# worker's one-shot init container runs as root, with CHOWN alone
PRIVILEGED = {("l2fs-mount", "mount")}
ROOT_INIT = {("l2fs-worker", "own-data-dir"): ["CHOWN"]}


def test_least_privilege(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for target in SECURE + ["router"]:
        for name, _, spec in pods(rendered[target]):
            pod_sc = spec.get("securityContext") or {}
            for c in (spec.get("initContainers") or []) + spec["containers"]:
                where = (target, name, c["name"])
                sc = c.get("securityContext") or {}
                assert sc.get("readOnlyRootFilesystem") is True, where
                if (name, c["name"]) in PRIVILEGED:
                    assert sc.get("privileged") is True, where
                    continue
                assert not sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False, where
                assert sc["capabilities"]["drop"] == ["ALL"], where
                uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
                if (name, c["name"]) in ROOT_INIT:
                    assert uid == 0 and sc["capabilities"]["add"] == ROOT_INIT[(name, c["name"])], where
                    continue
                assert not sc["capabilities"].get("add"), where
                if c["image"].split(":")[0].endswith("kvtier"):  # our image: non-root everywhere else
                    assert uid and uid != 0 and pod_sc.get("runAsNonRoot") is True, where


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        have = labels.get(e["key"])
        if e["operator"] == "In" and have not in e["values"]:
            return False
        if e["operator"] == "Exists" and have is None:
            return False
    return True


def named_ports(spec: dict[str, Any]) -> set[str]:
    return {p["name"] for c in spec["containers"] for p in c.get("ports") or [] if p.get("name")}


# every named port and who may reach it (namespace selector labels, or pods of these workloads)
CLIENTS = {"kvtier.io/l2fs-client": "enabled"}
SCRAPER = {"kvtier.io/metrics-scraper": "enabled"}
EXPECTED = {
    "l2fs-master": {"grpc": ({"l2fs-worker", "l2fs-mount"}, CLIENTS), "metrics": (set(), SCRAPER)},
    "l2fs-worker": {"grpc": ({"l2fs-master", "l2fs-mount"}, CLIENTS), "data": ({"l2fs-master", "l2fs-mount"}, CLIENTS),
                    "metrics": (set(), SCRAPER)},
    "l2fs-mount": {},  # serves nothing: only the default deny selects it
    "kvtier-webhook": {"https": None},  # None: from anywhere (the API server is outside the pod network)
    "kvtier-router": {"http": None},
}


def test_network_policies(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Default deny in kvtier; each open port is a named port of the selected pods, reachable from
    exactly the sources listed in EXPECTED; nothing else reaches the l2fs pods."""
    for target in SECURE + ["router"]:
        docs = rendered[target]
        policies = by_kind(docs, "NetworkPolicy")
        pod_list = [(n, m, s, w["metadata"].get("namespace")) for (n, m, s), w in zip(pods(docs), workloads(docs),
                                                                                       strict=True)]
        if by_kind(docs, "DaemonSet"):
            deny = one(docs, "NetworkPolicy", "default-deny-ingress")
            assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
        for name, meta, spec, ns in pod_list:
            mine = [p for p in policies if p["metadata"].get("namespace") == ns
                    and p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], meta["labels"])]
            assert name in EXPECTED, f"{target}: no expectation for {name}"
            assert len(mine) == (1 if EXPECTED[name] else 0), (target, name, [p["metadata"]["name"] for p in mine])
            opened: dict[str, Any] = {}
            for rule in mine[0]["spec"]["ingress"] if mine else []:
                sources = rule.get("from")
                pods_from = {n for n, m, _, pns in pod_list for src in sources or [] if "podSelector" in src
                             and pns == ns and selects(src["podSelector"], m["labels"])}
                ns_from = [src["namespaceSelector"]["matchLabels"] for src in sources or [] if "namespaceSelector" in src]
                for port in rule["ports"]:
                    assert port["port"] in named_ports(spec), (target, name, port)
                    assert port["protocol"] == "TCP"
                    opened[port["port"]] = None if sources is None else (pods_from, ns_from[0] if ns_from else {})
            assert opened == EXPECTED[name], (target, name, opened)
            assert named_ports(spec) == set(EXPECTED[name]), f"{target}: {name} has a port no policy names"
    ns = one(rendered["overlays/hyperpod-g6e"], "Namespace", "team-a")["metadata"]["labels"]
    assert selects({"matchLabels": CLIENTS}, ns)  # the example endpoint's pods may use l2fs
