"""A node's l2fs mount killed with SIGKILL, as deployed: the rendered master, worker and mount containers (their
commands, ConfigMap and tokens, as test_operator_deploy_run runs them) and the webhook-patched vLLM pod's
init container. While the node has no live mount (not started yet, or killed and stale) the vLLM pod stays in
its init container instead of writing chunks onto the node's disk; the mount pod's restart clears the stale
mount (ENOTCONN) and mounts again, and the init container lets the pod start. A pod already running when the
mount pod is killed reads and writes through the restarted daemon's new mount without a restart of its own
(test_a_running_pod_reads_and_writes_through_the_remount: real node and pod mount namespaces)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubelet_env import container_argv, container_env
from operator_helpers import load_yaml
from polling import wait_until
from test_operator_deploy_run import Env, base, container, env, hostpath, start_worker  # noqa: F401 (fixtures)

from operator_patch.patch import WAIT_INIT, PatchConfig, mutate

pytestmark = pytest.mark.fuse


def _init_of(mnt: Path, endpoint: str) -> list[str]:
    """The init container's argv in a pod of `endpoint` the webhook patched for this node path (kubelet-expanded),
    with its volume's path in the pod replaced by the node path the volume binds there (the pod's view)."""
    dep = load_yaml("rendered-v3.2-stripped.yaml")
    dep["metadata"]["ownerReferences"][0]["name"] = endpoint
    out = mutate(dep, PatchConfig(host_path=str(mnt)))
    (init,) = [c for c in out["spec"]["template"]["spec"]["initContainers"] if c["name"] == WAIT_INIT]
    (vm,) = init["volumeMounts"]
    (vol,) = [v for v in out["spec"]["template"]["spec"]["volumes"] if v["name"] == vm["name"]]
    assert vol["hostPath"]["path"] == str(mnt / endpoint)  # its endpoint's own directory only
    at = vm["mountPath"] + "/"
    argv = [vol["hostPath"]["path"] + "/" + a.removeprefix(at) if a.startswith(at) else a
            for a in container_argv(init, container_env(init))]
    assert argv[0] == "python3" and argv[-1] == str(mnt / endpoint / endpoint)  # the endpoint's mount in it
    return argv


def _waits(argv: list[str], seconds: float = 4.0) -> bool:
    """True when the init container is still waiting after `seconds` (it is then stopped)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return True
    assert rc == 0, rc
    return False


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_killed_mount_holds_vllm_pods_back_and_its_restart_recovers(base: list[dict[str, Any]], env: Env) -> None:  # noqa: F811
    master = container(base, "StatefulSet", "l2fs-master")
    mount = container(base, "DaemonSet", "l2fs-mount")
    env.wait_probe(master, "readinessProbe", env.start(master, "master.log"), "master.log")
    start_worker(base, env)
    mnt = Path(env.vars["L2FS_MOUNT_PATH"])
    own = mnt / "ep-a" / "ep-a"  # endpoint ep-a's mount (Secret l2fs-endpoint-mounts), in its node directory
    own.parent.mkdir(parents=True)  # the hostPath as DirectoryOrCreate leaves it before any mount
    init = _init_of(mnt, "ep-a")
    assert _waits(init), "a vLLM pod started on a node whose mount is not up (it would write to the node's disk)"

    proc = env.start(mount, "mount.log")
    env.wait_probe(mount, "readinessProbe", proc, "mount.log")
    assert not _waits(init, 30), "the init container did not let the pod start on a live mount"

    proc.send_signal(signal.SIGKILL)  # the mount daemon OOM-killed / killed: its FUSE mount stays, dead
    proc.wait(10)

    def listdir_errno() -> int | None:
        try:
            os.listdir(own)
        except OSError as e:
            return e.errno
        return None

    # its endpoint mount is killed with it (PR_SET_PDEATHSIG): ECONNABORTED, then dead
    wait_until(lambda: listdir_errno() == errno.ENOTCONN, 10, 0.1, message=lambda: f"errno {listdir_errno()}")
    assert _waits(init), "a pod started on a dead mount"

    again = env.start(mount, "mount-again.log")  # the DaemonSet restarts the pod: same command
    env.wait_probe(mount, "readinessProbe", again, "mount-again.log")
    assert not _waits(init, 30)
    chunk = own / "rev" / "after-restart.data"
    chunk.parent.mkdir(parents=True, exist_ok=True)
    chunk.write_bytes(b"kv" * 512)
    assert chunk.read_bytes() == b"kv" * 512
    again.terminate()  # the kubelet's SIGTERM: every endpoint unmounted
    assert again.wait(30) == 0
    assert not os.path.ismount(own)
    assert not (own / "rev").exists(), "the chunk went onto the node's disk under the mount point"


