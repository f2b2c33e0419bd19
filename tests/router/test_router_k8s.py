"""Kubernetes discovery against kmock's API emulator (driven through the official client) and real replicas."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from router_helpers import PY, Proc, _spawn, complete, wait_until

kmock = pytest.importorskip("kmock")
from kubernetes import client  # noqa: E402

pytestmark = pytest.mark.k8s


@pytest.fixture
def k8s() -> Iterator[tuple[str, client.CoreV1Api]]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        emu = kmock.KubernetesEmulator()
        emu.resources["v1/pods"] = {}
        async with emu, kmock.Server(emu) as srv:
            state.update(url=str(srv.url).rstrip("/"), stop=asyncio.Event())
            started.set()
            await state["stop"].wait()

    t = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    t.start()
    assert started.wait(10)
    cfg = client.Configuration()
    cfg.host = state["url"]
    yield state["url"], client.CoreV1Api(client.ApiClient(cfg))
    loop.call_soon_threadsafe(state["stop"].set)
    t.join(10)
    if not t.is_alive():
        loop.close()


def pod(name: str, port: int, *, ready: bool, labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "serving", "labels": labels or {"app": "vllm", "tier": "kv"},
                     "annotations": annotations or {}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _port(p: Proc) -> int:
    return int(p.url.rsplit(":", 1)[1])


def test_pods_by_label_selector_with_readiness(k8s, cluster):
    url, api = k8s
    a, b, c = (cluster.replica(kv=False) for _ in range(3))
    api.create_namespaced_pod("serving", pod("a", _port(a), ready=True))
    api.create_namespaced_pod("serving", pod("b", _port(b), ready=False))
    api.create_namespaced_pod("serving", pod("c", _port(c), ready=True, labels={"app": "other"}))
    cluster.n += 1
    log = cluster.tmp / "router-k8s.log"
    p, rurl = _spawn([PY, "-m", "router.cli", "--port", "0", "--k8s-selector", "app=vllm,tier=kv",
                      "--k8s-namespace", "serving", "--k8s-port", "http", "--k8s-api", url,
                      "--strategy", "roundrobin", "--health-interval", "0.5"], log, r"listening on (http://\S+)")
    rt = Proc(p, rurl, log)
    cluster.procs.append(rt)

    def members() -> set[str]:
        return {x["url"] for x in rt.get("/health").json()["replicas"]}

    wait_until(lambda: members() == {a.url}, timeout=40)  # importing the kubernetes client is slow
    for i in range(4):
        assert complete(rt, f"x{i}").headers["x-kvtier-replica"] == a.url
    # b becomes Ready -> joins; c never matches the selector
    api.patch_namespaced_pod("b", "serving", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    wait_until(lambda: members() == {a.url, b.url}, timeout=20)
    got = Counter(complete(rt, f"y{i}").headers["x-kvtier-replica"] for i in range(6))
    assert set(got) == {a.url, b.url}
    # a is deleted -> leaves at once; no request goes there afterwards
    api.delete_namespaced_pod("a", "serving")
    wait_until(lambda: members() == {b.url}, timeout=20)
    assert {complete(rt, f"z{i}").headers["x-kvtier-replica"] for i in range(4)} == {b.url}
    assert c.get("/admin/stats").json()["requests"] == 0


def _k8s_router(cluster, url: str, *args: str) -> Proc:
    cluster.n += 1
    log = cluster.tmp / f"router-k8s{cluster.n}.log"
    p, rurl = _spawn([PY, "-m", "router.cli", "--port", "0", "--k8s-selector", "app=vllm,tier=kv",
                      "--k8s-namespace", "serving", "--k8s-port", "http", "--k8s-api", url,
                      "--health-interval", "0.5", *args], log, r"listening on (http://\S+)", timeout=120)
    rt = Proc(p, rurl, log)
    cluster.procs.append(rt)
    return rt


def test_l2_hit_is_credited_only_to_the_revision_whose_prefix_holds_it(k8s, cluster, make_cluster):
    """Two endpoint revisions announce different kv-prefix annotations; chunks exist under one of them."""
    from operator_patch.patch import KV_PREFIX_KEY
    from router.discovery import KV_PREFIX_ANNOTATION
    from router.l2 import L2Lookup

    assert KV_PREFIX_ANNOTATION == KV_PREFIX_KEY  # the router reads what the operator patch writes
    from l2fs.client import Client

    url, api = k8s
    old, new = cluster.replica(kv=False), cluster.replica(kv=False)
    pre = {old.url: "/kvtier/kv/chat/rev-1", new.url: "/kvtier/kv/chat/rev-2"}
    api.create_namespaced_pod("serving", pod("old", _port(old), ready=True,
                                             annotations={KV_PREFIX_KEY: pre[old.url]}))
    api.create_namespaced_pod("serving", pod("new", _port(new), ready=True,
                                             annotations={KV_PREFIX_KEY: pre[new.url]}))
    prompts = ["".join(chr(65 + (i * k) % 26) for i in range(600)) for k in (3, 5, 7, 11)]
    l2 = make_cluster(1)
    with Client(l2.master) as c:
        names = L2Lookup(l2.master, model_name="tiny-model")  # the router's own naming, in this process
        home = {prompts[0]: new.url, prompts[1]: old.url, prompts[2]: new.url}  # prompts[3]: nowhere
        for prompt, where in home.items():
            for path in names.paths(list(prompt.encode()), "tiny-model", pre[where]):  # 2 full chunks of 256
                c.put(path, b"kv-bytes")
        for path in names.paths(list(prompts[3].encode()), "tiny-model"):  # --l2fs-prefix, which no pod uses
            c.put(path, b"kv-bytes")
        rt = _k8s_router(cluster, url, "--strategy", "kvaware", "--tokenizer", "bytes", "--l2fs-master",
                         l2.master, "--l2fs-model-name", "tiny-model", "--l2fs-timeout", "5",
                         "--l2fs-lookup", "always")
        wait_until(lambda: {x["url"] for x in rt.get("/health").json()["replicas"]} == {old.url, new.url}, timeout=60)
        for prompt, where in home.items():
            r = complete(rt, prompt)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvtier-replica"] == where  # the revision that can load the chunks
            assert r.headers.get("x-kvtier-l2-tokens") == str(2 * 256)
        r = complete(rt, prompts[3])  # under the default prefix only: no replica can load it
        assert r.status_code == 200 and "x-kvtier-l2-tokens" not in r.headers
