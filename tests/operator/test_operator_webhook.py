"""`kvtier webhook` as a real process over HTTPS (trustme CA), fed real AdmissionReview v1 JSON."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonpatch
import pytest
from operator_helpers import Webhook, load_yaml, start_webhook

from operator_patch.patch import PatchConfig, check

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    hook = start_webhook(tmp_path_factory.mktemp("tls"))
    yield hook
    hook.stop()


def apply(resp: dict, obj: dict) -> dict:
    assert resp["patchType"] == "JSONPatch"
    return jsonpatch.apply_patch(obj, json.loads(base64.b64decode(resp["patch"])))


@pytest.mark.parametrize("shape", ["rendered-v3.2-stripped.yaml", "rendered-blog-duplicate.yaml",
                                   "rendered-l1-only-absent.yaml", "rendered-no-env.yaml"])
def test_render_is_patched_and_second_pass_is_noop(webhook: Webhook, shape: str) -> None:
    dep = load_yaml(shape)
    for operation in ("CREATE", "UPDATE"):
        resp = webhook.review(dep, operation)
        out = apply(resp, dep)
        assert check(out, PatchConfig()) == []
        again = webhook.review(out, "UPDATE", old=out)
        assert "patch" not in again and "patchType" not in again


def test_operator_rerender_is_patched_again(webhook: Webhook) -> None:
    """An operator UPDATE that carries its own rendering (our changes gone) gets them back."""
    rendered = load_yaml("rendered-v3.2-stripped.yaml")
    patched = apply(webhook.review(rendered, "CREATE"), rendered)
    rerender = copy.deepcopy(rendered)
    rerender["spec"]["template"]["spec"]["containers"][0]["image"] += "-v2"
    out = apply(webhook.review(rerender, "UPDATE", old=patched), rerender)
    assert check(out, PatchConfig()) == []
    assert out["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-v2")


def test_everything_else_is_allowed_unchanged(webhook: Webhook) -> None:
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    not_opted = copy.deepcopy(dep)
    del not_opted["metadata"]["annotations"]
    unowned = copy.deepcopy(dep)
    del unowned["metadata"]["ownerReferences"]
    for resp in (webhook.review(not_opted), webhook.review(unowned), webhook.review(dep, "DELETE", old=dep),
                 webhook.review(None, "DELETE", old=dep), webhook.review(dep, kind="StatefulSet"),
                 webhook.review(dep, "CONNECT")):
        assert "patch" not in resp and "warnings" not in resp


def test_unpatchable_deployment_is_admitted_with_warning(webhook: Webhook) -> None:
    resp = webhook.review(load_yaml("no-vllm-container.yaml"), "CREATE")
    assert "patch" not in resp
    assert "no vLLM container" in resp["warnings"][0] and "team-a/broken" in resp["warnings"][0]


def test_router_strategy(webhook: Webhook) -> None:
    dep = load_yaml("router.yaml")
    out = apply(webhook.review(dep, "UPDATE"), dep)
    args = out["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--routing-logic") + 1] == "prefixaware"


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not JSON"),
    (b"[]", "JSON object"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "x"}}),
     "apiVersion admission.k8s.io/v1"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}), "no 'request'"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ""}}),
     "uid"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                 "request": {"uid": "u", "object": [1]}}), "request.object"),
])
def test_malformed_review_is_400(webhook: Webhook, body: bytes | str, message: str) -> None:
    r = webhook.client.post(webhook.url + "/mutate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "malformed AdmissionReview" in r.json()["error"] and message in r.json()["error"]


def test_metrics_count_outcomes(webhook: Webhook) -> None:
    webhook.review(load_yaml("no-vllm-container.yaml"))
    text = webhook.client.get(webhook.url + "/metrics").text
    assert 'kvtier_webhook_reviews_total{outcome="error"}' in text
    assert 'kvtier_webhook_reviews_total{outcome="patched"}' in text


def test_plain_http_is_refused(webhook: Webhook) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(webhook.url.replace("https", "http") + "/healthz", timeout=3)
    with pytest.raises(httpx.ConnectError):  # and an unknown CA is not trusted
        httpx.get(webhook.url + "/healthz", timeout=3)


def test_all_owned_and_plugin_mode(tmp_path: Path) -> None:
    hook = start_webhook(tmp_path, "--all-owned", "--mode", "plugin", "--master", "l2fs-master.x:8995")
    try:
        dep = load_yaml("rendered-v3.2-stripped.yaml")
        del dep["metadata"]["annotations"]
        out = apply(hook.review(dep, "CREATE"), dep)
        assert check(out, PatchConfig(mode="plugin", master="l2fs-master.x:8995")) == []
    finally:
        hook.stop()


def test_bad_flags_fail_fast(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "webhook", "--tls-cert", "/nonexistent",
                        "--tls-key", "/nonexistent"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read /nonexistent" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "webhook", "--tls-cert", "a", "--tls-key", "b",
                        "--mode", "nfs"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "mode must be" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "webhook"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--tls-cert" in r.stderr


def test_owning_iec_decides_l2_choice_and_opt_in(cluster, tmp_path: Path) -> None:
    """The webhook reads the owning InferenceEndpointConfig from the API server (kmock): an opt-in on the
    IEC is enough, a Redis or L2-disabled endpoint is left alone even when the Deployment opted in, and
    an IEC it cannot find leaves the Deployment to decide."""
    group, plural = "inference.sagemaker.aws.amazon.com", "inferenceendpointconfigs"

    def make_iec(name: str, kv_cache: dict, annotations: dict | None = None) -> None:
        cluster.custom.create_namespaced_custom_object(group, "v1", "team-a", plural, {
            "apiVersion": f"{group}/v1", "kind": "InferenceEndpointConfig",
            "metadata": {"name": name, "namespace": "team-a", "annotations": annotations or {}},
            "spec": {"modelName": name, "kvCacheSpec": kv_cache}})

    def deployment(name: str, opted_in: bool) -> dict:
        dep = load_yaml("rendered-v3.2-stripped.yaml")
        dep["metadata"]["name"] = dep["metadata"]["ownerReferences"][0]["name"] = name
        dep["spec"]["template"]["spec"]["containers"][0]["name"] = name
        if not opted_in:
            del dep["metadata"]["annotations"]
        return dep

    tiered = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}
    make_iec("on-iec", tiered, {"kvtier.io/l2fs": "enabled"})
    make_iec("not-opted", tiered)
    make_iec("redis", {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "redis"}})
    make_iec("l1-only", {"enableL1Cache": True, "enableL2Cache": False})
    hook = start_webhook(tmp_path, "--k8s-api", cluster.url)
    try:
        dep = deployment("on-iec", opted_in=False)
        assert check(apply(hook.review(dep, "CREATE"), dep), PatchConfig()) == []
        assert "patch" not in hook.review(deployment("not-opted", opted_in=False), "CREATE")
        for name in ("redis", "l1-only"):
            assert "patch" not in hook.review(deployment(name, opted_in=True), "CREATE"), name
        dep = deployment("gone", opted_in=True)  # no such IEC (404): the Deployment's own opt-in decides
        assert check(apply(hook.review(dep, "CREATE"), dep), PatchConfig()) == []
        text = hook.client.get(hook.url + "/metrics").text
        assert 'kvtier_webhook_reviews_total{outcome="left_alone"} 2.0' in text
        assert 'kvtier_webhook_iec_lookups_total{result="ok"} 4.0' in text
        assert 'kvtier_webhook_iec_lookups_total{result="not_found"} 1.0' in text
    finally:
        hook.stop()


def test_unreachable_api_leaves_the_deployment_to_decide(tmp_path: Path) -> None:
    """No API server at --k8s-api: every review is still answered (the Deployment's own opt-in decides)."""
    from l2fs.common import free_port

    hook = start_webhook(tmp_path, "--k8s-api", f"http://127.0.0.1:{free_port()}")
    try:
        dep = load_yaml("rendered-v3.2-stripped.yaml")
        assert check(apply(hook.review(dep, "CREATE"), dep), PatchConfig()) == []
        plain = copy.deepcopy(dep)
        del plain["metadata"]["annotations"]
        assert "patch" not in hook.review(plain, "CREATE")
        assert 'kvtier_webhook_iec_lookups_total{result="error"} 2.0' in hook.client.get(hook.url + "/metrics").text
    finally:
        hook.stop()


def test_kv_prefix_per_endpoint_and_model_version(cluster, tmp_path: Path) -> None:
    """One KV namespace per endpoint revision (kmock API server, real webhook process): two endpoints
    serving the same /opt/ml/model get different prefixes; the same endpoint at a new model version (or
    new weights location) gets a new one; an unchanged IEC keeps its prefix (re-renders stay warm)."""
    from operator_patch.patch import KV_PREFIX_KEY, REVISION_KEY

    group, plural = "inference.sagemaker.aws.amazon.com", "inferenceendpointconfigs"
    tiered = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}

    def put_iec(name: str, location: str, version: str | None = None) -> None:
        body = {"apiVersion": f"{group}/v1", "kind": "InferenceEndpointConfig",
                "metadata": {"name": name, "namespace": "team-a", "annotations": {"kvtier.io/l2fs": "enabled"}},
                "spec": {"modelName": "Qwen2-7B-Instruct", "kvCacheSpec": tiered,
                         "modelSourceConfig": {"modelSourceType": "s3", "modelLocation": location,
                                               "s3Storage": {"bucketName": "b", "region": "us-west-2"}}}}
        if version:
            body["spec"]["modelVersion"] = version
        try:
            cluster.custom.delete_namespaced_custom_object(group, "v1", "team-a", plural, name)
        except Exception:  # noqa: BLE001 - first creation
            pass
        cluster.custom.create_namespaced_custom_object(group, "v1", "team-a", plural, body)

    def patched(name: str) -> dict:
        dep = load_yaml("rendered-v3.2-stripped.yaml")
        dep["metadata"]["name"] = dep["metadata"]["ownerReferences"][0]["name"] = name
        dep["spec"]["template"]["spec"]["containers"][0]["name"] = name
        del dep["metadata"]["annotations"]  # the opt-in is on the IEC
        out = apply(hook.review(dep, "CREATE"), dep)
        assert check(out, PatchConfig()) == []
        return out

    def where(dep: dict) -> tuple[str, str]:
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        url = [e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
               if e["name"] == "LMCACHE_REMOTE_URL"]
        assert url == [f"fs://localhost:0/mnt/l2fs{ann[KV_PREFIX_KEY]}/"]
        return ann[KV_PREFIX_KEY], ann[REVISION_KEY]

    put_iec("ep-a", "qwen2-7b-instruct")
    put_iec("ep-b", "qwen2-7b-instruct-finetuned")
    hook = start_webhook(tmp_path, "--k8s-api", cluster.url)
    try:
        a1, rev_a1 = where(patched("ep-a"))
        b1, _ = where(patched("ep-b"))
        assert a1.startswith("/kvtier/kv/ep-a/") and b1.startswith("/kvtier/kv/ep-b/") and a1 != b1
        assert where(patched("ep-a")) == (a1, rev_a1)  # same IEC, same prefix
        put_iec("ep-a", "qwen2-7b-instruct", version="2")
        a2, rev_a2 = where(patched("ep-a"))
        assert a2 != a1 and rev_a2.startswith("2-")
        put_iec("ep-a", "qwen2-7b-instruct", version="3")
        a3 = where(patched("ep-a"))[0]
        put_iec("ep-a", "qwen2-7b-instruct-v4", version="3")  # new weights location, version not bumped
        assert len({a1, a2, a3, where(patched("ep-a"))[0]}) == 4
    finally:
        hook.stop()


