"""Webhook mp mode (LMCache multiprocess): what the patched pod runs, read by its consumers' own loaders.

* the vLLM container's argv (kubelet-expanded) by vLLM's own api_server parser, and its kv_transfer_config
  resolved by vLLM's KVConnectorFactory to LMCache's MP connector class;
* the `lmcache server` sidecar's argv by LMCache's own `lmcache server` parser and config builders
  (MPServerConfig, the storage manager's L2 adapter list), its adapter JSON by LMCache's L2 adapter factory
  config parser, and the adapter params by kvtier's adapter config (master, node, the endpoint's prefix);
* the pod against Pod Security "baseline": no host namespaces, no privileged or added capabilities, no
  hostPath, no host ports (what mp mode adds; the operator's own pod adds none of these either).
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from kubelet_env import container_argv, container_env
from operator_helpers import load_yaml

from operator_patch.patch import (
    MP_CONNECTOR_MODULE,
    MP_SIDECAR,
    PatchConfig,
    check,
    mutate,
    select_container,
)

pytest.importorskip("lmcache")
pytest.importorskip("vllm")

NODE = "ip-10-0-1-7.ec2.internal"
FIELDS = {"spec.nodeName": NODE, "status.hostIP": "10.0.1.7", "status.podIP": "10.0.9.9"}


def _patched(**over: Any) -> tuple[dict[str, Any], PatchConfig]:
    cfg = PatchConfig(mode="mp", **over)
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    return mutate(dep, cfg), cfg


def _secrets(dep: dict[str, Any]) -> dict[str, dict[str, str]]:
    ann = dep["spec"]["template"]["metadata"].get("annotations") or {}
    name = ann.get("kvtier.io/l2fs-token-secret")
    return {name: {"token": "engine-token"}} if name else {}


def test_vllm_reads_lmcache_mp_connector_config() -> None:
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    dep, cfg = _patched()
    c = dep["spec"]["template"]["spec"]["containers"][select_container(dep)]
    env = container_env(c, secrets=_secrets(dep), fields=FIELDS)
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(container_argv(c, env))
    kt = ns.kv_transfer_config
    assert (kt.kv_connector, kt.kv_connector_module_path, kt.kv_role) == ("LMCacheMPConnector", MP_CONNECTOR_MODULE,
                                                                          "kv_both")
    assert kt.kv_load_failure_policy == "recompute"
    extra = kt.kv_connector_extra_config
    assert (extra["lmcache.mp.host"], extra["lmcache.mp.port"]) == ("tcp://127.0.0.1", cfg.mp_port)
    assert extra["lmcache.mp.mp_transfer_mode"] == "engine_driven"
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    assert KVConnectorFactory.get_connector_class(kt) is LMCacheMPConnector  # vLLM's own loader
    assert not {"LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_STORAGE_PLUGINS", "L2FS_TOKEN"} & set(env)
    assert check(dep, cfg) == []


def test_lmcache_server_reads_the_sidecar_and_loads_our_adapter_config() -> None:
    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    from lmcache.v1.multiprocess.config import (
        parse_args_to_http_frontend_config,
        parse_args_to_mp_server_config,
    )

    from connector.mp_l2fs import L2fsL2AdapterConfig

    dep, cfg = _patched()
    spec = dep["spec"]["template"]["spec"]
    (side,) = [x for x in spec["initContainers"] if x["name"] == MP_SIDECAR]
    assert side["restartPolicy"] == "Always" and side["command"] == ["lmcache", "server"]
    assert side["image"] == spec["containers"][0]["image"]
    env = container_env(side, secrets=_secrets(dep), fields=FIELDS)
    assert env["L2FS_NODE_ID"] == NODE and env["L2FS_TOKEN"] == "engine-token" and env["PYTHONHASHSEED"] == "0"
    parser = argparse.ArgumentParser()
    ServerCommand().add_arguments(parser)
    ns = parser.parse_args(container_argv(side, env)[2:])  # after `lmcache server`
    mp = parse_args_to_mp_server_config(ns)
    assert (mp.host, mp.port, mp.chunk_size) == ("127.0.0.1", cfg.mp_port, 256)
    # its HTTP admin API: loopback, and not on a port of the pod's vLLM container (LMCache's default, 8080, is
    # the port HyperPod's vLLM serves on: the engine could not bind it)
    http = parse_args_to_http_frontend_config(ns)
    assert (http.http_host, http.http_port) == ("127.0.0.1", cfg.mp_http_port)
    taken = {int(p["containerPort"]) for x in spec["containers"] for p in x.get("ports") or []}
    taken.add(8000)  # vLLM's own default port
    assert taken and not {mp.port, http.http_port} & taken, taken
    storage = parse_args_to_config(ns)
    assert storage is not None
    (ad,) = parse_args_to_l2_adapters_config(ns).adapters
    assert (ad.module_path, ad.class_name) == ("connector.mp_l2fs", "L2fsL2Adapter")
    params = L2fsL2AdapterConfig.from_dict(ad.adapter_params)
    pod_ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert (params.master, params.node_id, params.prefix) == (cfg.master, NODE, pod_ann["kvtier.io/kv-prefix"])
    # both containers share one memory-backed /dev/shm (the operator's dev-shm volume here)
    shm = {m["name"] for x in (side, spec["containers"][0]) for m in x["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert len(shm) == 1 and [v for v in spec["volumes"] if v["name"] in shm]


def test_mp_pod_fits_pod_security_baseline() -> None:
    dep, _ = _patched()
    spec = dep["spec"]["template"]["spec"]
    assert not any(spec.get(k) for k in ("hostIPC", "hostNetwork", "hostPID"))
    assert not [v for v in spec.get("volumes") or [] if "hostPath" in v]
    baseline_caps = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                     "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
    for x in spec["containers"] + spec.get("initContainers", []):
        sc = x.get("securityContext") or {}
        assert not sc.get("privileged") and set((sc.get("capabilities") or {}).get("add") or []) <= baseline_caps
        assert not [p for p in x.get("ports") or [] if p.get("hostPort")]


def test_mp_mode_is_idempotent() -> None:
    dep, cfg = _patched()
    again = mutate(dep, cfg)
    assert again["spec"]["template"]["spec"] == dep["spec"]["template"]["spec"]
    assert [x["name"] for x in again["spec"]["template"]["spec"]["initContainers"]].count(MP_SIDECAR) == 1


def test_sidecar_startup_probe_reaches_the_loopback_server() -> None:
    """The server listens on 127.0.0.1 only, which a kubelet tcpSocket/httpGet probe (sent to the pod IP) never
    reaches; the startup probe is an exec in the container: its command succeeds once something accepts on the
    loopback port and fails before."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        dep, _ = _patched(mp_port=port)
        (side,) = [x for x in dep["spec"]["template"]["spec"]["initContainers"] if x["name"] == MP_SIDECAR]
        probe = side["startupProbe"]
        assert set(probe) >= {"exec", "periodSeconds", "failureThreshold"} and probe["timeoutSeconds"] >= 3
        argv = probe["exec"]["command"]
        assert argv[0] == "python3"  # in the vLLM image (as the mount-mode wait init container)
        run = [sys.executable, *argv[1:]]
        assert subprocess.run(run, capture_output=True, timeout=30).returncode != 0  # bound, not listening
        s.listen(1)
        assert subprocess.run(run, capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize("over", [{"mp_http_port": 6555}, {"mp_port": 5557}, {"mp_http_port": 0}])
def test_mp_ports_must_be_distinct(over: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="mp_"):
        PatchConfig(mode="mp", **over)


def test_the_mp_overlay_runs_the_webhook_in_mp_mode_and_its_router_without_l2_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/overlays/hyperpod-p5-mp: the webhook's settings (its rendered kvtier-config read by its own flag
    parser) are hyperpod-p5's but for mp mode; the example endpoint's router (its argv kubelet-expanded, read by
    `kvtier router`'s parser) runs --l2fs-mode mp, so it has no L2 lookup (the sidecars' keys are LMCache's
    blake3 ObjectKeys) though it still names the master."""
    from operator_helpers import configmap, render

    from operator_patch.options import add_config_args, config_from_args
    from router.cli import build_parser, l2_lookup_from_args

    def webhook_config(overlay: str) -> PatchConfig:
        with monkeypatch.context() as m:
            for k, v in configmap(render(overlay), "kvtier-config")["data"].items():
                if k.startswith("KVTIER_"):
                    m.setenv(k, v)
            parser = argparse.ArgumentParser()
            add_config_args(parser)
            return config_from_args(parser.parse_args([]))

    mp, p5 = webhook_config("overlays/hyperpod-p5-mp"), webhook_config("overlays/hyperpod-p5")
    assert mp.mode == "mp" and p5.mode == "plugin"
    assert {k: v for k, v in vars(mp).items() if k != "mode"} == {k: v for k, v in vars(p5).items() if k != "mode"}
    docs = render("overlays/hyperpod-p5-mp")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "InferenceEndpointConfig"] == ["llama3-70b"]
    (router,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvtier-router"]
    c = router["spec"]["template"]["spec"]["containers"][0]
    cms = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = container_env(c, configmaps=cms, secrets={"kvtier-router-api-key": {"api-key": "k"},
                                                    "kvtier-router-l2fs-token": {"token": "t"}},
                        fields={**FIELDS, "metadata.namespace": "team-a"})
    argv = container_argv(c, env)
    assert argv[:2] == ["kvtier", "router"], argv
    ns = build_parser().parse_args(argv[2:])
    assert ns.l2fs_mode == "mp" and ns.l2fs_master == mp.master
    assert l2_lookup_from_args(ns) is None
