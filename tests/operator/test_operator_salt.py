"""Tenant isolation in the operator patch: an endpoint's KV-salt Secret (annotation kvtier.io/kv-salt-secret)
is mounted into patched pods and moves their chunk directory to <revision prefix>/salt@<hmac>, the same one
kvtier's own code (router, lmcache-config) derives from the salt. No annotation = today's patch."""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from operator_helpers import load_yaml, start_webhook

from connector.config import salt_secret
from kvtier import contract
from operator_patch.patch import (
    KV_PREFIX_KEY,
    KV_SALT_SECRET_KEY,
    SALT_DIR_VAR,
    SALT_MOUNT_PATH,
    SALT_VOLUME,
    PatchConfig,
    PatchError,
    check,
    mutate,
)

SALT = "0123456789abcdef-team-a-endpoint-salt"
SHAPE = "rendered-v3.2-stripped.yaml"


def _salted(dep: dict[str, Any], secret: str = "ep-a-kv-salt") -> dict[str, Any]:
    out = copy.deepcopy(dep)
    out["metadata"].setdefault("annotations", {})[KV_SALT_SECRET_KEY] = secret
    return out


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def kubelet_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as kubelet builds it: entries in order, secretKeyRef values read from
    `secrets`, and $(VAR) expanded only from entries above (a later or unknown one stays literal)."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        elif "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                    lambda m: env.get(m.group(1), m.group(0)), e["value"])
    return env


def seen_dir(env: dict[str, str], mode: str) -> str:
    """Where LMCache in the pod writes: the fs:// URL (mount mode) or the plugin's prefix."""
    if mode == "mount":
        return env["LMCACHE_REMOTE_URL"]
    return json.loads(env["LMCACHE_EXTRA_CONFIG"])["remote_storage_plugin.l2fs.prefix"]


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["mount", "plugin"])
def test_salt_secret_moves_the_chunk_directory(mode: str) -> None:
    cfg = PatchConfig(mode=mode)  # type: ignore[arg-type]
    plain = mutate(load_yaml(SHAPE), cfg)
    out = mutate(_salted(load_yaml(SHAPE)), cfg)
    assert check(out, cfg) == [] and mutate(out, cfg) == out  # verified, and a second pass is a no-op
    c = _container(out)
    assert c["env"][0] == {"name": SALT_DIR_VAR, "valueFrom": {"secretKeyRef": {"name": "ep-a-kv-salt", "key": "dir"}}}
    assert {"name": SALT_VOLUME, "mountPath": SALT_MOUNT_PATH, "readOnly": True} in c["volumeMounts"]
    assert {"name": SALT_VOLUME, "secret": {"secretName": "ep-a-kv-salt", "defaultMode": 0o440}} \
        in out["spec"]["template"]["spec"]["volumes"]
    ann = out["spec"]["template"]["metadata"]["annotations"]
    assert ann[KV_SALT_SECRET_KEY] == "ep-a-kv-salt"
    kv_prefix = ann[KV_PREFIX_KEY]  # the unsalted revision prefix: the annotation gives nothing away
    assert kv_prefix == plain["spec"]["template"]["metadata"]["annotations"][KV_PREFIX_KEY]
    assert SALT not in json.dumps(out) and "salt@" not in json.dumps(out)  # nor does the pod spec

    # what the pod sees once kubelet resolved the Secret (made by `kvtier lmcache-config salt-secret`)
    secrets = {"ep-a-kv-salt": salt_secret("ep-a-kv-salt", "team-a", SALT)["stringData"],
               "qwen2-7b-l2fs-token": {"token": "t"}}
    env = kubelet_env(c, secrets)
    want = contract.salted_prefix(kv_prefix, SALT)  # = what the router computes from the same salt
    assert want.startswith(kv_prefix + "/salt@")
    assert env[contract.SALT_FILE_ENV] == f"{SALT_MOUNT_PATH}/{contract.SALT_SECRET_KEY}"
    assert seen_dir(env, mode) == (cfg.url_for(want) if mode == "mount" else want)

    # the salt env must stay first: a rendering with it further down fails `check`
    moved = copy.deepcopy(out)
    moved_env = _container(moved)["env"]
    moved_env.append(moved_env.pop(0))
    assert any(SALT_DIR_VAR in p for p in check(moved, cfg))
    assert f"$({SALT_DIR_VAR})" in seen_dir(kubelet_env(_container(moved), secrets), mode)  # unexpanded


@pytest.mark.unit
def test_no_salt_is_todays_patch_and_dropping_it_cleans_up() -> None:
    cfg = PatchConfig()
    plain = mutate(load_yaml(SHAPE), cfg)
    text = json.dumps(plain)
    assert SALT_DIR_VAR not in text and SALT_VOLUME not in text and KV_SALT_SECRET_KEY not in text
    kv_prefix = plain["spec"]["template"]["metadata"]["annotations"][KV_PREFIX_KEY]
    assert kubelet_env(_container(plain), {})["LMCACHE_REMOTE_URL"] == cfg.url_for(kv_prefix)
    # an operator re-render of a salted Deployment without the annotation is patched back to unsalted
    salted = mutate(_salted(load_yaml(SHAPE)), cfg)
    rerender = copy.deepcopy(salted)
    del rerender["metadata"]["annotations"][KV_SALT_SECRET_KEY]
    del rerender["spec"]["template"]["metadata"]["annotations"][KV_SALT_SECRET_KEY]
    assert mutate(rerender, cfg)["spec"]["template"] == plain["spec"]["template"]