def test_engine_token_per_endpoint_never_privileged(cluster, tmp_path: Path) -> None:
    """Plugin mode, deploy's settings (kmock API server, real webhook process): each endpoint's pod gets
    L2FS_TOKEN from its own Secret (default <endpoint>-l2fs-token, or the IEC's kvtier.io/l2fs-token-secret),
    never the tokens file, the mount's admin token or the old shared token; an endpoint that names one of
    those, or whose pod already references one, is denied (403) and counted."""
    from operator_patch.patch import TOKEN_SECRET_KEY

    group, plural = "inference.sagemaker.aws.amazon.com", "inferenceendpointconfigs"
    tiered = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}
    privileged = {"l2fs-tokens", "l2fs-mount-token", "l2fs-token"}

    def put_iec(name: str, secret: str | None = None) -> None:
        ann = {"kvtier.io/l2fs": "enabled", **({TOKEN_SECRET_KEY: secret} if secret else {})}
        cluster.custom.create_namespaced_custom_object(group, "v1", "team-a", plural, {
            "apiVersion": f"{group}/v1", "kind": "InferenceEndpointConfig",
            "metadata": {"name": name, "namespace": "team-a", "annotations": ann},
            "spec": {"modelName": "m", "kvCacheSpec": tiered}})

    def rendered(name: str) -> dict:
        dep = load_yaml("rendered-v3.2-stripped.yaml")
        dep["metadata"]["name"] = dep["metadata"]["ownerReferences"][0]["name"] = name
        dep["spec"]["template"]["spec"]["containers"][0]["name"] = name
        del dep["metadata"]["annotations"]
        return dep

    def secret_refs(dep: dict) -> set[str]:
        spec = dep["spec"]["template"]["spec"]
        return {e["valueFrom"]["secretKeyRef"]["name"] for c in spec["containers"] for e in c.get("env") or []
                if "secretKeyRef" in (e.get("valueFrom") or {})} | {
                v["secret"]["secretName"] for v in spec.get("volumes") or [] if "secret" in v}

    put_iec("ep-a")
    put_iec("ep-b", "team-a-ep-b-engine")
    put_iec("ep-c", "l2fs-tokens")
    hook = start_webhook(tmp_path, "--k8s-api", cluster.url, "--mode", "plugin")
    cfg = PatchConfig(mode="plugin")
    try:
        for name, want in (("ep-a", "ep-a-l2fs-token"), ("ep-b", "team-a-ep-b-engine")):
            dep = rendered(name)
            out = apply(hook.review(dep, "CREATE"), dep)
            assert check(out, cfg) == []
            c = out["spec"]["template"]["spec"]["containers"][0]
            assert [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "L2FS_TOKEN"] == [
                {"name": want, "key": "token"}]
            assert not secret_refs(out) & privileged
            assert out["spec"]["template"]["metadata"]["annotations"][TOKEN_SECRET_KEY] == want
        # the IEC names the tokens file: denied, nothing patched
        denied = hook.review(rendered("ep-c"), "CREATE", allowed=False)
        assert denied["status"]["code"] == 403 and "l2fs-tokens" in denied["status"]["message"]
        assert "patch" not in denied
        # a pod that already carries the mount's admin token (a user-added env entry) is denied too
        sneaky = rendered("ep-a")
        sneaky["spec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "ADMIN", "valueFrom": {"secretKeyRef": {"name": "l2fs-mount-token", "key": "token"}}})
        assert "l2fs-mount-token" in hook.review(sneaky, "UPDATE", allowed=False)["status"]["message"]
        # an earlier shared-token patch (L2FS_TOKEN from l2fs-token) is replaced by the endpoint's own token
        legacy = rendered("ep-a")
        legacy["spec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "L2FS_TOKEN", "valueFrom": {"secretKeyRef": {"name": "l2fs-token", "key": "token"}}})
        out = apply(hook.review(legacy, "UPDATE"), legacy)
        assert "l2fs-token" not in secret_refs(out) and "ep-a-l2fs-token" in secret_refs(out)
        metrics = hook.client.get(hook.url + "/metrics").text
        assert 'kvtier_webhook_reviews_total{outcome="refused"} 2.0' in metrics
    finally:
        hook.stop()
