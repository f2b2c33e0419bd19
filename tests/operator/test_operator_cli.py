"""`kvtier operator-patch` against the Kubernetes API emulator (tests/operator/conftest.py).

The official `kubernetes` client talks HTTP to an emulated API server on 127.0.0.1; a toy deployment
controller there moves each Deployment's status to its spec, so every wait in the procedure is real.
"""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import Cluster, load_yaml
from polling import wait_until

from operator_patch.cli import PAUSED_KEY, REPLICAS_KEY, main
from operator_patch.patch import SNAPSHOT_KEY, PatchConfig, check

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]
CTRL_NS, CTRL = "hyperpod-inference-system", "hyperpod-inference-operator-controller-manager"
IEC = "inference.sagemaker.aws.amazon.com/v1/inferenceendpointconfigs"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferenceendpointconfigs.inference.sagemaker.aws.amazon.com"},
    "spec": {"group": "inference.sagemaker.aws.amazon.com", "scope": "Namespaced",
             "names": {"plural": "inferenceendpointconfigs", "singular": "inferenceendpointconfig",
                       "kind": "InferenceEndpointConfig"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


# what kvtier takes over: an endpoint with L2 on and the tieredstorage placeholder backend
L2_SPEC: dict[str, Any] = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}


def controller() -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": CTRL, "namespace": CTRL_NS, "labels": {"control-plane": "controller-manager"}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"control-plane": "controller-manager"}},
                     "template": {"metadata": {"labels": {"control-plane": "controller-manager"}},
                                  "spec": {"containers": [{"name": "manager",
                                                           "image": "hyperpod-inference-operator:v3.2"}]}}}}


