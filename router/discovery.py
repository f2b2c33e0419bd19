"""Kubernetes discovery: replicas are the Ready pods matching a label selector (list + watch, official client).

The watch runs in a thread (the official client is synchronous) and hands membership changes to the
event loop. Only Ready, non-terminating pods with an IP are routed to; a pod that turns unready, starts
terminating or disappears leaves the set at once (its cache beliefs are purged with it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from kvtier import contract

log = logging.getLogger("kvtier.router.discovery")

# Where the operator patch says a pod's endpoint revision writes its L2 chunks (operator_patch.patch.KV_PREFIX_KEY;
# not imported: the router image does not ship the operator patch).
KV_PREFIX_ANNOTATION = "kvtier.io/kv-prefix"


def parse_selector(sel: str) -> list[tuple[str, str, str | None]]:
    """Equality-based selector 'a=b,c!=d,e' -> [(key, op, value)] (checked again on our side)."""
    out: list[tuple[str, str, str | None]] = []
    for part in filter(None, (p.strip() for p in sel.split(","))):
        if "!=" in part:
            k, v = part.split("!=", 1)
            out.append((k.strip(), "!=", v.strip()))
        elif "==" in part or "=" in part:
            k, v = part.replace("==", "=").split("=", 1)
            out.append((k.strip(), "=", v.strip()))
        elif part.startswith("!"):
            out.append((part[1:], "!", None))
        else:
            out.append((part, "exists", None))
    return out


def matches(labels: dict[str, str], sel: list[tuple[str, str, str | None]]) -> bool:
    for k, op, v in sel:
        have = labels.get(k)
        if (op == "=" and have != v) or (op == "!=" and have == v) or (op == "exists" and have is None) \
                or (op == "!" and have is not None):
            return False
    return True


def _get(obj: Any, *path: str) -> Any:
    for p in path:
        if obj is None:
            return None
        obj = obj.get(p) if isinstance(obj, dict) else getattr(obj, p, None)
    return obj


def pod_ready(pod: dict[str, Any]) -> bool:
    if _get(pod, "metadata", "deletionTimestamp") or _get(pod, "status", "phase") != "Running":
        return False
    if not _get(pod, "status", "podIP"):
        return False
    conds = _get(pod, "status", "conditions") or []
    return any(c.get("type") == "Ready" and str(c.get("status")) == "True" for c in conds)


def pod_port(pod: dict[str, Any], port: int | str) -> int | None:
    """A numeric port, or the containerPort of the named port (e.g. 'http') in the pod spec."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for c in _get(pod, "spec", "containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
    return None


class K8sDiscovery:
    def __init__(self, namespace: str, selector: str, *, port: int | str = 8000, scheme: str = "http",
                 kv_events_port: int | str | None = None, kv_replay_port: int | str | None = None,
                 api_url: str | None = None, resync_seconds: int = 30) -> None:
        self.namespace = namespace
        self.selector = selector
        self._sel = parse_selector(selector)
        self.port, self.scheme = port, scheme
        self.kv_events_port, self.kv_replay_port = kv_events_port, kv_replay_port
        self.api_url = api_url
        self.resync = resync_seconds
        self._pods: dict[str, str] = {}  # pod name -> replica url
        self._prefixes: dict[str, Any] = {}  # pod name -> its (kv-prefix, kv layout) annotations
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replicas: Any = None
        self._watch: Any = None

    def _api(self) -> Any:
        from kubernetes import client, config

        if self.api_url:
            cfg = client.Configuration()
            cfg.host = self.api_url
            return client.CoreV1Api(client.ApiClient(cfg))
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.CoreV1Api()

    def _endpoint(self, pod: dict[str, Any]) -> tuple[str, str | None, str | None, str | None,
                                                      tuple[str, int] | None] | None:
        """(url, kv events, kv replay, kv prefix, kv layout) of a routable pod."""
        port = pod_port(pod, self.port)
        if port is None:
            return None
        ip = _get(pod, "status", "podIP")
        host = f"[{ip}]" if ":" in ip else ip
        kv = rp = None
        if self.kv_events_port is not None and (p := pod_port(pod, self.kv_events_port)):
            kv = f"tcp://{host}:{p}"
        if self.kv_replay_port is not None and (p := pod_port(pod, self.kv_replay_port)):
            rp = f"tcp://{host}:{p}"
        ann = _get(pod, "metadata", "annotations") or {}
        prefix = ann.get(KV_PREFIX_ANNOTATION) or None
        return f"{self.scheme}://{host}:{port}", kv, rp, prefix, contract.pod_layout(ann)

    def _apply(self, name: str, pod: dict[str, Any] | None) -> None:
        """On the event loop: pod `name` is now `pod` (None = gone)."""
        want = None
        if pod is not None and matches(_get(pod, "metadata", "labels") or {}, self._sel) and pod_ready(pod):
            want = self._endpoint(pod)
        have = self._pods.get(name)
        if want is not None and have == want[0]:
            if self._prefixes.get(name) != want[3:]:  # re-annotated in place: same replica, new L2 directory
                self._prefixes[name] = want[3:]
                self._replicas.add(want[0], kv_prefix=want[3], kv_layout=want[4])
            return
        if have is not None:
            del self._pods[name]
            self._prefixes.pop(name, None)
            if have not in self._pods.values():
                self._replicas.remove(have)
        if want is not None:
            self._pods[name] = want[0]
            self._prefixes[name] = want[3:]
            self._replicas.add(want[0], kv_endpoint=want[1], kv_replay_endpoint=want[2], kv_prefix=want[3],
                               kv_layout=want[4])

    def _resync(self, pods: dict[str, dict[str, Any]]) -> None:
        for name in list(self._pods):
            if name not in pods:
                self._apply(name, None)
        for name, pod in pods.items():
            self._apply(name, pod)

    def _run(self) -> None:
        from kubernetes import watch

        loop = self._loop
        assert loop is not None, "start() sets the loop before the thread runs"
        api = None
        while not self._stop.is_set():
            try:
                api = api or self._api()
                lst = api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                pods = {p.metadata.name: api.api_client.sanitize_for_serialization(p) for p in lst.items}
                loop.call_soon_threadsafe(self._resync, pods)
                rv = lst.metadata.resource_version
                kwargs: dict[str, Any] = {"label_selector": self.selector, "timeout_seconds": self.resync}
                if rv and str(rv).isdigit():
                    kwargs["resource_version"] = rv
                self._watch = watch.Watch()
                for ev in self._watch.stream(api.list_namespaced_pod, self.namespace, **kwargs):
                    if self._stop.is_set():
                        break
                    obj = api.api_client.sanitize_for_serialization(ev["object"])
                    name = _get(obj, "metadata", "name")
                    if not name:
                        continue
                    gone = ev["type"] == "DELETED"
                    loop.call_soon_threadsafe(self._apply, name, None if gone else obj)
            except Exception as e:  # noqa: BLE001 - API down or watch expired (410): back off, then list again
                if self._stop.is_set():
                    break
                log.warning("kubernetes discovery: %s; retrying", e)
                self._stop.wait(1.0)

    async def start(self, replicas: Any) -> None:
        self._replicas = replicas
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._thread.start()
        log.info("kubernetes discovery: namespace=%s selector=%r", self.namespace, self.selector)

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
