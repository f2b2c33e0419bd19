"""operator_patch.patch on rendered Deployment shapes of several operator versions.

Patches are applied with the independent `jsonpatch` library (RFC 6902), and results are validated
against the Kubernetes 1.32 OpenAPI schema, so a malformed op or object fails here.
"""

from __future__ import annotations

import copy
import json
import os

import jsonpatch
import kubernetes_validate
import pytest
from operator_helpers import load_yaml

from operator_patch.patch import (
    ENDPOINT_LABEL,
    PATCHED_KEY,
    SNAPSHOT_KEY,
    STRATEGY_KEY,
    WAIT_INIT,
    PatchConfig,
    PatchError,
    check,
    diff,
    l2_choice,
    mutate,
    plan,
    restore,
    snapshot,
    token_secret,
    wants_patch,
)

SHAPES = ["rendered-v3.2-stripped.yaml", "rendered-blog-duplicate.yaml", "rendered-l1-only-absent.yaml",
          "rendered-no-env.yaml"]
K8S_VERSION = "1.32"


def vllm(dep: dict) -> dict:
    by_name = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    return by_name.get(dep["metadata"]["name"]) or by_name["inference"]


def env_entries(dep: dict, name: str) -> list[dict]:
    return [e for e in vllm(dep).get("env") or [] if e["name"] == name]