def setup(cluster: Cluster, shape: str = "rendered-v3.2-stripped.yaml", crd: bool = True,
          ctrl: bool = True, kv_cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """CRD + IEC + operator controller + the operator's rendered Deployment, rolled out."""
    dep = load_yaml(shape)
    ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
    if crd:
        cluster.ext.create_custom_resource_definition(CRD)
    group, plural = "inference.sagemaker.aws.amazon.com", "inferenceendpointconfigs"
    cluster.custom.create_namespaced_custom_object(
        group, "v1", ns, plural,
        {"apiVersion": f"{group}/v1", "kind": "InferenceEndpointConfig", "metadata": {"name": name, "namespace": ns},
         "spec": {"modelName": name, "worker": {"image": "vllm"},
                  "kvCacheSpec": L2_SPEC if kv_cache is None else kv_cache}})
    iec = cluster.custom.get_namespaced_custom_object(group, "v1", ns, plural, name)
    dep["metadata"]["ownerReferences"][0]["uid"] = iec["metadata"]["uid"]
    dep["metadata"].pop("annotations", None)  # the CLI opts it in itself
    dep["metadata"]["labels"].pop("kvtier.io/l2fs", None) if "labels" in dep["metadata"] else None
    if ctrl:
        cluster.apps.create_namespaced_deployment(CTRL_NS, controller())
    cluster.apps.create_namespaced_deployment(ns, dep)
    wait_ready(cluster, ns, name)
    return cluster.deployment(ns, name)


def wait_ready(cluster: Cluster, ns: str, name: str) -> None:
    wait_until(lambda: (cluster.deployment(ns, name).get("status") or {}).get("readyReplicas") ==
               cluster.deployment(ns, name)["spec"].get("replicas", 1), 10)


def run(cluster: Cluster, action: str, ns: str = "team-a", endpoint: str = "qwen2-7b", *extra: str) -> int:
    return main([action, "--namespace", ns, "--endpoint", endpoint, "--kubeconfig", str(cluster.kubeconfig),
                 "--poll", "0.05", "--timeout", "5", *extra])


def replicas_seen(cluster: Cluster, ns: str, name: str) -> list[int]:
    """spec.replicas over the object's history, consecutive repeats collapsed."""
    out: list[int] = []
    for v in cluster.history("apps/v1/deployments", ns, name):
        r = v["spec"].get("replicas", 1)
        if not out or out[-1] != r:
            out.append(r)
    return out


def test_apply_pauses_drains_patches_restores(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    before = setup(cluster)
    assert run(cluster, "verify") == 1
    out = capsys.readouterr().out
    assert "FAIL env LMCACHE_REMOTE_URL" in out
    # admitted unpatched (e.g. before the webhook answered): verify says how to get it patched
    assert "FIX team-a/qwen2-7b was admitted unpatched" in out and "rollout restart deployment/qwen2-7b" in out

    assert run(cluster, "apply") == 0
    out = capsys.readouterr().out
    assert "pausing operator" in out and "applied: team-a/qwen2-7b uses l2fs" in out
    assert "warning: MutatingWebhookConfiguration kvtier-operator-patch not found" in out
    dep = cluster.deployment("team-a", "qwen2-7b")
    assert check(dep, PatchConfig()) == []
    assert dep["spec"]["replicas"] == 2 and dep["status"]["readyReplicas"] == 2
    ann = dep["metadata"]["annotations"]
    assert ann["kvtier.io/l2fs"] == "enabled" and SNAPSHOT_KEY in ann and REPLICAS_KEY not in ann
    # the operator was paused for the whole patch and is back at its old size, marker removed
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1, 0, 1]
    assert PAUSED_KEY not in (cluster.deployment(CTRL_NS, CTRL)["metadata"].get("annotations") or {})
    # the model was drained before the template changed (no maxSurge deadlock), then scaled back
    assert replicas_seen(cluster, "team-a", "qwen2-7b") == [2, 0, 2]
    hist = cluster.history("apps/v1/deployments", "team-a", "qwen2-7b")
    first_patched = next(i for i, v in enumerate(hist) if check(v, PatchConfig()) == [])
    assert all(v["spec"]["replicas"] == 2 for v in hist[:first_patched] if check(v, PatchConfig()) == [])
    assert hist[first_patched]["spec"]["replicas"] in (0, 2)
    assert any(v["spec"]["replicas"] == 0 for v in hist[:first_patched])
    # everything the patch did not mean to touch is as the operator rendered it
    assert dep["spec"]["template"]["spec"]["containers"][1:] == before["spec"]["template"]["spec"]["containers"][1:]

    assert run(cluster, "verify") == 0
    for ns, name in ((CTRL_NS, CTRL), ("team-a", "qwen2-7b")):  # the emulated controller's last status write
        _wait_status_settled(cluster, ns, name)  # lands every 50 ms: count only once it has (a loaded box lags)
    n_ctrl = len(cluster.history("apps/v1/deployments", CTRL_NS, CTRL))
    n_dep = len(cluster.history("apps/v1/deployments", "team-a", "qwen2-7b"))
    assert run(cluster, "apply") == 0  # re-run: nothing to do, nothing written
    assert "already patched" in capsys.readouterr().out
    time.sleep(0.2)
    assert len(cluster.history("apps/v1/deployments", CTRL_NS, CTRL)) == n_ctrl
    assert len(cluster.history("apps/v1/deployments", "team-a", "qwen2-7b")) == n_dep


def _wait_status_settled(cluster: Cluster, ns: str, name: str, timeout: float = 10.0) -> None:
    """Until the emulator's deployment controller has nothing left to write for this Deployment (its status
    matches its spec and generation), so that counting stored versions is not racing that write."""
    end = time.monotonic() + timeout
    while True:
        d = cluster.deployment(ns, name)
        st, want = d.get("status") or {}, d["spec"].get("replicas", 1)
        if (st.get("observedGeneration") == d["metadata"].get("generation") and st.get("replicas") == want
                and st.get("readyReplicas") == want):
            return
        assert time.monotonic() < end, (ns, name, st)
        time.sleep(0.05)


def test_revert_restores_the_rendering(cluster: Cluster) -> None:
    before = setup(cluster)
    assert run(cluster, "revert") == 2  # never patched: nothing to revert, nothing written
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1]
    assert run(cluster, "apply") == 0
    assert run(cluster, "revert") == 0
    after = cluster.deployment("team-a", "qwen2-7b")
    assert after["spec"]["template"] == before["spec"]["template"]
    assert not (after["metadata"].get("annotations") or {})
    assert after["spec"]["replicas"] == 2
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1, 0, 1, 0, 1]
    assert run(cluster, "verify") == 1


@pytest.mark.parametrize("shape", ["rendered-blog-duplicate.yaml", "rendered-l1-only-absent.yaml",
                                   "rendered-no-env.yaml"])
