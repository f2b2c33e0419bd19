"""Secure defaults of the rendered manifests and the router <-> webhook wiring.

No cluster and no CNI run here: NetworkPolicies are checked statically (every selector selects the pods
it means, every port it opens is a named port of those pods, nothing else is open), as are tokens,
privileges and bind addresses. What a CNI would then enforce is not tested.
"""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import by_kind, configmap, one, render, workloads

from operator_patch.patch import KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME, PatchConfig

SECURE = ["base", "overlays/hyperpod-g6e", "overlays/hyperpod-p5", "overlays/hyperpod-p5-mp", "overlays/dev"]
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


def secret_volume(spec: dict[str, Any], c: dict[str, Any], path: str) -> dict[str, Any]:
    """The secret source of the volume `c` mounts at `path` (read-only)."""
    (m,) = [m for m in c.get("volumeMounts") or [] if m["mountPath"] == path]
    assert m.get("readOnly") is True
    return {v["name"]: v for v in spec["volumes"]}[m["name"]]["secret"]


def patch_config(cm: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> PatchConfig:
    """The webhook's PatchConfig as the deployment configures it (its flags default to $KVTIER_*)."""
    import argparse

    from operator_patch.options import add_config_args, config_from_args

    for k, v in cm.items():
        if k.startswith("KVTIER_"):
            monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return config_from_args(parser.parse_args([]))


def test_scoped_tokens_wired_unless_explicitly_insecure(rendered: dict[str, list[dict[str, Any]]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The master reads the tokens file from Secret l2fs-tokens (required); workers only the verifier file
    (Secret l2fs-token-verifiers, digests) and prove who they are with their projected ServiceAccount token
    (the master reviews it: --worker-identity k8s); so does the mount (--mount-sa: a credential per node, no
    Secret), the router holds a router-role
    token and its salts; no pod holds the old shared token. Engine pods (webhook, plugin mode) get their
    endpoint's own Secret, never a privileged one."""
    from operator_helpers import load_yaml

    from operator_patch.patch import mutate

    for target in SECURE + ["router"]:
        docs = rendered[target]
        found = {n: (c, spec) for n, _, spec in pods(docs) for c in spec["containers"]}
        for name, (c, _) in found.items():
            refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                    if "secretKeyRef" in (e.get("valueFrom") or {})]
            assert "l2fs-token" not in refs, (target, name)  # the shared admin+worker token is gone
        if by_kind(docs, "DaemonSet"):
            cm = configmap(docs, "kvtier-config")["data"]
            for name, var, secret, key in (("l2fs-master", "L2FS_TOKENS_FILE", "l2fs-tokens", "tokens.json"),
                                           ("l2fs-worker", "L2FS_TOKEN_VERIFIERS_FILE", "l2fs-token-verifiers",
                                            "verifiers.json")):
                c, spec = found[name]
                path = cm[var]
                assert not env_of(c, "L2FS_TOKEN"), (target, name)
                vol = secret_volume(spec, c, path.rsplit("/", 1)[0])
                assert vol["secretName"] == secret and not vol.get("optional"), (target, name)
                assert vol["items"] == [{"key": key, "path": path.rsplit("/", 1)[1]}]
                assert vol["defaultMode"] & 0o007 == 0 and spec["securityContext"]["fsGroup"] == 65532
                assert [v["secret"] for v in spec["volumes"] if (v.get("secret") or {}).get("secretName")] == [vol] or \
                    name == "l2fs-master", (target, name)  # the worker: no Secret but the verifiers
            worker, wspec = found["l2fs-worker"]
            assert worker["command"] == ["l2fs", "worker"]
            args = worker["args"]
            assert args[args.index("--tokens-file") + 1] == "$(L2FS_TOKEN_VERIFIERS_FILE)"
            assert args[args.index("--token-file") + 1] == "$(L2FS_WORKER_TOKEN_FILE)"
            assert cm["L2FS_WORKER_TOKEN_FILE"].rsplit("/", 1)[0] in [m["mountPath"] for m in worker["volumeMounts"]]
            assert wspec["serviceAccountName"] == "l2fs-worker" and wspec["automountServiceAccountToken"] is False
            master = found["l2fs-master"][0]["args"]
            assert master[master.index("--worker-identity") + 1] == "$(L2FS_WORKER_IDENTITY)"
            assert (cm["L2FS_WORKER_IDENTITY"], cm["L2FS_WORKER_SA"], cm["L2FS_WORKER_AUDIENCE"]) == (
                "k8s", "kvtier:l2fs-worker", "l2fs")
            # the FUSE mounts: one per endpoint, each with that endpoint's mount token from Secret
            # l2fs-endpoint-mounts (no other Secret, no token in the env, no ServiceAccount token)
            mount, mspec = found["l2fs-mount"]
            assert not env_of(mount, "L2FS_TOKEN") and '--endpoints "$L2FS_MOUNT_ENDPOINTS_DIR"' in mount["args"][0]
            assert mspec["serviceAccountName"] == "l2fs-mount" and mspec["automountServiceAccountToken"] is False
            (vol,) = [v for v in mspec["volumes"] if "secret" in v or "projected" in v]
            assert vol["secret"]["secretName"] == "l2fs-endpoint-mounts" and vol["secret"]["defaultMode"] == 0o400
            assert {m["name"]: m["mountPath"] for m in mount["volumeMounts"]}[vol["name"]] == \
                cm["L2FS_MOUNT_ENDPOINTS_DIR"]
            assert master[master.index("--mount-sa") + 1] == "$(L2FS_MOUNT_SA)"
            assert "--endpoint-writes" not in master  # the default (plugin): no mount but an endpoint's own
            # writes under a prefix an engine credential serves
            assert cm["L2FS_MOUNT_SA"] == "kvtier:l2fs-mount"
            # the webhook's config: per-endpoint token Secrets, and the privileged ones it refuses
            cfg = patch_config(cm, monkeypatch)
            assert cfg.token_secret == "{endpoint}-l2fs-token"
            assert {"l2fs-tokens", "l2fs-mount-token", "l2fs-token", "l2fs-endpoint-mounts"} <= set(
                cfg.privileged_secrets.split(","))
            plugin = mutate(load_yaml("rendered-v3.2-stripped.yaml"), PatchConfig(**{**cfg.__dict__, "mode": "plugin"}))
            pc = plugin["spec"]["template"]["spec"]["containers"][0]
            assert env_of(pc, "L2FS_TOKEN")[0]["valueFrom"]["secretKeyRef"] == {"name": "qwen2-7b-l2fs-token",
                                                                               "key": "token"}
            assert [m for m in pc["volumeMounts"] if m["mountPath"] == cfg.data_path][0]["readOnly"] is True
        if "kvtier-router" in found:
            c, spec = found["kvtier-router"]
            assert env_of(c, "L2FS_TOKEN")[0]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-router-l2fs-token",
                                                                              "key": "token"}
            salts = env_of(c, "KVTIER_KV_SALT_DIR")[0]["value"]
            assert secret_volume(spec, c, salts) == {"secretName": "kvtier-router-kv-salts", "optional": True,
                                                     "defaultMode": 0o440}
    insecure = rendered["overlays/dev-insecure"]
    found = {n: (c, spec) for n, _, spec in pods(insecure) for c in spec["containers"]}
    for name in ("l2fs-master", "l2fs-worker", "l2fs-mount"):
        c, spec = found[name]
        assert not env_of(c, "L2FS_TOKEN") and "/etc/l2fs" not in [m["mountPath"] for m in c["volumeMounts"]]
        assert not {"l2fs-tokens", "l2fs-token-verifiers", "identity"} & {v["name"] for v in spec["volumes"]}, name
    assert found["l2fs-worker"][0]["command"] == ["l2fs", "worker"]
    cm = configmap(insecure, "kvtier-config")["data"]
    assert cm["KVTIER_TOKEN_SECRET"] == "" and cm["L2FS_TOKENS_FILE"] == "" == cm["L2FS_TOKEN_VERIFIERS_FILE"]
    assert cm["L2FS_WORKER_IDENTITY"] == "tokens" and cm["L2FS_WORKER_TOKEN_FILE"] == ""
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