def token_secrets(dep: dict) -> dict[str, dict[str, str]]:
    """A stand-in value for every Secret key the container's env references (the kubelet needs them present)."""
    return {e["valueFrom"]["secretKeyRef"]["name"]: {e["valueFrom"]["secretKeyRef"]["key"]: "x"}
            for e in vllm(dep).get("env") or [] if "secretKeyRef" in (e.get("valueFrom") or {})}


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("shape", SHAPES)
def test_mount_mode_gives_exactly_one_l2_setting(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dep = load_yaml(shape)
    cfg = PatchConfig()
    assert wants_patch(dep)
    assert check(dep, cfg), "the unpatched rendering must not pass verification"
    ops = plan(dep, cfg)
    assert ops
    out = jsonpatch.apply_patch(dep, ops)
    validate(out)
    assert check(out, cfg) == []
    endpoint = dep["metadata"]["ownerReferences"][0]["name"]  # no IEC read: one namespace per endpoint
    for name in ("LMCACHE_REMOTE_URL", "PYTHONHASHSEED", "LMCACHE_REMOTE_SERDE"):  # a shape's duplicates are gone:
        assert len(env_entries(out, name)) == 1, (name, env_entries(out, name))  # the kubelet takes the last one
    # what the pod's LMCache makes of it: the container's env as the kubelet gives it, read by from_env()
    from kubelet_env import container_env
    from lmcache.v1.config import LMCacheEngineConfig

    env = container_env(vllm(out), secrets=token_secrets(out),
                        fields={"spec.nodeName": "node-1", "status.hostIP": "10.0.1.1", "status.podIP": "10.0.0.7"})
    for k in list(os.environ):
        if k.startswith("LMCACHE_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        if k.startswith("LMCACHE_"):
            monkeypatch.setenv(k, v)
    lmc = LMCacheEngineConfig.from_env()
    assert lmc.remote_url == f"fs://localhost:0/mnt/l2fs/kvtier/kv/{endpoint}/unversioned/" and \
        lmc.remote_serde == "naive", (lmc.remote_url, lmc.remote_serde)
    assert env["PYTHONHASHSEED"] == "0"  # read by CPython itself: LMCache's builtin keys need it fixed
    # only this endpoint's own mount (the node's mount DaemonSet serves it at /mnt/l2fs/<endpoint>/<endpoint>),
    # through its plain parent directory /mnt/l2fs/<endpoint> (HostToContainer: a remount reaches the running pod;
    # read-only: nothing lands on the node's disk), seen where the URL's prefix is; never the node's whole
    # /mnt/l2fs
    mounts = [m for m in vllm(out)["volumeMounts"] if m["name"] == "kvtier-l2fs"]
    assert mounts == [{"name": "kvtier-l2fs", "mountPath": "/mnt/l2fs/kvtier/kv", "mountPropagation": "HostToContainer",
                       "readOnly": True}]
    # LMCache's dir: in the endpoint's FUSE mount, the volume's entry named after the endpoint
    assert lmc.remote_url.split("localhost:0", 1)[1].startswith(f"/mnt/l2fs/kvtier/kv/{endpoint}/")
    vols = [v for v in out["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvtier-l2fs"]
    assert vols == [{"name": "kvtier-l2fs", "hostPath": {"path": f"/mnt/l2fs/{endpoint}", "type": "DirectoryOrCreate"}}]
    (wait,) = [x for x in out["spec"]["template"]["spec"]["initContainers"] if x["name"] == WAIT_INIT]
    assert wait["command"][-1] == f"/mnt/l2fs/kvtier/kv/{endpoint}" and wait["volumeMounts"] == mounts  # the child
    # verify flags a pod given the node's whole mount tree (as patched before per-endpoint mounts)
    wide = copy.deepcopy(out)
    [v for v in wide["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvtier-l2fs"][0]["hostPath"]["path"] = "/mnt/l2fs"
    assert any("this endpoint's own mount" in p for p in check(wide, cfg)), check(wide, cfg)
    # and one patched before the parent-directory layout (its volume the FUSE mount itself, at the endpoint's path,
    # the init container waiting there): verify flags it, a second pass gives the layout above
    old = copy.deepcopy(out)
    (vm,) = [m for m in vllm(old)["volumeMounts"] if m["name"] == "kvtier-l2fs"]
    vm.pop("readOnly")
    vm["mountPath"] = f"/mnt/l2fs/kvtier/kv/{endpoint}"
    (owait,) = [x for x in old["spec"]["template"]["spec"]["initContainers"] if x["name"] == WAIT_INIT]
    owait["volumeMounts"] = [dict(vm)]
    problems = check(old, cfg)
    assert any("want one volumeMount kvtier-l2fs at /mnt/l2fs/kvtier/kv" in p for p in problems) and \
        any(f"{WAIT_INIT} waiting for the l2fs mount at /mnt/l2fs/kvtier/kv/{endpoint}" in p for p in problems), problems
    assert mutate(old, cfg) == out
    vm["mountPath"] = "/mnt/l2fs/kvtier/kv"  # right path, neither read-only nor HostToContainer
    vm.pop("mountPropagation")
    assert any("want volumeMount" in p and "readOnly" in p for p in check(old, cfg)), check(old, cfg)
    pod_meta = out["spec"]["template"]["metadata"]
    assert pod_meta["labels"][ENDPOINT_LABEL] == dep["metadata"]["ownerReferences"][0]["name"]
    assert pod_meta["annotations"][STRATEGY_KEY] == "prefixaware"
    assert out["metadata"]["annotations"][PATCHED_KEY] == cfg.fingerprint()
    # everything else is untouched: other containers, their order, the selector, replicas
    before = [c for c in dep["spec"]["template"]["spec"]["containers"] if c is not vllm(dep)]
    after = [c for c in out["spec"]["template"]["spec"]["containers"] if c["name"] != vllm(out)["name"]]
    assert before == after
    assert [c["name"] for c in out["spec"]["template"]["spec"]["containers"]] == \
        [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]]
    assert out["spec"]["selector"] == dep["spec"]["selector"]
    assert out["spec"].get("replicas") == dep["spec"].get("replicas")
    # idempotent: a second pass (the webhook sees its own output on the next UPDATE) changes nothing
    assert plan(out, cfg) == []


def test_env_order_and_dependencies_survive() -> None:
    """NODE_IP must stay before anything that could reference it; unrelated env keeps its order."""
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    out = jsonpatch.apply_patch(dep, plan(dep, PatchConfig()))
    names = [e["name"] for e in vllm(out)["env"]]
    assert names[:5] == ["PYTHONHASHSEED", "NODE_IP", "LMCACHE_REMOTE_URL", "LMCACHE_EXTRA_CONFIG",
                         "LMCACHE_CONTROLLER_PULL_URL"]
    assert names.index("LMCACHE_REMOTE_SERDE") == len(names) - 1
    untouched = {e["name"]: e for e in vllm(dep)["env"]}
    for e in vllm(out)["env"]:
        if e["name"] in ("NODE_IP", "LMCACHE_EXTRA_CONFIG", "LMCACHE_CONTROLLER_PULL_URL", "LMCACHE_LOCAL_CPU"):
            assert e == untouched[e["name"]]


def test_duplicates_collapse_to_first_position() -> None:
    dep = load_yaml("rendered-blog-duplicate.yaml")
    assert len(env_entries(dep, "LMCACHE_REMOTE_URL")) == 2
    out = jsonpatch.apply_patch(dep, plan(dep, PatchConfig()))
    names = [e["name"] for e in vllm(out)["env"]]
    assert names == ["LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_SERDE", "PYTHONHASHSEED", "NODE_IP"]
    # the old mount at the same path (a Curvine PVC) is replaced, not duplicated (the API would reject it)
    assert [m["mountPath"] for m in vllm(out)["volumeMounts"]].count("/mnt/l2fs") == 1


@pytest.mark.parametrize("shape", SHAPES)
def test_plugin_mode(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubelet_env import container_env
    from lmcache.v1.config import LMCacheEngineConfig

    dep = load_yaml(shape)
    cfg = PatchConfig(mode="plugin", master="l2fs-master.kvtier:8995")
    out = jsonpatch.apply_patch(dep, plan(dep, cfg))
    validate(out)
    assert check(out, cfg) == []
    # what LMCache in the pod reads: the container env (kubelet rules) through its own from_env()
    for k in [k for k in os.environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    pod_env = container_env(vllm(out), secrets={s: {"token": "t"} for s in [token_secret(out, cfg)]},
                            fields={"spec.nodeName": "node-a", "status.hostIP": "10.0.0.1"})
    for k, v in pod_env.items():
        if k.startswith("LMCACHE_"):
            monkeypatch.setenv(k, v)
    lmc = LMCacheEngineConfig.from_env()
    assert lmc.remote_url is None and lmc.remote_storage_plugins == ["l2fs"]
    assert pod_env["L2FS_NODE_ID"] == "node-a"
    extra = lmc.extra_config
    assert extra["remote_storage_plugin.l2fs.module_path"] == "connector.lmcache_l2fs"
    assert extra["remote_storage_plugin.l2fs.master"] == "l2fs-master.kvtier:8995"
    assert extra["remote_storage_plugin.l2fs.prefix"] == f"/kvtier/kv/{dep['metadata']['ownerReferences'][0]['name']}/unversioned"
    assert extra["remote_storage_plugin.l2fs.model_revision"] == "unversioned"
    if shape == "rendered-v3.2-stripped.yaml":  # the operator's own keys are kept
        assert extra["sagemaker_hyperpod_shared_memory_name"] == "ai_toolkit_cache"
    vols = [v for v in out["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvtier-l2fs"]
    assert vols == [{"name": "kvtier-l2fs", "hostPath": {"path": "/run/l2fs", "type": "DirectoryOrCreate"}}]
    # read-only: short-circuit reads only; a pod cannot overwrite blocks or the worker's manifest
    assert {"name": "kvtier-l2fs", "mountPath": "/run/l2fs", "readOnly": True} in vllm(out)["volumeMounts"]
    assert plan(out, cfg) == []
    # switching back to mount mode is a clean patch too
    back = jsonpatch.apply_patch(out, plan(out, PatchConfig()))
    assert check(back, PatchConfig()) == []


def test_pvc_volume_source() -> None:
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    cfg = PatchConfig(pvc_name="l2fs-rwx", mount_path="/mnt/kv", prefix="/cache/")
    out = jsonpatch.apply_patch(dep, plan(dep, cfg))
    validate(out)
    assert env_entries(out, "LMCACHE_REMOTE_URL")[0]["value"] == "fs://localhost:0/mnt/kv/cache/qwen2-7b/unversioned/"
    vols = [v for v in out["spec"]["template"]["spec"]["volumes"] if v["name"] == "kvtier-l2fs"]
    assert vols == [{"name": "kvtier-l2fs", "persistentVolumeClaim": {"claimName": "l2fs-rwx"}}]


def test_router_strategy_is_set() -> None:
    dep = load_yaml("router.yaml")
    assert wants_patch(dep)
    out = jsonpatch.apply_patch(dep, plan(dep, PatchConfig(router_strategy="kvaware")))
    validate(out)
    args = out["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--routing-logic") + 1] == "kvaware"
    assert out["spec"]["template"]["spec"]["containers"][1] == dep["spec"]["template"]["spec"]["containers"][1]
    assert check(out, PatchConfig(router_strategy="kvaware")) == []
    assert check(out, PatchConfig(router_strategy="session"))


def test_not_opted_in_or_not_owned_is_left_alone() -> None:
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    plain = copy.deepcopy(dep)
    del plain["metadata"]["annotations"]
    assert not wants_patch(plain)
    assert wants_patch(plain, all_owned=True)
    unowned = copy.deepcopy(dep)
    del unowned["metadata"]["ownerReferences"]
    assert not wants_patch(unowned)
    assert not wants_patch(unowned, all_owned=True)
    other_owner = copy.deepcopy(dep)
    other_owner["metadata"]["ownerReferences"][0]["apiVersion"] = "example.com/v1"
    assert not wants_patch(other_owner)
    assert not wants_patch({**dep, "kind": "StatefulSet"})
    router = load_yaml("router.yaml")
    del router["metadata"]["annotations"]
    assert not wants_patch(router)
    assert wants_patch(router, all_owned=True)


def iec(kv_cache: dict | None, annotations: dict | None = None) -> dict:
    return {"apiVersion": "inference.sagemaker.aws.amazon.com/v1", "kind": "InferenceEndpointConfig",
            "metadata": {"name": "qwen2-7b", "annotations": annotations or {}},
            "spec": {"kvCacheSpec": kv_cache} if kv_cache is not None else {}}


TIERED = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}


def test_endpoint_l2_choice_and_iec_opt_in() -> None:
    """redis and L2-disabled endpoints are never taken over; tieredstorage only with an opt-in, which may
    sit on the IEC (where users write it) or on the Deployment."""
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    plain = copy.deepcopy(dep)
    del plain["metadata"]["annotations"]
    assert wants_patch(dep, iec=iec(TIERED)) and wants_patch(dep, iec=iec({"enableL2Cache": True}))
    assert not wants_patch(plain, iec=iec(TIERED))
    assert wants_patch(plain, iec=iec(TIERED, {"kvtier.io/l2fs": "enabled"}))
    assert wants_patch(plain, all_owned=True, iec=iec(TIERED))
    redis = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "Redis"}}
    for kv in (redis, {"enableL1Cache": True, "enableL2Cache": False}, None):
        assert not l2_choice(iec(kv))[0]
        for obj in (dep, plain):
            assert not wants_patch(obj, iec=iec(kv, {"kvtier.io/l2fs": "enabled"}))
            assert not wants_patch(obj, all_owned=True, iec=iec(kv))
    # without the IEC, a rendered Redis URL still tells the endpoint chose Redis
    rendered_redis = copy.deepcopy(dep)
    for e in vllm(rendered_redis)["env"]:
        if e["name"] == "LMCACHE_REMOTE_URL":
            e["value"] = "redis://redis.team-a:6379"
    assert wants_patch(dep) and not wants_patch(rendered_redis) and not wants_patch(rendered_redis, all_owned=True)


def flag_json(c: dict, flag: str) -> dict:
    args = c["args"]
    return json.loads(args[args.index(flag) + 1])


@pytest.mark.parametrize("mode", ["mount", "plugin"])
def test_vllm_flags_failure_policy_and_kv_events(mode: str) -> None:
    """kv_load_failure_policy=recompute lands in the operator's own --kv-transfer-config (keys kept);
    --kv-events-config publishes on the named ports the router resolves."""
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    cfg = PatchConfig(mode=mode)  # type: ignore[arg-type]
    out = jsonpatch.apply_patch(dep, plan(dep, cfg))
    validate(out)
    c = vllm(out)
    assert flag_json(c, "--kv-transfer-config") == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                                    "kv_load_failure_policy": "recompute"}
    assert c["args"].count("--kv-transfer-config") == 1 and c["args"].count("--kv-events-config") == 1
    events = flag_json(c, "--kv-events-config")
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8080, "kv-events": 5557, "kv-replay": 5558}
    assert plan(out, cfg) == [] and check(out, cfg) == []
    # the operator's re-render drops them: check() notices, a second patch restores them
    rerender = copy.deepcopy(out)
    vllm(rerender)["args"] = vllm(dep)["args"]
    assert any("kv_load_failure_policy" in p for p in check(rerender, cfg))
    assert any("--kv-events-config" in p for p in check(rerender, cfg))
    # '--flag=value' form is edited in place; policy "" and port 0 leave vLLM as rendered
    eq = copy.deepcopy(dep)
    a = vllm(eq)["args"]
    i = a.index("--kv-transfer-config")
    a[i:i + 2] = ["--kv-transfer-config=" + a[i + 1]]
    c = vllm(mutate(eq, cfg))
    assert [json.loads(w.split("=", 1)[1]) for w in c["args"] if w.startswith("--kv-transfer-config=")] == [
        {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}]
    off = PatchConfig(mode=mode, kv_load_failure_policy="", kv_events_port=0)  # type: ignore[arg-type]
    c = vllm(mutate(dep, off))
    assert c["args"] == vllm(dep)["args"] and c["ports"] == vllm(dep)["ports"]
    # a container without args/command runs the image's CMD: adding args would replace it
    bare = load_yaml("rendered-no-env.yaml")
    c = vllm(mutate(bare, cfg))
    assert "args" not in c and "ports" not in c and check(mutate(bare, cfg), cfg) == []