def test_other_shapes_and_plugin_mode(cluster: Cluster, shape: str) -> None:
    dep = setup(cluster, shape)
    ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
    engine_secret(cluster, dep["metadata"]["ownerReferences"][0]["name"], ns)
    flags = ("--mode", "plugin", "--master", "l2fs-master.kvtier:8995")
    assert run(cluster, "apply", ns, name, *flags) == 0
    assert check(cluster.deployment(ns, name), PatchConfig(mode="plugin", master="l2fs-master.kvtier:8995")) == []
    assert run(cluster, "verify", ns, name, *flags) == 0
    assert run(cluster, "verify", ns, name) == 1  # mount-mode expectations are not met
    assert run(cluster, "apply", ns, name) == 0  # switching modes is another apply
    assert check(cluster.deployment(ns, name), PatchConfig()) == []


def token_secret(cluster: Cluster, value: str = "s3cret") -> None:
    from kubernetes import client

    client.CoreV1Api(cluster.api).create_namespaced_secret("kvtier", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "l2fs-token", "namespace": "kvtier"},
        "data": {"token": base64.b64encode(value.encode()).decode()}})


def engine_secret(cluster: Cluster, endpoint: str, ns: str) -> str:
    """The endpoint's engine-token Secret exactly as `kvtier tokens generate --secret-yaml` writes it; its token."""
    import yaml
    from kubernetes import client

    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "tokens", "generate", "--workers", "node-a",
                          "--engine", f"{endpoint}@{ns}", "--secret-yaml", "-"], capture_output=True, text=True,
                         timeout=60, check=True, cwd=ROOT).stdout
    (secret,) = [d for d in yaml.safe_load_all(out) if d["metadata"]["name"] == f"{endpoint}-l2fs-token"]
    assert secret["metadata"]["namespace"] == ns
    token = str(secret["stringData"]["token"])
    # what the API server stores for stringData (the emulator keeps fields as sent)
    secret["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in secret.pop("stringData").items()}
    client.CoreV1Api(cluster.api).create_namespaced_secret(ns, secret)
    return token


def read_secret(cluster: Cluster, ns: str, name: str = "l2fs-token") -> dict[str, Any]:
    from kubernetes import client

    return cluster.api.sanitize_for_serialization(client.CoreV1Api(cluster.api).read_namespaced_secret(name, ns))


def test_plugin_mode_requires_the_endpoint_token(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """The pod reads L2FS_TOKEN from its endpoint's own Secret (engine role); without it apply stops before
    any write (no tokenless pods) and says how to make it. The old shared token (admin + worker rights) is
    refused unless the cluster explicitly stops calling it privileged; then apply copies it from kvtier as
    before. --token-secret '' runs tokenless (insecure dev clusters)."""
    setup(cluster)
    flags = ("--mode", "plugin")
    assert run(cluster, "apply", "team-a", "qwen2-7b", *flags) == 2
    err = capsys.readouterr().err
    assert "team-a/qwen2-7b-l2fs-token" in err and "kvtier tokens generate --engine qwen2-7b@team-a" in err
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1]
    assert len({str(v["spec"]) for v in cluster.history("apps/v1/deployments", "team-a", "qwen2-7b")}) == 1
    engine_secret(cluster, "qwen2-7b", "team-a")
    assert run(cluster, "apply", "team-a", "qwen2-7b", *flags) == 0
    c = cluster.deployment("team-a", "qwen2-7b")["spec"]["template"]["spec"]["containers"][0]
    assert [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "L2FS_TOKEN"] == [
        {"name": "qwen2-7b-l2fs-token", "key": "token"}]  # not optional: a tokenless pod does not start
    assert run(cluster, "verify", "team-a", "qwen2-7b", *flags) == 0
    from kubernetes import client

    client.CoreV1Api(cluster.api).delete_namespaced_secret("qwen2-7b-l2fs-token", "team-a")
    assert run(cluster, "verify", "team-a", "qwen2-7b", *flags) == 1  # pods could not start
    assert "Secret team-a/qwen2-7b-l2fs-token" in capsys.readouterr().out
    # the shared token: refused (it would give the engine pod worker + admin rights) ...
    token_secret(cluster)
    before = cluster.deployment("team-a", "qwen2-7b")["spec"]
    assert run(cluster, "apply", "team-a", "qwen2-7b", *flags, "--token-secret", "l2fs-token") == 2
    assert "l2fs worker/admin credentials" in capsys.readouterr().err
    assert cluster.deployment("team-a", "qwen2-7b")["spec"] == before
    # ... unless explicitly allowed: then copied from kvtier, the old behaviour
    legacy = (*flags, "--token-secret", "l2fs-token", "--privileged-secrets", "l2fs-tokens")
    assert run(cluster, "apply", "team-a", "qwen2-7b", *legacy) == 0
    assert base64.b64decode(read_secret(cluster, "team-a")["data"]["token"]) == b"s3cret"
    assert run(cluster, "verify", "team-a", "qwen2-7b", *legacy) == 0
    assert run(cluster, "apply", "team-a", "qwen2-7b", "--mode", "plugin", "--token-secret", "") == 0
    c = cluster.deployment("team-a", "qwen2-7b")["spec"]["template"]["spec"]["containers"][0]
    assert not [e for e in c["env"] if e["name"] == "L2FS_TOKEN"]


@pytest.mark.parametrize("kv_cache, why", [
    ({"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "redis"}}, "l2CacheBackend 'redis'"),
    ({"enableL1Cache": True, "enableL2Cache": False}, "L2 disabled"),
    ({}, "L2 disabled"),
])
def test_endpoint_l2_choice_is_honoured(cluster: Cluster, capsys: pytest.CaptureFixture[str],
                                        kv_cache: dict[str, Any], why: str) -> None:
    setup(cluster, kv_cache=kv_cache)
    assert run(cluster, "apply") == 2
    assert why in capsys.readouterr().err
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1]
    assert len({str(v["spec"]) for v in cluster.history("apps/v1/deployments", "team-a", "qwen2-7b")}) == 1


def test_missing_crd(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    setup(cluster, crd=False)
    assert run(cluster, "apply") == 2
    assert "CRD inferenceendpointconfigs.inference.sagemaker.aws.amazon.com is not installed" in capsys.readouterr().err
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1]
    assert len({str(v["spec"]) for v in cluster.history("apps/v1/deployments", "team-a", "qwen2-7b")}) == 1


def test_missing_endpoint_and_deployment(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    setup(cluster)
    assert run(cluster, "apply", "team-a", "nope") == 2
    assert "InferenceEndpointConfig team-a/nope not found" in capsys.readouterr().err
    cluster.custom.create_namespaced_custom_object(
        "inference.sagemaker.aws.amazon.com", "v1", "team-a", "inferenceendpointconfigs",
        {"apiVersion": "inference.sagemaker.aws.amazon.com/v1", "kind": "InferenceEndpointConfig",
         "metadata": {"name": "pending", "namespace": "team-a"}, "spec": {"kvCacheSpec": L2_SPEC}})
    assert run(cluster, "apply", "team-a", "pending") == 2
    assert "has no rendered Deployment yet" in capsys.readouterr().err
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1]


def test_missing_container_changes_nothing(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    setup(cluster, "no-vllm-container.yaml")
    assert run(cluster, "apply", "team-a", "broken") == 2
    err = capsys.readouterr().err
    assert "no vLLM container" in err and "nothing was changed" in err
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1]
    assert len({str(v["spec"]) for v in cluster.history("apps/v1/deployments", "team-a", "broken")}) == 1


def test_missing_controller(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    setup(cluster, ctrl=False)
    assert run(cluster, "apply") == 2
    assert "operator controller not found in namespace hyperpod-inference-system" in capsys.readouterr().err
    assert run(cluster, "apply", "team-a", "qwen2-7b", "--no-pause") == 0
    assert run(cluster, "verify", "team-a", "qwen2-7b", "--no-pause") == 0


def test_controller_discovered_by_name_pattern(cluster: Cluster) -> None:
    setup(cluster, ctrl=False)
    ctrl = controller()
    ctrl["metadata"]["name"] = "hyperpod-inference-addon-controller-manager"
    cluster.apps.create_namespaced_deployment(CTRL_NS, ctrl)
    assert run(cluster, "apply") == 0
    assert replicas_seen(cluster, CTRL_NS, "hyperpod-inference-addon-controller-manager") == [1, 0, 1]


def test_timeout_keeps_operator_paused_and_rerun_finishes(cluster: Cluster,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    setup(cluster)
    cluster.emu.stuck.add("qwen2-7b")  # new pods never become ready
    assert run(cluster, "apply") == 3
    assert "timed out after 5s waiting for team-a/qwen2-7b to roll out" in capsys.readouterr().err
    ctrl = cluster.deployment(CTRL_NS, CTRL)
    assert ctrl["spec"]["replicas"] == 0 and ctrl["metadata"]["annotations"][PAUSED_KEY] == "1"
    assert run(cluster, "verify") == 1
    assert "still paused" in capsys.readouterr().out
    cluster.emu.stuck.clear()
    assert run(cluster, "apply") == 0
    assert "already paused by an earlier run" in capsys.readouterr().out
    assert cluster.deployment(CTRL_NS, CTRL)["spec"]["replicas"] == 1
    assert run(cluster, "verify") == 0


def test_interrupted_drain_is_finished(cluster: Cluster) -> None:
    """A run killed after the drain (model at 0, original size in an annotation) is completed."""
    setup(cluster)
    cluster.apps.patch_namespaced_deployment(
        "qwen2-7b", "team-a", {"metadata": {"annotations": {REPLICAS_KEY: "2"}}, "spec": {"replicas": 0}},
        _content_type="application/merge-patch+json")
    cluster.apps.patch_namespaced_deployment(
        CTRL, CTRL_NS, {"metadata": {"annotations": {PAUSED_KEY: "3"}}, "spec": {"replicas": 0}},
        _content_type="application/merge-patch+json")
    assert run(cluster, "apply") == 0
    assert cluster.deployment("team-a", "qwen2-7b")["spec"]["replicas"] == 2
    assert cluster.deployment(CTRL_NS, CTRL)["spec"]["replicas"] == 3


def test_concurrent_write_is_retried(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """Someone edits the Deployment between our read and our patch: the resourceVersion test op
    makes the API server answer 409 and the CLI starts that step over instead of clobbering it."""
    from operator_patch import cli

    setup(cluster)
    real = cli.Procedure.json_patch
    calls = {"n": 0}

    def racing(self: cli.Procedure, dep: dict, new: dict) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            cluster.apps.patch_namespaced_deployment(
                "qwen2-7b", "team-a", {"metadata": {"labels": {"edited": "yes"}}},
                _content_type="application/merge-patch+json")
        real(self, dep, new)

    cli.Procedure.json_patch = racing  # type: ignore[method-assign]
    try:
        assert run(cluster, "apply") == 0
    finally:
        cli.Procedure.json_patch = real  # type: ignore[method-assign]
    assert "changed while patching; retrying" in capsys.readouterr().out
    dep = cluster.deployment("team-a", "qwen2-7b")
    assert dep["metadata"]["labels"]["edited"] == "yes" and check(dep, PatchConfig()) == []


def test_bad_flags_and_credentials(cluster: Cluster, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "operator-patch", "apply", "--namespace", "x",
                        "--endpoint", "y", "--router-strategy", "random"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "router_strategy must be one of" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "operator-patch", "verify", "--namespace", "x",
                        "--endpoint", "y", "--kubeconfig", str(tmp_path / "missing")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot load Kubernetes credentials" in r.stderr


def test_entry_point_against_emulator(cluster: Cluster) -> None:
    """The installed console script, as a separate process, does the whole procedure."""
    setup(cluster)
    exe = Path(sys.executable).with_name("kvtier")
    args = ["--namespace", "team-a", "--endpoint", "qwen2-7b", "--kubeconfig", str(cluster.kubeconfig),
            "--timeout", "20"]
    r = subprocess.run([str(exe), "operator-patch", "apply", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(exe), "operator-patch", "verify", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK team-a/qwen2-7b" in r.stdout
    assert copy.deepcopy(cluster.deployment(CTRL_NS, CTRL))["spec"]["replicas"] == 1


def test_webhook_keeps_patch_across_operator_rerender(cluster: Cluster, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The emulated API server calls the real webhook process (HTTPS) on every Deployment write, as a
    MutatingWebhookConfiguration would. After `apply`, the operator re-renders (a full PUT of its own
    rendering, which drops the manual patch); the webhook puts the l2fs settings back in admission."""
    from operator_helpers import start_webhook

    hook = start_webhook(tmp_path)
    try:
        rendered = setup(cluster)
        cluster.emu.admission_url, cluster.emu.admission_ca = hook.url + "/mutate", hook.ca
        assert run(cluster, "apply") == 0
        assert "MutatingWebhookConfiguration kvtier-operator-patch not found" in capsys.readouterr().out
        # the operator's re-render: its own template, plus the opt-in the CLI left on the Deployment
        rerender = copy.deepcopy(rendered)
        for key in ("resourceVersion", "generation", "uid"):
            rerender["metadata"].pop(key, None)
        rerender.pop("status", None)
        rerender["metadata"]["annotations"] = {"kvtier.io/l2fs": "enabled"}
        rerender["spec"]["template"]["spec"]["containers"][0]["image"] += "-upgraded"
        assert check(rerender, PatchConfig())  # what the operator writes is unpatched
        cluster.apps.replace_namespaced_deployment("qwen2-7b", "team-a", rerender)
        stored = cluster.deployment("team-a", "qwen2-7b")
        assert stored["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-upgraded")
        assert check(stored, PatchConfig()) == []
        assert any(r.get("patch") for r in cluster.emu.admitted)
        # without the opt-in, the same re-render stays as the operator wrote it
        del rerender["metadata"]["annotations"]
        cluster.apps.replace_namespaced_deployment("qwen2-7b", "team-a", rerender)
        assert check(cluster.deployment("team-a", "qwen2-7b"), PatchConfig())
        # a dead webhook (failurePolicy Ignore) admits unchanged instead of blocking the operator
        hook.stop()
        rerender["metadata"]["annotations"] = {"kvtier.io/l2fs": "enabled"}
        cluster.apps.replace_namespaced_deployment("qwen2-7b", "team-a", rerender)
        assert cluster.deployment("team-a", "qwen2-7b")["metadata"]["annotations"] == {"kvtier.io/l2fs": "enabled"}
    finally:
        if hook.proc.poll() is None:
            hook.stop()


def test_failed_patch_rolls_back_drain_and_pause(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """The API server rejects the patch (422): the model is scaled back, the operator restored, and
    the template is as the operator rendered it (no partial patch)."""
    from kubernetes.client.exceptions import ApiException

    from operator_patch import cli

    before = setup(cluster)
    real = cli.Procedure.json_patch

    def rejected(self: cli.Procedure, dep: dict, new: dict) -> None:
        raise ApiException(status=422, reason="Invalid")

    cli.Procedure.json_patch = rejected  # type: ignore[method-assign]
    try:
        assert run(cluster, "apply") == 1
    finally:
        cli.Procedure.json_patch = real  # type: ignore[method-assign]
    assert "HTTP 422" in capsys.readouterr().err
    dep = cluster.deployment("team-a", "qwen2-7b")
    assert dep["spec"]["template"] == before["spec"]["template"]
    assert dep["spec"]["replicas"] == 2 and REPLICAS_KEY not in (dep["metadata"].get("annotations") or {})
    assert replicas_seen(cluster, CTRL_NS, CTRL) == [1, 0, 1]
    assert replicas_seen(cluster, "team-a", "qwen2-7b") == [2, 0, 2]


def test_verify_checks_what_the_installed_webhook_patches_with(cluster: Cluster,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """docs/deploy.md's `kvtier operator-patch verify --namespace N --endpoint E` (no --mode) after a plugin-mode
    install (hyperpod-p5: KVTIER_MODE=plugin in the webhook's ConfigMap): verify takes the settings the flags do
    not give from the webhook's Deployment (its envFrom ConfigMap) and passes; with the defaults (mount mode)
    it failed a correctly patched plugin-mode endpoint. A flag given still wins."""
    from kubernetes import client

    dep = setup(cluster)
    ns, name = dep["metadata"]["namespace"], dep["metadata"]["name"]
    engine_secret(cluster, name, ns)
    master = "l2fs-master-0.l2fs-master.kvtier.svc.cluster.local:8995"
    assert run(cluster, "apply", ns, name, "--mode", "plugin", "--master", master) == 0
    assert run(cluster, "verify", ns, name) == 1  # no webhook installed: the defaults (mount mode)
    core = client.CoreV1Api(cluster.api)
    core.create_namespaced_config_map("kvtier", {"apiVersion": "v1", "kind": "ConfigMap",
                                                 "metadata": {"name": "kvtier-config-5g2h8", "namespace": "kvtier"},
                                                 "data": {"KVTIER_MODE": "plugin", "KVTIER_MASTER": master,
                                                          "L2FS_MASTER": "x:1"}})
    cluster.apps.create_namespaced_deployment("kvtier", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "kvtier-webhook", "namespace": "kvtier"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "w"}}, "template": {
            "metadata": {"labels": {"app": "w"}}, "spec": {"containers": [{
                "name": "webhook", "image": "kvtier", "envFrom": [{"configMapRef": {"name": "kvtier-config-5g2h8"}}],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}]}}}})
    capsys.readouterr()
    assert run(cluster, "verify", ns, name) == 0
    out = capsys.readouterr().out
    assert "--mode, --master as the webhook in kvtier has them" in out and "plugin mode" in out, out
    assert run(cluster, "verify", ns, name, "--mode", "mount") == 1
