"""MP mode as deployed, on the one-box cluster (kubelet_sim.OneBox): deploy/overlays/hyperpod-p5-mp installed by
docs/deploy.md's install block (hyperpod-p5 with the webhook in --mode mp and its router in --l2fs-mode mp), the
operator's Deployment for the P5 example endpoint patched by the running webhook, and each of its two vLLM CPU
pods (one per node) started behind its own `lmcache server` native sidecar (kvtier's l2fs L2 adapter, the
endpoint's engine token), vLLM on LMCache's own MP connector (engine_driven, loopback). Then docs/bench-cluster.md
steps 3 and 5 as written: pod B (its sidecar's L1 empty) gets every full chunk of A's prompt from L2 through its
sidecar, with identical greedy outputs; and the router routes by KV events without an L2 lookup.

On a box of its own (two engines; one hyperpod-p5 box with both endpoints would start four engines on two cores
at once). A suite run takes one of the three one-box modes (test_operator_onebox.onebox_modes).
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
from test_operator_onebox import docs_block, install_box, onebox_mode

from l2fs.testing.netns import socket_in
from operator_patch.patch import MP_SIDECAR, PatchConfig

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.vllm,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv"),
                       reason="needs root, nsenter, setpriv (network and mount namespaces)"),
    onebox_mode("mp"),
]
OVERLAY = "hyperpod-p5-mp"
NS = "team-a"
CFG = PatchConfig(mode="mp")  # the overlay's sidecar ports are the webhook's defaults
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Pod Security "baseline": the capabilities a container may add
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
tiny = onebox.tiny  # the model fixture, shared


@pytest.fixture(scope="module")
def mp(tiny: Path) -> Iterator[OneBox]:
    """docs/deploy.md's install block for hyperpod-p5-mp, on two P5 nodes (test_operator_onebox.install_box)."""
    yield from install_box(OVERLAY, tiny)


def engine_pods(box: OneBox) -> list[Pod]:
    box.wait_ready(box.endpoint, timeout=300)
    return sorted(box.pods_of(box.endpoint, NS), key=lambda p: p.name)


def server_log(box: OneBox, pod: Pod) -> str:
    return _ANSI.sub("", box.logs(pod, MP_SIDECAR))