def test_plugin_token_from_secret() -> None:
    """The engine pod's token comes from its endpoint's own Secret (engine role, its prefix only)."""
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    cfg = PatchConfig(mode="plugin")
    out = mutate(dep, cfg)
    assert env_entries(out, "L2FS_TOKEN") == [
        {"name": "L2FS_TOKEN", "valueFrom": {"secretKeyRef": {"name": "qwen2-7b-l2fs-token", "key": "token"}}}]
    assert out["spec"]["template"]["metadata"]["annotations"]["kvtier.io/l2fs-token-secret"] == "qwen2-7b-l2fs-token"
    assert check(out, cfg) == []
    insecure = PatchConfig(mode="plugin", token_secret="")
    assert env_entries(mutate(out, insecure), "L2FS_TOKEN") == []
    assert check(mutate(dep, PatchConfig(mode="plugin", token_secret="")), cfg) != []
    assert env_entries(mutate(dep, PatchConfig()), "L2FS_TOKEN") == []  # mount mode: the mount pod holds it
    assert env_entries(mutate(out, PatchConfig()), "L2FS_TOKEN") == []  # switching to mount mode drops it
    # an earlier plugin patch with the old shared token: switching to mount mode is not refused, the token goes
    legacy = mutate(dep, PatchConfig(mode="plugin", token_secret="l2fs-token", privileged_secrets=""))
    assert env_entries(mutate(legacy, PatchConfig()), "L2FS_TOKEN") == []


