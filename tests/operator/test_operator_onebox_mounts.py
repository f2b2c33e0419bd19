"""The one-box cluster's mounts (kubelet_sim.OneBox): a node path that a crash-looping privileged pod leaves a
dead FUSE mount on at every run (as a SIGKILLed FUSE daemon does) gains one mount per run in the node and
reaches the node and a HostToContainer pod (mountPropagation), never doubles, never reaches this machine's
own mount table, and is gone with the box; a pod that floods its mount table trips the box's mount guard,
which kills everything at once so waits fail instead of stalling the machine. No vLLM: a few seconds each.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_sim import OneBox, _mounts_under, _own_mounts, box_root

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv")
                       or not Path("/dev/fuse").exists(),
                       reason="needs root, nsenter, setpriv, /dev/fuse (network and mount namespaces)"),
]

# A FUSE "daemon" that mounts and dies at once: its mount stays on the mountpoint, dead (ENOTCONN).
STALE = """
import ctypes, os, sys
fd = os.open("/dev/fuse", os.O_RDWR)
libc = ctypes.CDLL(None, use_errno=True)
opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
if libc.mount(b"onebox-stale", sys.argv[1].encode(), b"fuse.onebox", 0, opts):
    raise OSError(ctypes.get_errno(), "mount " + sys.argv[1])
os._exit(3)
"""


def daemonset(name: str, command: list[str], mounts: list[dict[str, Any]], volumes: list[dict[str, Any]],
              privileged: bool = True) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": name}}, "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 2, "containers": [
                    {"name": name, "image": "busybox", "command": command, "volumeMounts": mounts,
                     "securityContext": {"privileged": privileged}}], "volumes": volumes}}}}


@pytest.fixture
def box() -> Iterator[OneBox]:
    for root in box_root():
        with OneBox(root, {"node-1": {}}, max_pods=4, max_backoff=1, max_mounts=60) as b:
            yield b
        # the machine's table: nothing under the box's root, at its containers' paths or of its kinds
        assert not _mounts_under(root), _mounts_under(root)[:5]
        assert not b.leaked_mounts(), b.leaked_mounts()[:5]
        assert b.cgroup is None or not b.cgroup.exists()


def fuse_mounts(pid: int, where: str) -> int:
    return sum(1 for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
               if line.split()[4] == where and " fuse.onebox " in line)


def test_a_dead_fuse_mount_per_restart_grows_the_node_by_one_not_double(box: OneBox) -> None:
    node = box.nodes[0]
    path = "/mnt/kvtier-onebox-stale"
    vol = [{"name": "mnt", "hostPath": {"path": path, "type": "DirectoryOrCreate"}},
           {"name": "fuse", "hostPath": {"path": "/dev/fuse", "type": "CharDevice"}}]
    box.apply([daemonset("reader", ["sleep", "infinity"],
                         [{"name": "mnt", "mountPath": path, "mountPropagation": "HostToContainer"}], vol[:1], False),
               daemonset("stale", ["python3", "-c", STALE, path],
                         [{"name": "mnt", "mountPath": path, "mountPropagation": "Bidirectional"},
                          {"name": "fuse", "mountPath": "/dev/fuse"}], vol)])
    deadline = time.monotonic() + 90
    while True:
        box.check()
        stale = box.pods_of("stale")
        if stale and stale[0].containers[0].restarts >= 6:
            break
        assert time.monotonic() < deadline, box.describe()
        time.sleep(0.5)
    runs = len(stale[0].containers[0].exits) + 1
    assert node.holder is not None
    host = str(box.host_path(node, path))
    in_node = fuse_mounts(node.holder.pid, host)
    # every run's mount reached the node (Bidirectional), one each: linear, not 2^runs
    assert 6 <= in_node <= runs + 1, (in_node, runs)
    assert _own_mounts(node.holder.pid) <= node.mount_base + runs + 2
    (reader,) = box.pods_of("reader")
    assert reader.containers[0].proc is not None
    seen = fuse_mounts(reader.containers[0].proc.pid, path)
    assert 1 <= seen <= runs + 1, seen  # and the HostToContainer pod, started alongside, sees them
    # this machine's own table never saw any of it
    assert not _mounts_under(box.root) and fuse_mounts(os.getpid(), path) == 0
    assert box.fault is None


def test_the_mount_guard_fails_the_box_fast_and_cleans_up(box: OneBox) -> None:
    target = "/mnt/kvtier-onebox-flood"
    box.apply([daemonset("flood", ["sh", "-c", f"while :; do mount -t tmpfs none {target}; done"],
                         [{"name": "x", "mountPath": target}], [{"name": "x", "emptyDir": {}}])])
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="mount guard"):
        box.wait_ready("flood-never-ready", timeout=120)
    assert time.monotonic() - t0 < 60
    # everything of the box was killed: the node's namespace and the pod's processes
    # (SIGKILLed at once; their exits reaped within moments, however loaded the machine)
    deadline = time.monotonic() + 15
    while not (all(n.holder is not None and n.holder.poll() is not None for n in box.nodes)
               and all(c.proc is None or c.proc.poll() is not None for p in box.pods for c in p.containers)):
        assert time.monotonic() < deadline, box.describe()
        time.sleep(0.1)
