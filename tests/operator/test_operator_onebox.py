"""deploy/ as deployed, on the one-box cluster (kubelet_sim.OneBox): the install steps of docs/deploy.md, the
rendered overlay applied to the API emulator, the webhook admitting the operator's Deployment over TLS, and
every pod (l2fs master, workers and FUSE mounts on each node, the webhook, the router) running in its own
network namespace with the kubelet's env, volumes, users, probes and restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_sim import ROOT, OneBox, _mount_count, _mounts_under, box_root, render

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.vllm,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv"),
                       reason="needs root, nsenter, setpriv (network and mount namespaces)"),
    # In the default suite (CI runs it); KVTIER_ONEBOX_TESTS=0 leaves it out of a local run. Its mounts live in
    # the box's own namespaces and its processes in its cgroup (kubelet_sim.OneBox.close), its mount guard
    # turns a propagation loop into a failure within seconds, and every wait has a timeout.
    pytest.mark.skipif(os.environ.get("KVTIER_ONEBOX_TESTS") == "0", reason="KVTIER_ONEBOX_TESTS=0"),
]
CORE = ("l2fs-master", "l2fs-worker", "l2fs-mount", "kvtier-webhook")
# Which overlay runs: mount mode (hyperpod-g6e: LMCache's fs:// on each node's FUSE mount) or plugin mode
# (hyperpod-p5: connector.lmcache_l2fs over gRPC and the worker's socket). One per run, to keep the suite's
# time: mount by default (its pods use more of the kubelet: mount propagation between pods, the FUSE daemon's
# restart on a node path), KVTIER_ONEBOX_MODE=plugin for the other; both are run before a change to deploy/ lands.
MODE = os.environ.get("KVTIER_ONEBOX_MODE", "mount")
OVERLAY = {"mount": "hyperpod-g6e", "plugin": "hyperpod-p5"}[MODE]


def namespace(name: str) -> dict[str, Any]:
    """`kubectl create namespace NAME`."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


@pytest.fixture(scope="module")
def tiny() -> Iterator[Path]:
    """The model (and tokenizer) the IEC's modelLocation and the router's S3 URI stand for."""
    from kvtier.devstack.tiny_model import build

    for root in box_root("kvtier-onebox-model-"):
        yield build(root / "model")


def docs_block(doc: str, heading: str) -> str:
    """The first fenced command block after `heading` in docs/<doc>, as written."""
    text = (ROOT / "docs" / doc).read_text().split(heading, 1)[1]
    return text.split("```", 2)[1].split("\n", 1)[1]


def filled(block: str) -> str:
    """A docs block with its <placeholders> filled in, as a reader does (<cluster> -> cluster, ...)."""
    import re

    return re.sub(r"<([^<>]+)>", lambda m: re.sub(r"\W+", "-", m.group(1)).strip("-"), block)


@pytest.fixture(scope="module")
def g6e(tiny: Path) -> Iterator[OneBox]:
    """The box of this run's OVERLAY, installed (install_box)."""
    yield from install_box(OVERLAY, tiny)


def install_box(overlay: str, tiny: Path) -> Iterator[OneBox]:
    """docs/deploy.md "Install, step by step", run as written by bash in a directory holding deploy/, on a two-node
    box of the overlay's instance type: kubectl is the box's (kubelet_sim.OneBox.kubectl), kvtier the venv's;
    `aws` (step 2, S3 access for the router's ServiceAccount) is the box's s3 table, `pip install .` (step 0) the
    venv. The monitoring namespace exists, as kube-prometheus-stack (a prerequisite of step 5) makes it. Also
    used by test_operator_onebox_plugin.py."""
    (iec,) = [d for d in render(f"overlays/{overlay}/endpoint") if d["kind"] == "InferenceEndpointConfig"]
    src, name = iec["spec"]["modelSourceConfig"], iec["metadata"]["name"]
    nodes = {f"node-{i}": {"node.kubernetes.io/instance-type": iec["spec"]["instanceType"]} for i in (1, 2)}
    uri = f"s3://{src['s3Storage']['bucketName']}/{src['modelLocation']}/"
    before = _mount_count()
    for root in box_root():
        work = root / "work"
        work.mkdir()
        (work / "deploy").symlink_to(ROOT / "deploy")
        with OneBox(root, nodes, s3={uri: tiny}, models={src["modelLocation"]: tiny}) as box:
            box.apply([namespace("monitoring")])
            box.endpoint = name
            # hyperpod-p5: "install it like hyperpod-g6e, with p5 in the paths" (and its endpoint's name)
            steps = filled(docs_block("deploy.md", "## Install, step by step"))
            if overlay != "hyperpod-g6e":
                steps = steps.replace("hyperpod-g6e", overlay).replace("qwen2-7b", name)
            box.installed = box.shell(steps, cwd=work, timeout=420)
            tokens = work / "tokens.json"
            box.tokens = {e["name"]: e["token"] for e in json.loads(tokens.read_text())} if tokens.exists() else {}
            box.work = work
            yield box
        # the box's mounts lived in its node and container namespaces: none is left on this machine (a few
        # lines of slack: other tests on the machine mount too)
        assert not _mounts_under(root), _mounts_under(root)[:5]
        assert _mount_count() <= before + 4, (before, _mount_count())


def test_install_steps_of_the_docs_run_in_order(g6e: OneBox) -> None:
    """Every command of docs/deploy.md's install block succeeds against the box, in its order: rollout status
    of l2fs and the webhook, the caBundle wait, the endpoint, the router's rollout (it is ready only once it
    routes to a ready vLLM pod), `kvtier operator-patch verify` (FAIL if the endpoint was admitted unpatched)."""
    out = g6e.installed
    log = (g6e.root / "kubectl.log").read_text() if (g6e.root / "kubectl.log").exists() else ""
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{log[-3000:]}\n{g6e.describe()}"