def test_privileged_token_secrets_are_refused() -> None:
    """Worker/admin credentials never reach an endpoint pod: the old shared token, the tokens file or the
    mount's admin token, by config, annotation or an existing reference, in either mode; the explicit
    opt-out (a privileged list without the shared token) keeps the old shared-token behaviour."""
    from operator_patch.patch import TOKEN_SECRET_KEY, Refused

    dep = load_yaml("rendered-v3.2-stripped.yaml")
    with pytest.raises(Refused, match="l2fs-token"):
        mutate(dep, PatchConfig(mode="plugin", token_secret="l2fs-token"))
    named = copy.deepcopy(dep)
    named["metadata"]["annotations"][TOKEN_SECRET_KEY] = "l2fs-tokens"
    with pytest.raises(Refused, match="l2fs-tokens"):
        mutate(named, PatchConfig(mode="plugin"))
    mounted = copy.deepcopy(dep)
    mounted["spec"]["template"]["spec"].setdefault("volumes", []).append(
        {"name": "x", "projected": {"sources": [{"secret": {"name": "l2fs-mount-token"}}]}})
    with pytest.raises(Refused, match="l2fs-mount-token"):
        mutate(mounted, PatchConfig())  # mount mode too
    assert any("l2fs-mount-token" in p for p in check(mounted, PatchConfig()))
    legacy = PatchConfig(mode="plugin", token_secret="l2fs-token", privileged_secrets="l2fs-tokens")
    out = mutate(dep, legacy)
    assert env_entries(out, "L2FS_TOKEN")[0]["valueFrom"]["secretKeyRef"]["name"] == "l2fs-token"
    assert check(out, legacy) == []
    named["metadata"]["annotations"][TOKEN_SECRET_KEY] = "Not A Name"
    with pytest.raises(PatchError, match="not a Secret name"):
        mutate(named, PatchConfig(mode="plugin"))