def accepts(netns: str, addr: str, port: int) -> bool:
    s = socket_in(netns)
    s.settimeout(5)
    try:
        s.connect((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def mount_source(pid: int, where: str) -> str | None:
    """What is bound at `where` in a process's mount namespace (mountinfo's root field: the source's path)."""
    found = [ln.split() for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines() if ln.split()[4] == where]
    return found[-1][3] if found else None


def test_install_steps_run_in_order(mp: OneBox) -> None:
    """The install block (hyperpod-p5-mp paths) passes as a whole: the router's rollout (ready once it routes to a
    ready vLLM pod, i.e. one whose sidecar started first) and `kvtier operator-patch verify` of mp mode included."""
    out = mp.installed
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{mp.describe()}"


def test_engine_pods_run_behind_their_lmcache_server_sidecar(mp: OneBox) -> None:
    """Each vLLM pod (one per node) runs the webhook's `lmcache server` as a native sidecar: started before vLLM
    (whose MP client registered with it), running beside it, no restarts; the sidecar holds the endpoint's engine
    token and its node's id, the engine no in-process L2 setting; the server's ports answer on loopback only
    (its admin API has no authentication), and both containers share the pod's own /dev/shm. The pod as the API
    holds it fits Pod Security baseline: no host namespaces, no privilege, no added capability beyond
    baseline's, no hostPath, no host port."""
    pods = engine_pods(mp)
    assert len(pods) == 2 and len({p.node.name for p in pods}) == 2, mp.describe(mp.endpoint)
    for pod in pods:
        side = pod.container(MP_SIDECAR)
        (engine,) = [c for c in pod.containers if not c.init]
        assert side.sidecar and side.started and side.proc is not None and side.proc.poll() is None
        assert side.restarts == 0 and engine.restarts == 0, mp.describe(mp.endpoint)
        assert "sidecar lmcache-server started" in (pod.dir / "kubelet.log").read_text()
        assert "Registered non-GPU context" in server_log(mp, pod), server_log(mp, pod)[-3000:]
        env, senv = mp.env(pod, engine.spec), mp.env(pod, side.spec)
        assert not {"LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_STORAGE_PLUGINS", "L2FS_TOKEN"} & set(env), env
        assert senv["L2FS_TOKEN"] == mp.tokens[f"engine-{mp.endpoint}"] and senv["L2FS_NODE_ID"] == pod.node.name
        for port in (CFG.mp_port, CFG.mp_http_port):
            assert accepts(pod.ns.path, "127.0.0.1", port), port
            assert not accepts(pod.ns.path, pod.ip, port), f"port {port} open on the pod's address"
        assert engine.proc is not None
        shm = [mount_source(c.proc.pid, "/dev/shm") for c in (side, engine) if c.proc is not None]
        assert shm[0] and shm[0] == shm[1] and pod.dir.name in shm[0], shm  # the pod's own emptyDir, in both
        spec = (mp.get("Pod", NS, pod.name) or {})["spec"]
        assert not any(spec.get(k) for k in ("hostIPC", "hostNetwork", "hostPID")), spec
        assert not [v for v in spec.get("volumes") or [] if "hostPath" in v], spec["volumes"]
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext") or {}
            assert not sc.get("privileged") and set((sc.get("capabilities") or {}).get("add") or []) <= BASELINE_CAPS
            assert not [p for p in c.get("ports") or [] if p.get("hostPort")]


def test_bench_job_gets_every_full_chunk_from_l2_through_the_sidecar(mp: OneBox) -> None:
    """docs/bench-cluster.md steps 3 and 5 as written (the endpoint's name, lengths the CPU overlay serves, one
    rep, and a store wait: A's sidecar writes to l2fs after the request, as the doc's STORE_WAIT says): B's hit is
    every full chunk of A's prompt, no cold hit, identical greedy outputs; vLLM on B counts them as external
    prefix-cache hits and B's sidecar says they came from L2 (its L1 never saw them)."""
    engine_pods(mp)
    steps = docs_block("bench-cluster.md", "**3. Two pods on two nodes, patched.**") + \
        docs_block("bench-cluster.md", "**5. The Job.**")
    steps = steps.replace("qwen2-7b", mp.endpoint)
    doc = (ROOT / "docs" / "bench-cluster.md").read_text()
    spelled = re.search(r'`("LENGTHS=[^`]*")`', doc)
    assert spelled and "`STORE_WAIT=5`" in doc, "bench-cluster.md no longer says how to set LENGTHS / STORE_WAIT"
    lengths = spelled.group(1).replace("1024,2048", "768,1024")
    steps = steps.replace("REPLICA_B=http://$B_IP:8080]", f"REPLICA_B=http://$B_IP:8080, {lengths}, REPS=1, STORE_WAIT=5]")
    assert "LENGTHS=768" in steps and "STORE_WAIT=5" in steps, steps
    out = mp.shell(steps, cwd=mp.work, timeout=600)
    assert out.returncode == 0, f"{out.stdout[-4000:]}\n{out.stderr[-3000:]}\n{mp.describe('kvtier-bench-cross-pod')}"
    assert "two nodes: ok" in out.stdout, out.stdout[-2000:]
    text = (mp.work / "cross_pod.json").read_text()
    try:
        result = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"{e}: {text[max(0, e.pos - 300):e.pos + 300]!r}") from None  # type: ignore[attr-defined]
    rows = result["summary"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [768, 1024], rows
    for r in rows:
        assert r["b_hit_pct_full_chunks"] == 100.0, (r, out.stdout[-3000:])
        assert r["same_output_all"] and not r["cold_hit_tokens_max"], r
    (b,) = [p for p in mp.pods_of(mp.endpoint, NS) if result["summary"]["replica_b"] == f"http://{p.ip}:8080"]
    status, body = mp.http(b, 8080, path="/metrics", timeout=30)
    assert status == 200
    hits = sum(float(ln.rsplit(" ", 1)[1]) for ln in body.decode().splitlines()
               if ln.startswith("vllm:external_prefix_cache_hits_total"))
    assert hits >= sum(r["full_chunk_tokens"] - 1 for r in rows), (hits, rows)
    from_l2 = [(int(m.group(1)), int(m.group(2))) for m in re.finditer(
        r"Prefetch request completed \(L1\+L2\): \d+/\d+ retained keys \((\d+) L1, (\d+) L2\)", server_log(mp, b))]
    assert any(l1 == 0 and l2 >= 3 for l1, l2 in from_l2), from_l2  # a whole prompt's chunks, none from L1
    assert sum(n for _, n in from_l2) >= sum(r["full_chunk_tokens"] // 256 for r in rows), from_l2


def test_router_routes_by_kv_events_without_an_l2_lookup(mp: OneBox) -> None:
    """Through a router pod with the API key: a prompt goes to one of the two vLLM pods, the same prompt extended to
    the same pod for its cached prefix (route cache_hit: the pods' KV events); the router has no L2 lookup (no
    key check reported, as a plugin-mode router's would be)."""
    pods = engine_pods(mp)
    key = (mp.secret_data(NS, "kvtier-router-api-key") or {})["api-key"].decode()
    (router, *_) = mp.pods_of("kvtier-router", NS)
    prompt = " ".join(f"word{i}" for i in range(300))
    seen = []
    for text in (prompt, prompt + " and more"):
        body = json.dumps({"model": "/opt/ml/model", "prompt": text, "max_tokens": 4, "temperature": 0}).encode()
        headers: dict[str, str] = {}
        status, got = mp.http(router, 8080, "POST", "/v1/completions", body,
                              {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                              timeout=120, got_headers=headers)
        assert status == 200, got[:500]
        seen.append((headers.get("x-kvtier-replica", ""), headers.get("x-kvtier-route", "")))
    urls = {f"http://{p.ip}:8080" for p in pods}
    assert seen[0][0] in urls and seen[1] == (seen[0][0], "cache_hit"), (seen, urls)
    status, body = mp.http(router, 8080, path="/metrics", headers={"Authorization": f"Bearer {key}"})
    assert status == 200
    assert not [ln for ln in body.decode().splitlines() if ln.startswith("kvtier_router_l2_key_check{")
                and not ln.endswith(" 0.0")], "the router runs an L2 lookup"