def test_core_pods_come_up_from_the_rendered_overlay(g6e: OneBox) -> None:
    """The master, a worker and a FUSE mount on every node and the webhook become ready from the rendered
    manifests alone; the workers registered with their projected ServiceAccount tokens."""
    g6e.wait_ready(*CORE, timeout=240)
    assert {p.node.name for p in g6e.pods_of("l2fs-worker")} == {n.name for n in g6e.nodes}
    assert {p.node.name for p in g6e.pods_of("l2fs-mount")} == {n.name for n in g6e.nodes}
    (master,) = g6e.pods_of("l2fs-master")
    report = g6e.run_in_node(master.node, [str(Path(sys.executable).with_name("l2fs")), "report", "--json",
                                           "--master", f"{master.ip}:8995"],
                             env={**os.environ, "L2FS_TOKEN": g6e.tokens["admin"]}, timeout=60)
    assert report.returncode == 0, report.stderr
    assert all(n.name in report.stdout for n in g6e.nodes), report.stdout
    # each node's FUSE mount reached its node path through mountPropagation: Bidirectional (what the vLLM pods'
    # HostToContainer mounts of that path see)
    cm = g6e.configmap_data("kvtier", next(d["metadata"]["name"] for d in g6e.api.all_of("v1/configmaps")
                                           if d["metadata"]["name"].startswith("kvtier-config")))
    assert cm is not None
    for node in g6e.nodes:
        assert g6e.node_mounted(node, cm["L2FS_MOUNT_PATH"]), node.name  # the mount, or per-endpoint ones under it
    # what the API serves of those pods (the router reads it): Ready, with the pod's address
    for p in g6e.pods_of("l2fs-worker"):
        got = g6e.get("Pod", "kvtier", p.name)
        assert got is not None and got["status"]["podIP"] == p.ip, got
        assert {c["type"]: c["status"] for c in got["status"]["conditions"]}["Ready"] == "True", got["status"]
    worker_tokens = [t for t, (user, _, _) in g6e.api.table.items() if user.endswith(":l2fs-worker")]
    assert worker_tokens and all(t in g6e.api.seen for t in worker_tokens)


def test_the_operators_deployment_is_patched_by_the_running_webhook(g6e: OneBox) -> None:
    """The operator stand-in's Deployment went through the API server's admission call to the webhook pod
    (TLS with the injected caBundle, the Service's name): it carries the endpoint label and the L2 config."""
    deadline = time.monotonic() + 60
    while (dep := g6e.get("Deployment", "team-a", g6e.endpoint, "apps/v1")) is None:
        assert time.monotonic() < deadline, g6e.describe()
        time.sleep(0.5)
    assert dep["spec"]["template"]["metadata"]["labels"].get("kvtier.io/endpoint") == g6e.endpoint, g6e.api.admitted
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    if MODE == "mount":
        assert env.get("LMCACHE_REMOTE_URL", "").startswith("fs://"), env
    else:
        assert env.get("LMCACHE_REMOTE_STORAGE_PLUGINS") == "l2fs", env
    assert any(r.get("patch") for r in g6e.api.admitted)


# ---------------------------------------------------------------- as deployed: hits, routing, a node's fault

def _vllm_pods(box: OneBox) -> tuple[Any, Any]:
    """The endpoint's two vLLM pods, the one on node-1 first (the Deployment spreads them over the nodes)."""
    box.wait_ready(box.endpoint, timeout=300)
    pods = sorted(box.pods_of(box.endpoint, "team-a"), key=lambda p: p.node.name)
    assert len(pods) == 2 and pods[0].node is not pods[1].node, [(p.name, p.node.name) for p in pods]
    return pods[0], pods[1]


@pytest.mark.skipif(MODE != "mount", reason="mount mode's hits through the FUSE mounts (plugin: its own module)")
def test_the_bench_job_gets_cross_pod_hits_of_every_full_chunk(g6e: OneBox) -> None:
    """docs/bench-cluster.md steps 3 and 5 as written (the two pods' IPs from the API, the bench overlay next to
    deploy/, `kubectl apply -k`, wait for the Job, its logs): deploy/bench's own command in a Job pod on a node
    gets, for every length, B's hit = every full chunk (B never saw the prompt: only L2 has it), no cold hit,
    and outputs identical to the cold run. Lengths and reps go into the same `literals:` list (the doc says so):
    the CPU overlay's max-model-len is 2048."""
    _vllm_pods(g6e)
    steps = docs_block("bench-cluster.md", "**3. Two pods on two nodes, patched.**") + "\n" + docs_block(
        "bench-cluster.md", "**5. The Job.**")
    steps = steps.replace("literals: [REPLICA_A=http://$A_IP:8080, REPLICA_B=http://$B_IP:8080]",
                          "literals: [REPLICA_A=http://$A_IP:8080, REPLICA_B=http://$B_IP:8080, 'LENGTHS=512,1000',"
                          " REPS=1]")
    assert "LENGTHS=512,1000" in steps
    out = g6e.shell(steps, cwd=g6e.work, timeout=300)
    log = (g6e.root / "kubectl.log").read_text()[-3000:]
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{log}\n{g6e.describe('kvtier-bench-cross-pod')}"
    rows = json.loads((g6e.work / "cross_pod.json").read_text())["summary"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [512, 1000], rows
    for r in rows:
        assert r["b_hit_pct_full_chunks"] == 100.0, r
        assert r["b_hit_tokens_min"] >= r["full_chunk_tokens"] - 1 and r["cold_hit_tokens_max"] == 0, r
        assert r["same_output_all"], r