def test_missing_container_is_a_clear_error_and_no_change() -> None:
    dep = load_yaml("no-vllm-container.yaml")
    before = copy.deepcopy(dep)
    with pytest.raises(PatchError, match="no vLLM container.*reverse-proxy"):
        plan(dep, PatchConfig())
    assert dep == before
    dep["metadata"]["annotations"]["kvtier.io/container"] = "otel-collector"
    assert check(jsonpatch.apply_patch(dep, plan(dep, PatchConfig())), PatchConfig()) == []
    dep["metadata"]["annotations"]["kvtier.io/container"] = "nope"
    with pytest.raises(PatchError, match="names no container"):
        plan(dep, PatchConfig())
    with pytest.raises(PatchError, match="containers"):
        plan({"kind": "Deployment", "metadata": {"name": "x"}, "spec": {}}, PatchConfig())


def test_bad_config_is_rejected() -> None:
    for kwargs in ({"mode": "nfs"}, {"mount_path": "relative"}, {"mount_path": "/a,/b"},
                   {"router_strategy": "random"}, {"hash_seed": "x"}, {"master": "nohostport"},
                   {"prefix": "rel/path"}, {"prefix": "/"}, {"prefix": "/a/../b"},
                   {"kv_load_failure_policy": "retry"}, {"kv_events_port": 70000},
                   {"kv_events_port": 5557, "kv_replay_port": 5557}):
        with pytest.raises(ValueError):
            PatchConfig(**kwargs)


