"""What a node's FUSE mount may write: not another endpoint's KV (trust as deployed).

The mount credential's prefixes (`--mount-prefixes`, default the whole KV prefix) covered every endpoint's
directory, so a write through node 1's mount planted `/kvtier/kv/ep-b/<key>` (keys are deterministic and
listable): endpoint B's put then answered "exists" and B's engine loaded the planted bytes. Now a prefix that
an engine credential of the tokens file serves (a plugin-mode endpoint) is that endpoint's alone: no mount
creates, renames into or makes directories under it; mount-mode endpoints (no engine credential of their
own) are written through the mounts as before.

Real master, workers and a `l2fs mount` process with its own projected ServiceAccount token (master
`--mount-sa`, reviewed by kmock's TokenReview emulator).

Mount mode as deployed now (test_pod_of_one_endpoint_cannot_plant_anothers_chunk): one mount per endpoint on
each node (`l2fs mount --endpoints`, each with that endpoint's own mount token and prefix), and each endpoint's
pods given only their endpoint's mount by the webhook; run from the rendered deploy/base and webhook config.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mount_helpers import Mount, start_mount
from polling import wait_until

from l2fs.testing.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from operator_helpers import MOUNT_SA, jwt, review_api  # noqa: E402

pytestmark = pytest.mark.k8s

MASTER = "master-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
ENGINE_B = "engine-b-token-0123456789abcdef"
KV = "/kvtier/kv"


@contextlib.contextmanager
def _node_mount(factory: Callable[..., LocalCluster], base: Path,
                *master_args: str) -> Iterator[tuple[LocalCluster, Mount]]:
    """Master (--mount-sa, a tokens file in which endpoint B has an engine credential), a worker, and node 1's
    mount showing its own ServiceAccount token; the cluster stops before the TokenReview API it uses."""
    with review_api(base) as api:
        c = factory(1, name="epmount", started=False, capacity="512M", token=ADMIN, tokens=[
            {"name": "master", "token": MASTER, "role": "worker"},
            {"name": "ops", "token": ADMIN, "role": "admin"},
            {"name": "engine-ep-b", "token": ENGINE_B, "role": "engine", "prefixes": [f"{KV}/ep-b"]}],
            master_args=["--token", MASTER, "--mount-sa", "kvtier:l2fs-mount", "--worker-audience", "l2fs",
                         "--kubeconfig", str(api.kubeconfig), *master_args],
            worker_args=["--token", MASTER])
        with c:
            tok = jwt("node-1")
            api.emu.table[tok] = (MOUNT_SA, "node-1", ["l2fs"])
            token_file = base / "node-1.token"
            token_file.write_text(tok)
            m = start_mount(base / "m1", c.master, "--node-id", "node-1", "--token-file", str(token_file))
            try:
                yield c, m
            finally:
                m.stop()


@pytest.fixture(scope="module")
def node_mount(tmp_path_factory: pytest.TempPathFactory,
               cluster_factory: Callable[..., LocalCluster]) -> Iterator[tuple[LocalCluster, Mount]]:
    # --endpoint-writes plugin, the default
    with _node_mount(cluster_factory, tmp_path_factory.mktemp("epmount")) as got:
        yield got


def _errno(fn: Any) -> int | None:
    """The errno of the OSError `fn` raises; None when it went through."""
    try:
        fn()
    except OSError as e:
        return e.errno or -1
    return None


def test_mount_cannot_plant_another_endpoints_chunks(node_mount: tuple[LocalCluster, Mount]) -> None:
    """Through node 1's mount, a new file, a directory and a rename into B's (engine-served) prefix all fail;
    B's put of that key then publishes B's own bytes and B reads them back. A mount-mode endpoint's directory
    (no engine credential) is still written through the mount."""
    c, m = node_mount
    key = "chunk-0001.data"
    (m / "kvtier/kv/ep-b").mkdir(parents=True, exist_ok=True)  # the connector makes its own prefix dir

    def plant() -> None:
        with open(m / f"kvtier/kv/ep-b/{key}", "wb") as f:
            f.write(b"planted" * 1000)

    tried = {"create": _errno(plant), "mkdir": _errno(lambda: (m / "kvtier/kv/ep-b/sub").mkdir())}
    (m / "kvtier/kv/ep-m").mkdir(parents=True, exist_ok=True)
    own = m / "kvtier/kv/ep-m/mine.data"
    own.write_bytes(b"mount-mode endpoint" * 100)  # a mount-mode endpoint: written through the mount
    tried["rename"] = _errno(lambda: os.rename(own, m / "kvtier/kv/ep-b/renamed.data"))
    mine = os.urandom(50_000)
    with c.client(token=ENGINE_B) as b:
        assert b.put(f"{KV}/ep-b/{key}", mine) is True  # not "exists"
        assert b.get(f"{KV}/ep-b/{key}") == mine
        assert b.stat(f"{KV}/ep-b/renamed.data") is None and b.stat(f"{KV}/ep-b/sub") is None
    assert tried == {"create": errno.EACCES, "mkdir": errno.EACCES, "rename": errno.EACCES}, tried
    assert own.read_bytes() == b"mount-mode endpoint" * 100
    assert (m / f"kvtier/kv/ep-b/{key}").read_bytes() == mine  # the mount still reads B's chunks


def test_mount_mode_mounts_still_write_every_endpoint(tmp_path: Path,
                                                      make_cluster: Callable[..., LocalCluster]) -> None:
    """With `--endpoint-writes mount` (what deploy/ passed before per-endpoint mounts: one node-wide mount wrote
    every endpoint's KV) the mount writes under B's prefix as before, and an engine's put of that key then
    answers "exists". deploy/ no longer passes it (test_pod_of_one_endpoint_cannot_plant_anothers_chunk)."""
    with _node_mount(make_cluster, tmp_path, "--endpoint-writes", "mount") as (c, m):
        (m / "kvtier/kv/ep-b").mkdir(parents=True, exist_ok=True)
        (m / "kvtier/kv/ep-b/chunk.data").write_bytes(b"through the mount" * 100)
        with c.client(token=ENGINE_B) as b:
            assert b.get(f"{KV}/ep-b/chunk.data") == b"through the mount" * 100
            assert b.put(f"{KV}/ep-b/chunk.data", b"other") is False


# ------------------------------------------------------------------ as deployed: per-endpoint mounts
B_KEY = "vllm@%2Fopt%2Fml%2Fmodel@1@0@00c0ffee00c0ffee@bfloat16.data"  # deterministic, as LMCache names chunks
A_KEY = "vllm@%2Fopt%2Fml%2Fmodel@1@0@0a0a0a0a0a0a0a0a@bfloat16.data"


def _patched_pod(endpoint: str, host_path: Path, pod_mnt: Path) -> tuple[str, str, str]:
    """(hostPath, mountPath, LMCache's remote dir) of the l2fs volume of a pod of `endpoint`, patched by the
    webhook configured from the rendered kvtier-config (its own flag parser), node and pod paths redirected. The
    volume is the endpoint's node directory, read-only, HostToContainer (what _in_pod binds)."""
    from operator_helpers import load_yaml, render

    from operator_patch.options import add_config_args, config_from_args
    from operator_patch.patch import mutate

    (cm,) = [d for d in render("base") if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvtier-config")]
    env = {**{k: v for k, v in cm["data"].items() if k.startswith("KVTIER_")},
           "KVTIER_HOST_PATH": str(host_path), "KVTIER_MOUNT_PATH": str(pod_mnt)}
    old = dict(os.environ)
    try:
        os.environ.update(env)
        parser = argparse.ArgumentParser()
        add_config_args(parser)
        cfg = config_from_args(parser.parse_args([]))
    finally:
        os.environ.clear()
        os.environ.update(old)
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    dep["metadata"]["ownerReferences"][0]["name"] = endpoint
    out = mutate(dep, cfg)
    spec = out["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if any(e.get("name") == "LMCACHE_REMOTE_URL" for e in c.get("env") or [])]
    (vm,) = [m for m in c["volumeMounts"] if m["name"] == cfg.volume_name]
    (vol,) = [v for v in spec["volumes"] if v["name"] == cfg.volume_name]
    (url,) = [e["value"] for e in c["env"] if e["name"] == "LMCACHE_REMOTE_URL"]
    assert url.startswith("fs://localhost:0/"), url
    assert vm.get("readOnly") is True and vm.get("mountPropagation") == "HostToContainer", vm
    return vol["hostPath"]["path"], vm["mountPath"], url.removeprefix("fs://localhost:0")


def _in_pod(host: str, mount_path: str, node: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`script` (sh, $1...) as a container given only this volume sees the node: the hostPath bound at its
    mountPath, read-only (the mount in it is a mount of its own: writable), the rest of the node's paths (`node`:
    mounts, data, tokens) hidden under an empty tmpfs."""
    setup = ('mkdir -p "$MP" && mount --rbind "$HOST" "$MP" && mount --make-rslave "$MP" && '
             'mount -o remount,bind,ro "$MP" && mount -t tmpfs none "$NODE" && exec sh -c "$SCRIPT" sh "$@"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup, "sh", *args],
                          env={**os.environ, "MP": mount_path, "HOST": host, "NODE": str(node), "SCRIPT": script},
                          capture_output=True, text=True, timeout=60)


# LMCache's fs:// connector's put: the directory, a temp file, then a rename into place
PUT = 'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1.tmp" && mv "$1.tmp" "$1"'


@pytest.mark.fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3")
                    or not shutil.which("unshare"), reason="needs root, /dev/fuse, fusermount3 and unshare")
def test_pod_of_one_endpoint_cannot_plant_anothers_chunk(tmp_path: Path) -> None:
    """deploy/base as rendered (master, worker and mount DaemonSet commands, tokens from `kvtier tokens generate
    --engine ep-a --engine ep-b`) and pods patched by the webhook as its ConfigMap configures it. A pod of
    endpoint A writes B's next chunk (deterministic key) wherever what it is given reaches: B's URL path as a
    node-wide mount would show it, and `..` out of its own mount. Before (one node-wide mount whose credential
    wrote every endpoint's prefix, every pod given all of it) the chunk was published under B's prefix, B's put
    then answered "exists" and B loaded the planted bytes; the test fails there. Now A's pod has only its
    endpoint's mount (root /kvtier/kv/ep-a, mount-ep-a's token), nothing reaches B's prefix, and B's own pod puts
    and reads its bytes. The mount credential itself cannot write outside its prefix either; A's chunk written
    by a pod on node-a is read by A's pod on node-b through node-b's mount (cross-pod hits still work)."""
    from operator_helpers import render
    from test_operator_deploy_run import Env, container, start_worker

    docs = render("base")
    node = Path(tempfile.mkdtemp(prefix="kvtier-node-"))
    node.chmod(0o755)
    try:
        with review_api(node) as api:
            env = Env(docs, tmp_path, node, api, engines=("ep-a@team-a", "ep-b@team-b"))
            try:
                _plant_and_hit(docs, env, node, tmp_path, container, start_worker)
            finally:
                env.stop()
                from l2fs.fuse.main import mount_type

                for m in sorted({str(p) for d in node.glob("mnt*") for p in [d, *d.glob("*"), *d.glob("*/*")]},
                                key=len, reverse=True):  # <mnt>/<endpoint>/<endpoint>: deepest first
                    if (mount_type(m) or "").startswith("fuse"):
                        subprocess.run(["fusermount3", "-u", "-z", m], timeout=20)
    finally:
        shutil.rmtree(node, ignore_errors=True)


def _plant_and_hit(docs: list[dict[str, Any]], env: Any, node: Path, tmp: Path, container: Any,
                   start_worker: Any) -> None:
    master = container(docs, "StatefulSet", "l2fs-master")
    mount = container(docs, "DaemonSet", "l2fs-mount")
    env.wait_probe(master, "readinessProbe", env.start(master, "master.log"), "master.log")
    start_worker(docs, env)
    env.wait_probe(mount, "readinessProbe", env.start(mount, "mount.log"), "mount.log")
    mnt = Path(env.vars["L2FS_MOUNT_PATH"])
    pod_mnt = tmp / "pod-root" / "mnt" / "l2fs"  # the path the pods see the mount at (KVTIER_MOUNT_PATH)
    a_host, a_path, a_dir = _patched_pod("ep-a", mnt, pod_mnt)
    b_host, b_path, b_dir = _patched_pod("ep-b", mnt, pod_mnt)
    l2fs = str(Path(sys.executable).with_name("l2fs"))

    def cli(token: str, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([l2fs, cmd[0], "--master", env.vars["L2FS_MASTER"], *cmd[1:]], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "L2FS_TOKEN": token})

    b_l2fs = f"{KV}/ep-b/unversioned/{B_KEY}"
    assert b_dir.removeprefix(str(pod_mnt)) + B_KEY == b_l2fs  # the pod's URL names the l2fs path
    # A's pod: B's chunk at B's URL path, and `..` out of its own mount's view (its chunk dir's grandparent): both
    # in A's own volume, the node directory around A's mount, which is read-only (nothing onto the node's disk)
    for target in (f"{b_dir}{B_KEY}", f"{a_dir}../../ep-b/unversioned/{B_KEY}"):
        tried = _in_pod(a_host, a_path, node, PUT, target, "planted-by-A")
        assert tried.returncode != 0 and "Read-only file system" in tried.stderr, (target, tried)
    assert sorted(os.listdir(a_host)) == ["ep-a"], os.listdir(a_host)
    planted = cli(env.tokens["admin"], "cat", b_l2fs)
    assert planted.returncode != 0, f"A's pod planted B's chunk: {planted.stdout!r}"
    # the mount daemon's credential for A: nothing outside A's prefix either (the master refuses it)
    src = tmp / "planted"
    src.write_text("planted-by-A's-mount-token")
    denied = cli(env.tokens["mount-ep-a"], "put", str(src), b_l2fs)
    assert denied.returncode != 0 and "may not" in denied.stderr + denied.stdout, denied
    # B's pod puts its chunk (published: nothing was there) and reads back its own bytes
    put = _in_pod(b_host, b_path, node, PUT + ' && cat "$1"', f"{b_dir}{B_KEY}", "B's own KV")
    assert put.returncode == 0 and put.stdout == "B's own KV", put.stderr
    assert cli(env.tokens["admin"], "cat", b_l2fs).stdout == "B's own KV"
    # A's own cross-pod hit: a pod of A on node-a writes, a pod of A on node-b (its node's mount) reads
    wrote = _in_pod(a_host, a_path, node, PUT, f"{a_dir}{A_KEY}", "A's KV from node-a")
    assert wrote.returncode == 0, wrote.stderr
    node_b = {**env.vars, "NODE_NAME": "node-b", "L2FS_MOUNT_PATH": str(node / "mnt-b"),
              "L2FS_MOUNT_STATUS_FILE": str(tmp / "node-b.status")}
    saved, env.vars = env.vars, node_b
    try:
        env.wait_probe(mount, "readinessProbe", env.start(mount, "mount-b.log"), "mount-b.log")
    finally:
        env.vars = saved
    a_host_b, a_path_b, a_dir_b = _patched_pod("ep-a", node / "mnt-b", pod_mnt)
    got = _in_pod(a_host_b, a_path_b, node, 'cat "$1"', f"{a_dir_b}{A_KEY}")
    assert got.returncode == 0 and got.stdout == "A's KV from node-a", got.stderr


@pytest.mark.fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                    reason="needs root, /dev/fuse and fusermount3")
def test_endpoint_mounts_follow_the_secret(tmp_path: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    """`l2fs mount --endpoints DIR` (what the mount DaemonSet runs) against a real cluster: an endpoint added to
    DIR is mounted without touching the others' mounts (same process), a crashed endpoint mount is restarted, a
    removed one unmounted; each shows only its own prefix."""
    import psutil

    from l2fs.procs import spawn, stop

    entries = [{"name": "master", "token": MASTER, "role": "worker"},
               {"name": "ops", "token": ADMIN, "role": "admin"},
               *[{"name": f"mount-{e}", "token": f"mount-{e}-token-0123456789", "role": "mount",
                  "prefixes": [f"{KV}/{e}"]} for e in ("ep-a", "ep-b")]]
    src, base = tmp_path / "endpoint-mounts", tmp_path / "mnt"
    src.mkdir()
    base.mkdir()

    def add(e: str) -> None:
        (src / e).write_text(json.dumps({"root": f"{KV}/{e}", "token": f"mount-{e}-token-0123456789"}))

    def children() -> dict[str, int]:  # endpoint -> pid of its mount process
        return {Path(p.cmdline()[4]).name: p.pid for p in psutil.Process(sup.pid).children()
                if len(p.cmdline()) > 4 and p.cmdline()[3] == "mount"}

    def live(e: str) -> bool:
        return fuse_type(base / e / e) == "fuse.l2fs" and e in children()

    from l2fs.fuse.main import mount_type as fuse_type

    add("ep-a")
    c = make_cluster(1, capacity="256M", token=ADMIN, tokens=entries, master_args=["--token", MASTER],
                     worker_args=["--token", MASTER])
    status = tmp_path / "status"
    sup = spawn([sys.executable, "-m", "l2fs.cli", "mount", str(base), "--endpoints", str(src),
                 "--endpoints-poll", "0.3", "--status-file", str(status), "--master", c.master,
                 "--node-id", "node-1"], tmp_path / "sup.log")
    try:
        wait_until(lambda: live("ep-a") and status.read_text().startswith("ready"), 30)
        home = (base / "ep-a").stat()  # the plain node directory the pods bind, the mount inside it
        assert (home.st_uid, home.st_mode & 0o7777) == (0, 0o755) and not os.path.ismount(base / "ep-a")
        (base / "ep-a" / "ep-a" / "rev").mkdir()
        (base / "ep-a" / "ep-a" / "rev" / "k.data").write_bytes(b"a" * 1000)
        with c.client(token=ADMIN) as admin:
            assert admin.get(f"{KV}/ep-a/rev/k.data") == b"a" * 1000  # under its prefix, only there
        a_pid = children()["ep-a"]
        add("ep-b")
        wait_until(lambda: live("ep-b"), 30)
        assert children()["ep-a"] == a_pid  # ep-a's mount untouched
        assert os.listdir(base / "ep-b" / "ep-b") == []  # ep-b's mount shows ep-b's prefix, not ep-a's files
        b_pid = children()["ep-b"]
        os.kill(b_pid, signal.SIGKILL)  # crashed: restarted after its backoff
        wait_until(lambda: live("ep-b") and children()["ep-b"] != b_pid and os.listdir(base / "ep-b" / "ep-b") == [], 30)
        (src / "ep-a").unlink()
        wait_until(lambda: fuse_type(base / "ep-a" / "ep-a") is None and "ep-a" not in children(), 30)
        assert live("ep-b")
    finally:
        stop(sup)
    assert fuse_type(base / "ep-b" / "ep-b") is None  # SIGTERM unmounted every endpoint


@pytest.mark.unit
def test_a_mount_point_is_emptied_and_owned_without_following_symlinks(tmp_path: Path) -> None:
    """What `l2fs mount --endpoints` does to an endpoint's node directory and mount point before it mounts there
    (EndpointMounts._prepare): both plain directories (a symlink or a file in their place removed, never
    followed), root's (when root) and 0755; whatever the bare mount point holds removed, without following a
    symlink into what it points at; nothing outside them touched."""
    from l2fs.fuse.endpoints import EndpointMounts

    base, decoy = tmp_path / "mnt", tmp_path / "decoy"
    base.mkdir()
    decoy.mkdir()
    (decoy / "keep.data").write_bytes(b"not the mount's")
    (decoy / "sub").mkdir()
    sup = EndpointMounts(str(base), str(tmp_path / "none"), [])

    def prepared(name: str) -> list[str]:
        sup._prepare(name)
        for d in (base / name, base / name / name):
            st = os.lstat(d)
            assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o7777 == 0o755, (d, oct(st.st_mode))
            assert os.geteuid() != 0 or st.st_uid == 0
        return os.listdir(base / name / name)

    assert prepared("ep-new") == []  # made
    (base / "ep-a").mkdir()
    (base / "ep-a").chmod(0o777)  # a node directory of the older layout (or the kubelet's), too open
    mp = base / "ep-a" / "ep-a"
    mp.mkdir()
    mp.chmod(0o777)
    (mp / "rev").mkdir()
    (mp / "rev" / "chunk.data").write_bytes(b"onto the node's disk")
    (mp / "rev" / "out").symlink_to(decoy)
    (mp / "link").symlink_to(decoy / "sub")
    (mp / "top.data").write_bytes(b"x")
    assert prepared("ep-a") == []
    (base / "ep-a").chmod(0o777)
    mp.rmdir()
    mp.symlink_to(decoy)  # the mount point replaced by a symlink: a mount there would land on the decoy
    assert prepared("ep-a") == [] and not mp.is_symlink()
    (base / "ep-b").symlink_to(decoy)  # the node directory a symlink
    assert prepared("ep-b") == [] and not (base / "ep-b").is_symlink()
    (base / "ep-c").write_bytes(b"a file")
    assert prepared("ep-c") == []
    assert sorted(os.listdir(decoy)) == ["keep.data", "sub"] and (decoy / "keep.data").read_bytes() == b"not the mount's"


@pytest.mark.unit
def test_per_endpoint_mount_credential_carries_no_other_endpoints_prefixes(tmp_path: Path) -> None:
    """The master's check of a per-endpoint mount token: its own prefix only, and no list of the other endpoints'
    prefixes to scan per write (16 us per write at 200 endpoints, before); a mount over the whole KV prefix still
    has every endpoint's excluded. Same answers either way."""
    from l2fs.common import Credentials

    entries = [{"name": "master", "token": MASTER, "role": "worker"},
               {"name": "mount", "token": "node-wide-mount-token-0123", "role": "mount", "prefixes": [KV]}]
    for i in range(50):
        entries += [{"name": f"engine-ep{i}", "token": f"engine-ep{i}-token-01234567", "role": "engine",
                     "prefixes": [f"{KV}/ep{i}"]},
                    {"name": f"mount-ep{i}", "token": f"mount-ep{i}-token-01234567", "role": "mount",
                     "prefixes": [f"{KV}/ep{i}"]}]
    (tmp_path / "t.json").write_text(json.dumps(entries))
    creds = {c.name: c for _, _, c in Credentials(tokens_file=str(tmp_path / "t.json")).entries}
    own, wide = creds["mount-ep7"], creds["mount"]
    assert own.excluded == () and len(wide.excluded) == 50
    assert own.may_write(f"{KV}/ep7/r/k.data", True) and own.may_write(KV, True, mkdir=True)
    assert not own.may_write(f"{KV}/ep8/r/k.data", True) and not own.may_write(f"{KV}/ep70/k.data", True)
    assert not wide.may_write(f"{KV}/ep8/r/k.data", True) and wide.may_write(f"{KV}/ep8", True, mkdir=True)
