"""Real l2fs across network namespaces: the master in the control namespace, one worker per node bound to
its node's address, clients started inside nodes. Checks what loopback hides: every listening port is on
the node's address, a cross-node read crosses the link (veth counters and the worker's metrics), the
short-circuit is taken only by a client on the worker's own node, and a partition is a miss that heals."""

from __future__ import annotations

import os
import re
import signal
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns_helpers import require_host
from polling import wait_until

from l2fs import procs
from l2fs.client import Client
from l2fs.testing.netns import NetnsCluster, Where

ROOT = Path(__file__).resolve().parents[2]
PY = [sys.executable, "-m", "l2fs.cli"]


@dataclass
class Cluster:
    net: NetnsCluster
    master: str                 # ctl address:port, as nodes reach it
    host_master: str            # 127.0.0.1:port through the forwarder, for the test process
    workers: list[dict]         # port-file contents per node


def _spawn(c: NetnsCluster, where: Where, name: str, args: list[str], base: Path) -> dict:
    port_path = base / f"{name}.port"
    log = base / f"{name}.log"
    p = c.spawn(where, [*PY, *args, "--port-file", str(port_path)], log, cwd=ROOT)
    return procs.wait_ready(p, procs.port_file(port_path), timeout=30, what=f"l2fs {name}", log_path=log,
                            interval=0.05)


