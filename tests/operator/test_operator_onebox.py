"""deploy/ as deployed, on the one-box cluster (kubelet_sim.OneBox): the install steps of docs/deploy.md, the
rendered overlay applied to the API emulator, the webhook admitting the operator's Deployment over TLS, and
every pod (l2fs master, workers and FUSE mounts on each node, the webhook, the router) running in its own
network namespace with the kubelet's env, volumes, users, probes and restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubelet_sim import ROOT, OneBox, box_root, render

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv"),
                       reason="needs root, nsenter, setpriv (network and mount namespaces)"),
]
NODES = {"node-1": {"node.kubernetes.io/instance-type": "ml.g6e.4xlarge"},
         "node-2": {"node.kubernetes.io/instance-type": "ml.g6e.4xlarge"}}
CORE = ("l2fs-master", "l2fs-worker", "l2fs-mount", "kvtier-webhook")


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def namespace(name: str) -> dict[str, Any]:
    """`kubectl create namespace NAME`."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer (and model) the router's S3 URI and the IEC's modelLocation stand for."""
    from kvtier.devstack.tiny_model import build_tokenizer

    d = tmp_path_factory.mktemp("s3-model")
    build_tokenizer(d, 1000, 0)
    d.chmod(0o755)
    return d


@pytest.fixture(scope="module")
def g6e(tiny: Path) -> Iterator[OneBox]:
    """docs/deploy.md "Install, step by step" 1 and 3 on a two-node G6e box (step 2, S3 access for the
    router's ServiceAccount, is the box's s3 table)."""
    docs = render("overlays/hyperpod-g6e/l2fs")
    (iec,) = [d for d in render("overlays/hyperpod-g6e/endpoint") if d["kind"] == "InferenceEndpointConfig"]
    src = iec["spec"]["modelSourceConfig"]
    uri = f"s3://{src['s3Storage']['bucketName']}/{src['modelLocation']}/"
    for root in box_root():
        with OneBox(root, NODES, s3={uri: tiny}, models={src["modelLocation"]: tiny}) as box:
            box.apply([namespace("kvtier"), namespace("team-a")])
            made = kvtier("tokens", "generate", "--engine", "qwen2-7b@team-a", "--router", "team-a", "--admin",
                          "-o", str(root / "tokens.json"), "--secret-yaml", "-")
            assert made.returncode == 0, made.stderr
            box.apply([d for d in yaml.safe_load_all(made.stdout) if d])
            box.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kvtier-router-api-key",
                                                                             "namespace": "team-a"},
                        "stringData": {"api-key": os.urandom(24).hex()}}])
            box.apply(docs)
            box.tokens = {e["name"]: e["token"] for e in json.loads((root / "tokens.json").read_text())}
            yield box


def test_core_pods_come_up_from_the_rendered_overlay(g6e: OneBox) -> None:
    """The master, a worker and a FUSE mount on every node and the webhook become ready from the rendered
    manifests alone; the workers registered with their projected ServiceAccount tokens."""
    g6e.wait_ready(*CORE, timeout=240)
    assert {p.node.name for p in g6e.pods_of("l2fs-worker")} == set(NODES)
    assert {p.node.name for p in g6e.pods_of("l2fs-mount")} == set(NODES)
    (master,) = g6e.pods_of("l2fs-master")
    report = g6e.run_in_node(master.node, [str(Path(sys.executable).with_name("l2fs")), "report", "--json",
                                           "--master", f"{master.ip}:8995"],
                             env={**os.environ, "L2FS_TOKEN": g6e.tokens["admin"]}, timeout=60)
    assert report.returncode == 0, report.stderr
    assert all(n in report.stdout for n in NODES), report.stdout
    # each node's FUSE mount reached its node path through mountPropagation: Bidirectional (what the vLLM pods'
    # HostToContainer mounts of that path see)
    cm = g6e.configmap_data("kvtier", next(d["metadata"]["name"] for d in g6e.api.all_of("v1/configmaps")
                                           if d["metadata"]["name"].startswith("kvtier-config")))
    assert cm is not None
    for node in g6e.nodes:
        assert os.path.ismount(g6e.host_path(node, cm["L2FS_MOUNT_PATH"])), node.name
    worker_tokens = [t for t, (user, _, _) in g6e.api.table.items() if user.endswith(":l2fs-worker")]
    assert worker_tokens and all(t in g6e.api.seen for t in worker_tokens)