@pytest.mark.unit
@pytest.mark.parametrize("name", ["Upper", "a_b", "-x", "x" * 254, "a..b"])
def test_bad_secret_name_is_refused(name: str) -> None:
    with pytest.raises(PatchError, match="not a Secret name"):
        mutate(_salted(load_yaml(SHAPE), name), PatchConfig())


def test_webhook_mounts_the_iec_salt_secret(cluster, tmp_path: Path) -> None:
    """Real webhook process + kmock API server: the salt Secret named on the owning IEC is mounted into the
    patched pod template, the Secret itself is created as `kvtier lmcache-config salt-secret` prints it,
    and the patched Deployment is accepted by the API server."""
    from kubernetes import client

    group, plural = "inference.sagemaker.aws.amazon.com", "inferenceendpointconfigs"
    tiered = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}
    cluster.custom.create_namespaced_custom_object(group, "v1", "team-a", plural, {
        "apiVersion": f"{group}/v1", "kind": "InferenceEndpointConfig",
        "metadata": {"name": "ep-a", "namespace": "team-a",
                     "annotations": {"kvtier.io/l2fs": "enabled", KV_SALT_SECRET_KEY: "ep-a-kv-salt"}},
        "spec": {"modelName": "ep-a", "kvCacheSpec": tiered}})
    core = client.CoreV1Api(cluster.api)
    core.create_namespaced_secret("team-a", salt_secret("ep-a-kv-salt", "team-a", SALT))
    stored = core.read_namespaced_secret("ep-a-kv-salt", "team-a")
    data = {k: base64.b64decode(v).decode() for k, v in (stored.data or {}).items()} or dict(stored.string_data)
    assert data == {"salt": SALT, "dir": contract.salt_component(SALT)}

    hook = start_webhook(tmp_path, "--k8s-api", cluster.url)
    try:
        dep = load_yaml(SHAPE)
        dep["metadata"]["name"] = dep["metadata"]["ownerReferences"][0]["name"] = "ep-a"
        dep["spec"]["template"]["spec"]["containers"][0]["name"] = "ep-a"
        dep["metadata"]["namespace"] = "team-a"
        del dep["metadata"]["annotations"]  # opt-in and salt are on the IEC
        resp = hook.review(dep, "CREATE")
        out = jsonpatch.apply_patch(dep, json.loads(base64.b64decode(resp["patch"])))
        assert check(out, PatchConfig()) == []
        c = _container(out)
        assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "ep-a-kv-salt", "key": "dir"}
        assert any(v.get("secret", {}).get("secretName") == "ep-a-kv-salt"
                   for v in out["spec"]["template"]["spec"]["volumes"])
        env = kubelet_env(c, {"ep-a-kv-salt": data})
        kv_prefix = out["spec"]["template"]["metadata"]["annotations"][KV_PREFIX_KEY]
        assert kv_prefix.startswith("/kvtier/kv/ep-a/")
        assert env["LMCACHE_REMOTE_URL"] == PatchConfig().url_for(contract.salted_prefix(kv_prefix, SALT))
        out.pop("status", None)
        for key in ("resourceVersion", "uid", "creationTimestamp"):
            out["metadata"].pop(key, None)
        cluster.apps.create_namespaced_deployment("team-a", out)
        stored_dep = cluster.deployment("team-a", "ep-a")
        assert stored_dep["spec"]["template"]["spec"]["containers"][0]["env"][0]["name"] == SALT_DIR_VAR
    finally:
        hook.stop()


@pytest.mark.unit
def test_salt_survives_a_rerender_only_while_the_iec_is_unread() -> None:
    """An operator re-render drops the recorded annotation; while the IEC cannot be read the replaced object
    (`old`) keeps the endpoint salted (no fail-open); a readable IEC without the annotation unsalts it."""
    cfg = PatchConfig()
    salted = mutate(_salted(load_yaml(SHAPE)), cfg)
    rerender = load_yaml(SHAPE)  # the operator's fresh rendering: no annotation anywhere
    kept = mutate(rerender, cfg, old=salted)
    assert check(kept, cfg) == [] and _container(kept)["env"][0]["name"] == SALT_DIR_VAR
    assert kept["spec"]["template"]["metadata"]["annotations"][KV_SALT_SECRET_KEY] == "ep-a-kv-salt"
    iec = {"metadata": {"name": "qwen2-7b", "annotations": {}}, "spec": {}}
    assert SALT_DIR_VAR not in json.dumps(mutate(rerender, cfg, iec, old=salted))
    iec["metadata"]["annotations"][KV_SALT_SECRET_KEY] = "ep-a-kv-salt"
    assert _container(mutate(rerender, cfg, iec))["env"][0]["name"] == SALT_DIR_VAR


def test_webhook_keeps_the_salt_when_the_api_is_unreachable(tmp_path: Path) -> None:
    """Real webhook process, no API server: an UPDATE re-render of a salted endpoint stays salted."""
    from l2fs.common import free_port

    hook = start_webhook(tmp_path, "--k8s-api", f"http://127.0.0.1:{free_port()}")
    try:
        dep = _salted(load_yaml(SHAPE))
        patched = jsonpatch.apply_patch(dep, json.loads(base64.b64decode(hook.review(dep, "CREATE")["patch"])))
        rerender = load_yaml(SHAPE)
        resp = hook.review(rerender, "UPDATE", old=patched)
        out = jsonpatch.apply_patch(rerender, json.loads(base64.b64decode(resp["patch"])))
        assert check(out, PatchConfig()) == []
        assert _container(out)["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "ep-a-kv-salt"
        assert out["spec"]["template"]["metadata"]["annotations"][KV_SALT_SECRET_KEY] == "ep-a-kv-salt"
    finally:
        hook.stop()
