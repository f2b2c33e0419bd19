"""Plugin mode as deployed, on the one-box cluster (kubelet_sim.OneBox): deploy/overlays/hyperpod-p5 installed by
docs/deploy.md's install block, the operator's Deployment for the P5 example endpoint patched by the running
webhook, and its two vLLM CPU pods (one per node) taking L2 through connector.lmcache_l2fs as LMCache's own env
loader builds it from the webhook's env (no config file), with their node's worker socket dir and no data dir in
the pod; then docs/bench-cluster.md's steps 3 and 5 as written (the bench Job's own
command, in a node) get cross-pod hits of every full chunk with identical outputs, and the router routes.

A node's worker killed and kept down: the engines keep answering (misses), and hit again once it is back.
Mount mode is test_operator_onebox.py, on a box of its own; a suite run takes one of the three one-box modes
(test_operator_onebox.onebox_modes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_operator_onebox as onebox
from kubelet_sim import ROOT, OneBox, Pod
from test_operator_onebox import docs_block, install_box, miss_while_down_then_hit, onebox_mode

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.vllm,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv"),
                       reason="needs root, nsenter, setpriv (network and mount namespaces)"),
    onebox_mode("plugin"),
]
OVERLAY = "hyperpod-p5"
NS = "team-a"
tiny = onebox.tiny  # the model fixture, shared


@pytest.fixture(scope="module")
def p5(tiny: Path) -> Iterator[OneBox]:
    """docs/deploy.md's install block for hyperpod-p5, on two P5 nodes (test_operator_onebox.install_box)."""
    yield from install_box(OVERLAY, tiny)


def engine_pods(box: OneBox) -> list[Pod]:
    box.wait_ready(box.endpoint, timeout=300)
    return box.pods_of(box.endpoint, NS)


def worker_metric(box: OneBox, name: str = "l2fs_worker_bytes_written_total") -> dict[str, float]:
    """Per node: a counter of its worker's /metrics, all label sets summed (default: bytes it sealed)."""
    out = {}
    for w in box.pods_of("l2fs-worker", "kvtier"):
        status, body = box.http(w, 9091, path="/metrics", timeout=10)
        assert status == 200, body[:200]
        out[w.node.name] = sum(float(ln.rsplit(" ", 1)[1]) for ln in body.decode().splitlines()
                               if ln.startswith((f"{name} ", f"{name}{{")))
    return out


def test_install_steps_run_in_order(p5: OneBox) -> None:
    """The install block (p5 paths) passes as a whole, `kvtier operator-patch verify` of plugin mode included."""
    out = p5.installed
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{p5.describe()}"


def test_engine_pods_take_l2_through_the_webhooks_env_and_the_socket_only(p5: OneBox) -> None:
    """Each vLLM pod (one per node) got the plugin env from the webhook and no LMCache config file; LMCache's
    env loader made the l2fs RemoteBackend and our connector (master by its Service name, the pod's node id);
    the pod sees its node's worker socket dir read-only and nothing of the worker's data dir."""
    pods = engine_pods(p5)
    assert len(pods) == 2 and len({p.node.name for p in pods}) == 2, p5.describe(p5.endpoint)
    worker_cm = p5.configmap_data("kvtier", next(d["metadata"]["name"] for d in p5.api.all_of("v1/configmaps")
                                                 if d["metadata"]["name"].startswith("kvtier-config")))
    assert worker_cm is not None and worker_cm["KVTIER_MODE"] == "plugin"
    data_dir, sock_dir = worker_cm["L2FS_DATA_DIR"], worker_cm["L2FS_SOCKET_DIR"]
    for pod in pods:
        (c,) = [c for c in pod.containers if not c.init]
        env = p5.env(pod, c.spec)
        assert env["LMCACHE_REMOTE_STORAGE_PLUGINS"] == "l2fs" and "LMCACHE_CONFIG_FILE" not in env, env
        log = p5.logs(pod, c.spec["name"])
        assert "Creating RemoteBackend for plugin: l2fs" in log, log[-3000:]
        m = re.search(r"kvtier l2fs connector: master=(\S+) node=(\S+) prefix=(\S+)", log)
        assert m and m.group(1) == worker_cm["KVTIER_MASTER"] and m.group(2) == pod.node.name, log[-3000:]
        assert c.proc is not None and c.proc.poll() is None
        mounts = [ln.split() for ln in Path(f"/proc/{c.proc.pid}/mountinfo").read_text().splitlines()]
        sock = [f for f in mounts if f[4] == sock_dir]
        # the node's socket dir (mountinfo's root field: the bind's source inside its file system), read-only
        assert sock and "ro" in sock[-1][5].split(",") and sock[-1][3].endswith("/host" + sock_dir), sock
        assert not [f for f in mounts if f[4] == data_dir or data_dir in f[3]], "data dir mounted in the pod"
        (worker,) = [w for w in p5.pods_of("l2fs-worker", "kvtier") if w.node is pod.node]
        (wc,) = [w for w in worker.containers if not w.init]
        assert wc.proc is not None
        blocks = list(Path(f"/proc/{wc.proc.pid}/root{data_dir}").rglob("*"))
        assert blocks, "the worker holds files in its data dir"
        seen = Path(f"/proc/{c.proc.pid}/root{data_dir}")
        assert not seen.exists() or not any(seen.iterdir()), f"the pod sees {list(seen.iterdir())[:3]}"