@pytest.mark.parametrize("shape", SHAPES + ["router.yaml"])
def test_snapshot_restores_the_rendering(shape: str) -> None:
    dep = load_yaml(shape)
    patched = mutate(dep, PatchConfig(mode="plugin" if "absent" in shape else "mount"))
    patched["metadata"].setdefault("annotations", {})[SNAPSHOT_KEY] = snapshot(dep)
    back = restore(patched)
    for field in ("annotations", "labels"):  # revert also drops the opt-in marker
        (dep["metadata"].get(field) or {}).pop("kvtier.io/l2fs", None)
        if dep["metadata"].get(field) == {}:
            del dep["metadata"][field]
    assert diff(dep, back) == []
    with pytest.raises(PatchError, match="nothing to revert"):
        restore(dep)


def test_diff_escapes_pointer_characters() -> None:
    ops = diff({"a": {"x/y": 1, "t~": 2}}, {"a": {"x/y": 2}})
    assert {"op": "remove", "path": "/a/t~02"} not in ops
    assert jsonpatch.apply_patch({"a": {"x/y": 1, "t~": 2}}, ops) == {"a": {"x/y": 2}}
    assert diff({"a": [1, 2]}, {"a": [1, 2]}) == []
    assert diff({"a": 1}, {"a": 1.0}) == [{"op": "replace", "path": "/a", "value": 1.0}]


def test_defaults_agree_with_the_connector_and_router() -> None:
    """operator_patch may not import the other packages, so its copies of their names are checked here."""
    import importlib.util

    from connector.config import DEFAULT_PREFIX, lmcache_config

    cfg = PatchConfig()
    assert cfg.prefix == DEFAULT_PREFIX
    plugin = lmcache_config(l2fs_master=cfg.master)["extra_config"]
    assert plugin["remote_storage_plugin.l2fs.module_path"] == cfg.plugin_module
    assert plugin["remote_storage_plugin.l2fs.class_name"] == cfg.plugin_class
    assert importlib.util.find_spec(cfg.plugin_module) is not None


def test_model_revision_sources() -> None:
    """The IEC decides (its annotation, else a hash of modelName + source + version); without it the
    Deployment's annotation, else what an earlier patch recorded on the pod template."""
    from operator_patch.patch import REVISION_KEY, endpoint_prefix, iec_revision, model_revision, mutate

    iec = {"spec": {"modelName": "m", "modelSourceConfig": {"modelLocation": "x", "prefetchEnabled": True}}}
    rev = iec_revision(iec)
    assert rev.startswith("src-") and rev == iec_revision(json.loads(json.dumps(iec)))
    iec["spec"]["modelSourceConfig"]["prefetchEnabled"] = False  # not part of the weights' identity
    assert iec_revision(iec) == rev
    assert iec_revision({"spec": {**iec["spec"], "model": {"modelVersion": "1.2"}}}).startswith("1.2-")
    iec["metadata"] = {"annotations": {REVISION_KEY: "weights-2026-11"}}
    assert iec_revision(iec) == "weights-2026-11"
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    assert model_revision(dep) == "unversioned"
    out = mutate(dep, PatchConfig(), iec)
    assert model_revision(out) == "weights-2026-11"  # a later pass without the IEC keeps the prefix
    assert endpoint_prefix(out, PatchConfig()) == ("weights-2026-11", "/kvtier/kv/qwen2-7b/weights-2026-11")
    dep["metadata"].setdefault("annotations", {})[REVISION_KEY] = "by-hand"
    assert model_revision(dep) == "by-hand"