@pytest.fixture(scope="module")
def l2fs_netns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module (process start-up is most of the cost); tests undo their faults."""
    require_host()
    tmp_path = tmp_path_factory.mktemp("l2fs-netns")
    with NetnsCluster(2) as c:
        m = _spawn(c, "ctl", "master", ["master", "--host", c.ctl.addr, "--port", "0", "--metrics-port", "0",
                                        "--heartbeat-timeout", "5"], tmp_path)
        master = f"{c.ctl.addr}:{m['port']}"
        workers = [_spawn(c, n, f"worker-{k}", ["worker", "--master", master, "--host", n.addr, "--port", "0",
                                               "--data-dir", str(tmp_path / f"data-{k}"), "--node-id", n.name,
                                               "--metrics-port", "0", "--heartbeat-interval", "0.5"], tmp_path)
                   for k, n in enumerate(c.nodes, start=1)]
        host_master = c.forward(m["port"]).address
        with Client(host_master) as cl:
            wait_until(lambda: sum(w.alive for w in cl.report().workers) >= 2, 20, 0.1,
                       message="workers did not register across namespaces")
        yield Cluster(c, master, host_master, workers)


def _listeners(c: NetnsCluster, where: Where) -> dict[int, str]:
    """port -> local host of every listening TCP socket in the namespace (gRPC's v4-mapped form unmapped)."""
    out = c.run(where, ["ss", "-ltnH"], text=True).stdout
    found = {}
    for line in out.splitlines():
        host, _, port = line.split()[3].rpartition(":")
        found[int(port)] = re.sub(r"^\[::ffff:(.*)\]$", r"\1", host)
    return found


def _l2fs(cl: Cluster, where: Where, *args: str, data: bytes | None = None) -> tuple[int, bytes]:
    r = cl.net.run(where, [*PY, *args, "--master", cl.master, "--node-id", cl.net.ns(where).name],
                   input=data, check=False, cwd=ROOT, env={**os.environ, "L2FS_TOKEN": ""})
    return r.returncode, r.stdout


def _bytes_read(cl: Cluster, k: int) -> float:
    """Worker k's l2fs_worker_bytes_read_total (bytes it served over gRPC or its data plane)."""
    c = cl.net
    fwd = c.forward(cl.workers[k - 1]["metrics_port"], where=k)
    text = urllib.request.urlopen(f"http://{fwd.address}/metrics", timeout=5).read().decode()
    fwd.close()
    m = re.search(r"^l2fs_worker_bytes_read_total (\S+)$", text, re.M)
    assert m, "worker metrics lack l2fs_worker_bytes_read_total"
    return float(m.group(1))


def test_every_port_binds_the_node_address(l2fs_netns: Cluster) -> None:
    cl = l2fs_netns
    c = cl.net
    with Client(cl.host_master) as client:
        addrs = {w.node_id: w.address for w in client.report().workers}
    for k, n in enumerate(c.nodes, start=1):
        w = cl.workers[k - 1]
        assert addrs[n.name] == f"{n.addr}:{w['port']}", "the master gives clients an address others can't reach"
        assert w["data_address"].rpartition(":")[0] == n.addr
        listening = _listeners(c, n)
        data_port = int(w["data_address"].rpartition(":")[2])
        assert {w["port"], data_port, w["metrics_port"]} <= set(listening), listening
        assert set(listening.values()) == {n.addr}, f"{n.name} binds elsewhere: {listening}"
    assert set(_listeners(c, "ctl").values()) == {c.ctl.addr}


def test_cross_node_read_crosses_the_link_and_short_circuit_is_node_local(l2fs_netns: Cluster) -> None:
    cl = l2fs_netns
    c = cl.net
    data = os.urandom(3 * 1024 * 1024 + 17)
    rc, out = _l2fs(cl, 1, "put", "-", "/netns/blob", data=data)
    assert rc == 0, out
    with Client(cl.host_master) as client:
        info = client.stat("/netns/blob")
    assert info is not None and info.nodes == ["node-1"]  # local-first placement on the writer's node

    # node-2 reads node-1's block: over the link, served by worker-1
    served0, s1, s2 = _bytes_read(cl, 1), c.link_stats(1), c.link_stats(2)
    rc, out = _l2fs(cl, 2, "cat", "/netns/blob")
    assert rc == 0 and out == data
    served1, t1, t2 = _bytes_read(cl, 1), c.link_stats(1), c.link_stats(2)
    assert served1 - served0 >= len(data)
    assert t1["tx_bytes"] - s1["tx_bytes"] >= len(data), "node-1 did not send the block over its link"
    assert t2["rx_bytes"] - s2["rx_bytes"] >= len(data), "node-2 did not receive the block over its link"

    # node-1 reads its own block: short-circuit from disk, nothing served, only control traffic on the link
    rc, out = _l2fs(cl, 1, "cat", "/netns/blob")
    assert rc == 0 and out == data
    assert _bytes_read(cl, 1) == served1
    assert c.link_stats(1)["tx_bytes"] - t1["tx_bytes"] < len(data) // 4


def test_partition_between_nodes_is_a_miss_and_heals(l2fs_netns: Cluster) -> None:
    cl = l2fs_netns
    c = cl.net
    data = os.urandom(256 * 1024)
    assert _l2fs(cl, 1, "put", "-", "/netns/part", data=data)[0] == 0
    c.partition(1, 2)
    rc, out = _l2fs(cl, 2, "cat", "/netns/part", "--timeout", "2")
    assert rc == 1 and out == b""  # node-2 still reaches the master, but not node-1's worker: a miss
    c.heal(1, 2)
    rc, out = _l2fs(cl, 2, "cat", "/netns/part")
    assert rc == 0 and out == data


@pytest.mark.fuse
def test_node2_mount_reads_node1_file_over_the_link(l2fs_netns: Cluster, tmp_path: Path) -> None:
    """node-2's FUSE mount (its daemon in node-2's network namespace only) is visible to every process,
    and a read through it of node-1's file crosses node-2's link."""
    import shutil

    from l2fs.fuse import mount_type

    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    cl = l2fs_netns
    c = cl.net
    data = os.urandom(2 * 1024 * 1024 + 5)
    assert _l2fs(cl, 1, "put", "-", "/netns/viamount", data=data)[0] == 0
    mp = tmp_path / "mnt-node-2"
    mp.mkdir()
    p = c.spawn(2, [*PY, "mount", str(mp), "--master", cl.master, "--node-id", "node-2"], tmp_path / "mount.log",
                cwd=ROOT)
    c.register_mount(mp)
    procs.wait_ready(p, lambda: mount_type(mp) == "fuse.l2fs", timeout=20, what="l2fs mount in node-2",
                     log_path=tmp_path / "mount.log", interval=0.05)
    try:
        served0, s2 = _bytes_read(cl, 1), c.link_stats(2)
        assert (mp / "netns" / "viamount").read_bytes() == data  # read by this (host) process
        assert _bytes_read(cl, 1) - served0 >= len(data)
        assert c.link_stats(2)["rx_bytes"] - s2["rx_bytes"] >= len(data)
    finally:
        procs.stop(p, sig=signal.SIGTERM, grace=10)
    assert mount_type(mp) is None


def test_worker_on_any_address_advertises_its_node_address(tmp_path: Path) -> None:
    require_host()
    with NetnsCluster(1) as c:
        m = _spawn(c, "ctl", "master", ["master", "--host", c.ctl.addr, "--port", "0"], tmp_path)
        w = _spawn(c, 1, "worker", ["worker", "--master", f"{c.ctl.addr}:{m['port']}", "--host", "0.0.0.0",
                                    "--port", "0", "--data-dir", str(tmp_path / "data"), "--node-id", "node-1"],
                   tmp_path)
        assert w["data_address"] == f"{c.nodes[0].addr}:{w['data_address'].rpartition(':')[2]}"