def test_bench_job_gets_cross_pod_hits_of_every_full_chunk(p5: OneBox) -> None:
    """docs/bench-cluster.md steps 3 (two pods on two nodes, patched) and 5 (the Job) as written, the endpoint's
    names and lengths the CPU overlay serves filled in as its text says: B's hit is every full chunk of A's
    prompt, the cold request hit nothing, outputs are identical; A's chunks were sealed by a worker (over the
    data plane: same-node writes no longer take the socket's memfds, which were slower at every size; the
    socket's read fds in a pod without the data dir: test_operator_deploy_run.py)."""
    engine_pods(p5)
    before = worker_metric(p5)
    steps = docs_block("bench-cluster.md", "**3. Two pods on two nodes, patched.**") + \
        docs_block("bench-cluster.md", "**5. The Job.**")
    steps = steps.replace("qwen2-7b", p5.endpoint)  # no <placeholders> (a heredoc's <<EOF is none)
    # "Other settings go into the same literals: list", as its text spells them: lengths the CPU overlay's
    # --max-model-len serves, one rep
    spelled = re.search(r'`("LENGTHS=[^`]*")`', (ROOT / "docs" / "bench-cluster.md").read_text())
    assert spelled, "bench-cluster.md no longer says how to set LENGTHS"
    lengths = spelled.group(1).replace("1024,2048", "768,1024")
    steps = steps.replace("REPLICA_B=http://$B_IP:8080]", f"REPLICA_B=http://$B_IP:8080, {lengths}, REPS=1]")
    assert "LENGTHS=768" in steps, steps
    out = p5.shell(steps, cwd=p5.work, timeout=600)
    assert out.returncode == 0, f"{out.stdout[-4000:]}\n{out.stderr[-3000:]}\n{p5.describe('kvtier-bench-cross-pod')}"
    assert "two nodes: ok" in out.stdout, out.stdout[-2000:]
    text = (p5.work / "cross_pod.json").read_text()
    try:
        result = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"{e}: {text[max(0, e.pos - 300):e.pos + 300]!r}") from None  # type: ignore[attr-defined]
    rows = result["summary"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [768, 1024], rows
    for r in rows:
        assert r["b_hit_pct_full_chunks"] == 100.0, (r, out.stdout[-3000:])
        assert r["same_output_all"] and not r["cold_hit_tokens_max"], r
    after = worker_metric(p5)
    assert sum(after.values()) > sum(before.values()), (before, after)


def test_router_routes_to_the_engine_pods(p5: OneBox) -> None:
    """Through a router pod with the API key (docs/deploy.md step 1's Secret): a prompt goes to one of the two
    vLLM pods, the same prompt extended goes to the same pod for its cached prefix (route cache_hit)."""
    pods = engine_pods(p5)
    key = (p5.secret_data(NS, "kvtier-router-api-key") or {})["api-key"].decode()
    (router, *_) = p5.pods_of("kvtier-router", NS)
    prompt = " ".join(f"word{i}" for i in range(300))
    seen = []
    for text in (prompt, prompt + " and more"):
        body = json.dumps({"model": "/opt/ml/model", "prompt": text, "max_tokens": 4, "temperature": 0}).encode()
        headers: dict[str, str] = {}
        status, got = p5.http(router, 8080, "POST", "/v1/completions", body,
                              {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                              timeout=120, got_headers=headers)
        assert status == 200, got[:500]
        assert json.loads(got)["choices"][0]["text"] is not None
        seen.append((headers.get("x-kvtier-replica", ""), headers.get("x-kvtier-route", "")))
    urls = {f"http://{p.ip}:8080" for p in pods}
    assert seen[0][0] in urls and seen[1] == (seen[0][0], "cache_hit"), (seen, urls)


def test_killed_workers_give_misses_then_hits_once_they_are_back(p5: OneBox) -> None:
    """SIGKILL the l2fs worker of every node (where a prompt's chunks are is the master's choice: local-first
    placement falls back to the roomiest worker) and keep them down (a back-off): both engines keep answering,
    node-2's pod answers the prompt node-1's pod stored with the same greedy output and no L2 hit (a miss, no
    error, no hang); once the kubelet has started the workers again (they register anew with their projected
    ServiceAccount tokens, their data dirs are the nodes'), a prompt node-1's pod stores is a hit on node-2's
    pod again, and no engine was restarted."""
    a, b = sorted(engine_pods(p5), key=lambda p: p.node.name)

    workers = [(w, next(c.spec["name"] for c in w.containers if not c.init))
               for w in p5.pods_of("l2fs-worker", "kvtier")]
    assert len(workers) == 2, p5.describe("l2fs-worker")
    miss_while_down_then_hit(p5, workers, a, b, seed=31)
