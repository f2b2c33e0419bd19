"""A node's l2fs mount killed with SIGKILL, as deployed: the rendered master, worker and mount containers (their
commands, ConfigMap and tokens, as test_operator_deploy_run runs them) and the webhook-patched vLLM pod's
init container. While the node has no live mount (not started yet, or killed and stale) the vLLM pod stays in
its init container instead of writing chunks onto the node's disk; the mount pod's restart clears the stale
mount (ENOTCONN) and mounts again, and the init container lets the pod start."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
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
    assert vol["hostPath"]["path"] == str(mnt / endpoint)  # its endpoint's own mount only
    argv = [vol["hostPath"]["path"] if a == vm["mountPath"] else a for a in container_argv(init, container_env(init))]
    assert argv[0] == "python3" and argv[-1] == str(mnt / endpoint)
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
    own = mnt / "ep-a"  # endpoint ep-a's mount (Secret l2fs-endpoint-mounts)
    own.mkdir(parents=True)  # the hostPath as DirectoryOrCreate leaves it before any mount
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