# ------------------------------------------------------------------ a running pod across a mount restart
# One operation as a process in a pod's mount namespace, with the system python (a non-root uid cannot reach
# the venv's): prints {"ok": ...} or {"errno": "ENOTCONN"}. put is LMCache's fs:// connector's: the directory,
# a temp file, a rename into place.
POD_OP = r"""
import errno, json, os, sys
op, path, data = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    out = None
    if op == "put":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(data.encode())
        os.rename(path + ".tmp", path)
    elif op == "get":
        out = open(path, "rb").read().decode()
    elif op == "create":
        open(path, "xb").close()
    elif op == "rmdir":
        os.rmdir(path)
    print(json.dumps({"ok": out}))
except OSError as e:
    print(json.dumps({"errno": errno.errorcode.get(e.errno, str(e.errno))}))
"""


class Namespaces:
    """A node's mount namespace and pods' ones in it, each held by a sleeping process, as the one-box cluster
    (tests/operator/kubelet_sim.py) and runc make them: the node's copy of this machine's mounts as slaves with
    its host dir a shared bind mount (a node's / is rshared under systemd); a pod's copied from the node's, each
    volume bound (recursively) at its mountPath and made rslave for HostToContainer (rprivate otherwise),
    remounted read-only for readOnly. Nothing done in them reaches this machine's mount table."""

    def __init__(self, host: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        h = shlex.quote(str(host))
        self.node = self._hold([], f"mount --bind {h} {h}; mount --make-private {h}; mount --make-shared {h}",
                               "--propagation", "slave")
        wait_until(lambda: any(line.split()[4] == str(host) and "shared:" in line for line in
                               Path(f"/proc/{self.node.pid}/mountinfo").read_text().splitlines()), 20)

    def _hold(self, prefix: list[str], script: str, *unshare: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", *prefix, "unshare", "--mount", *unshare,
                                 "--", "sh", "-ec", script + "\nexec sleep infinity"],
                                start_new_session=True, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def in_node(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--mount=/proc/{self.node.pid}/ns/mnt", "--", *argv]

    def pod(self, volumes: list[tuple[str, str, dict[str, Any]]]) -> subprocess.Popen[bytes]:
        """A running pod's container: (hostPath, mountPath, volumeMount) each bound as the kubelet does."""
        lines = []
        for src, target, vm in volumes:
            q = shlex.quote(target)
            prop = {"HostToContainer": "--make-rslave", "Bidirectional": "--make-rshared"}
            lines += [f"mkdir -p {q}", f"mount --rbind {shlex.quote(src)} {q}",
                      f"mount {prop.get(vm.get('mountPropagation', 'None'), '--make-rprivate')} {q}"]
            if vm.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {q}")
        proc = self._hold(self.in_node([]), "\n".join(lines), "--propagation", "unchanged")
        wait_until(lambda: all(any(line.split()[4] == t for line in
                                   Path(f"/proc/{proc.pid}/mountinfo").read_text().splitlines())
                               for _, t, _ in volumes), 20, message="the pod's volumes were not bound")
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _pod_op(pod: subprocess.Popen[bytes], op: str, path: str, data: str = "", uid: int = 0) -> dict[str, Any]:
    """`op` on `path` as a process of the running pod (uid `uid`): {"ok": result} or {"errno": name}."""
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or "python3"
    ids = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    got = subprocess.run(["nsenter", f"--mount=/proc/{pod.pid}/ns/mnt", "--", *ids, python, "-c", POD_OP, op, path,
                          data], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return dict(json.loads(got.stdout))


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not all(
    shutil.which(t) for t in ("fusermount3", "unshare", "nsenter", "setpriv")),
    reason="needs root, /dev/fuse, fusermount3, unshare, nsenter and setpriv")
def test_a_running_pod_reads_and_writes_through_the_remount(base: list[dict[str, Any]], env: Env,  # noqa: F811
                                                            tmp_path: Path) -> None:
    """The node's mount DaemonSet pod SIGKILLed and restarted under a RUNNING vLLM pod, with real mount namespaces
    (the node's, the pod's: its volume as the webhook renders it, bound as the kubelet does) and real FUSE. The pod
    writes its chunk as LMCache does (its URL's directory), its mount dies (ENOTCONN), the restarted daemon mounts
    the endpoint again, and the same pod, never restarted, reads its chunk and writes a new one through the new
    mount. Before, the pod's hostPath was the endpoint's FUSE mount itself: the pod held a copy of that mount,
    dead with its daemon, and neither the restart's unmount of it nor the new mount propagated to the pod (mounts
    propagate to copies of their parent): ENOTCONN for every L2 read and write until the pod was restarted.

    While no mount is live (the dead one peeled, before the new one), the pod can write nothing onto the node's
    disk, not as root either: its volume (the endpoint's node directory, which holds the mount point) is
    read-only, the mount point cannot be removed; a file left in the bare mount point is scrubbed before the
    remount. SIGTERM unmounts and leaves the node directory holding only the empty mount point."""
    from l2fs.fuse.endpoints import EndpointMounts

    master = container(base, "StatefulSet", "l2fs-master")
    mount = container(base, "DaemonSet", "l2fs-mount")
    env.wait_probe(master, "readinessProbe", env.start(master, "master.log"), "master.log")
    start_worker(base, env)
    mnt = Path(env.vars["L2FS_MOUNT_PATH"])
    mnt.mkdir(parents=True, exist_ok=True)
    ns = Namespaces(mnt)
    status = Path(env.vars["L2FS_MOUNT_STATUS_FILE"])
    # the DaemonSet's container in the node's mount namespace (its /mnt/l2fs is Bidirectional: the node's)
    on_node = {**mount, "command": ns.in_node(mount["command"])}
    l2fs = str(Path(sys.executable).with_name("l2fs"))

    def published(path: str) -> str | None:
        got = subprocess.run([l2fs, "cat", "--master", env.vars["L2FS_MASTER"], path], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "L2FS_TOKEN": env.tokens["admin"]})
        return got.stdout if got.returncode == 0 else None

    def start_mount(log: str) -> subprocess.Popen[bytes]:
        status.unlink(missing_ok=True)  # a killed daemon leaves its last "ready"
        proc = env.start(on_node, log)
        env.wait_probe(on_node, "readinessProbe", proc, log)
        return proc

    try:
        proc = start_mount("mount.log")
        # a pod of endpoint ep-a as the webhook patches it, its mount path under this test's directory
        dep = load_yaml("rendered-v3.2-stripped.yaml")
        dep["metadata"]["ownerReferences"][0]["name"] = "ep-a"
        pod_mnt = tmp_path / "pod-root" / "mnt" / "l2fs"
        out = mutate(dep, PatchConfig(host_path=str(mnt), mount_path=str(pod_mnt)))
        spec = out["spec"]["template"]["spec"]
        (c,) = [c for c in spec["containers"] if any(e["name"] == "LMCACHE_REMOTE_URL" for e in c.get("env") or [])]
        (vm,) = [m for m in c["volumeMounts"] if m["name"] == "kvtier-l2fs"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "kvtier-l2fs"]
        (url,) = [e["value"] for e in c["env"] if e["name"] == "LMCACHE_REMOTE_URL"]
        chunks = url.removeprefix("fs://localhost:0")  # LMCache's directory in the pod
        in_l2fs = chunks.removeprefix(str(pod_mnt))  # the same directory in l2fs
        assert in_l2fs.startswith("/kvtier/kv/ep-a/"), url
        pod = ns.pod([(vol["hostPath"]["path"], vm["mountPath"], vm)])

        assert _pod_op(pod, "put", chunks + "k1.data", "first") == {"ok": None}
        assert published(in_l2fs + "k1.data") == "first"

        proc.send_signal(signal.SIGKILL)  # the mount pod killed: its endpoint mounts die with it (dead, ENOTCONN)
        proc.wait(10)
        wait_until(lambda: _pod_op(pod, "get", chunks + "k1.data") == {"errno": "ENOTCONN"}, 20)
        again = start_mount("mount-again.log")  # the DaemonSet restarts it: same command
        # the same running pod: the new mount, for reads and for writes
        wait_until(lambda: _pod_op(pod, "get", chunks + "k1.data") == {"ok": "first"}, 20,
                   message=lambda: f"the running pod after the restart: {_pod_op(pod, 'get', chunks + 'k1.data')}")
        assert _pod_op(pod, "put", chunks + "k2.data", "second") == {"ok": None}
        assert published(in_l2fs + "k2.data") == "second"

        # no live mount at all (killed, its dead mount peeled as the next daemon does first): the pod's volume
        # takes nothing onto the node's disk
        mp = EndpointMounts(str(mnt), "", []).path("ep-a")  # where the node has the endpoint's mount
        again.send_signal(signal.SIGKILL)
        again.wait(10)
        wait_until(lambda: _pod_op(pod, "get", chunks + "k1.data") == {"errno": "ENOTCONN"}, 20)
        assert subprocess.run(ns.in_node(["fusermount3", "-u", "-z", mp]), timeout=30).returncode == 0
        wait_until(lambda: _pod_op(pod, "get", chunks + "k1.data") == {"errno": "ENOENT"}, 20)
        pod_view = vm["mountPath"]
        for uid, refused in ((0, {"EROFS"}), (1000, {"EROFS", "EACCES"})):  # root too: read-only, not just 0755
            assert _pod_op(pod, "put", chunks + "k3.data", "onto the disk", uid=uid)["errno"] in refused, uid
            assert _pod_op(pod, "create", f"{pod_view}/junk", uid=uid)["errno"] in refused, uid
        assert _pod_op(pod, "rmdir", f"{pod_view}/ep-a")["errno"] in ("EROFS", "EBUSY")
        Path(mp, "left-on-the-node.data").write_bytes(b"x")  # whatever the node's disk got meanwhile
        third = start_mount("mount-third.log")
        wait_until(lambda: _pod_op(pod, "get", chunks + "k2.data") == {"ok": "second"}, 20)
        third.terminate()  # the kubelet's SIGTERM: every endpoint unmounted
        assert third.wait(30) == 0
        node_mounts = Path(f"/proc/{ns.node.pid}/mounts").read_text()
        assert f" {mnt}/" not in node_mounts, node_mounts
        assert sorted(os.listdir(mnt / "ep-a")) == ["ep-a"] and os.listdir(mp) == [], os.listdir(mnt / "ep-a")
    finally:
        ns.close()
