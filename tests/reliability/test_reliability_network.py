"""Network faults between nodes: real partitions and a real link going down, between network namespaces.

Layout (one cluster for the module, `l2fs.testing.netns` + `LocalCluster(netns=...)`): the master in the control
namespace, worker-1 on node-1, worker-2 on node-2, and the client under test as its own process on node-3
(`node_client.NodeClient`: only a process inside the node meets the node's network). Faults are routes of
kind blackhole (packets silently dropped: connects and reads hang until the deadline) or prohibit (refused at
once) between two namespaces only, and `ip link set eth0 down` of a node.

What must hold: every call ends within its deadline as a miss (reads) or an l2fs error (writes, metadata);
a partition the master cannot see (client <-> workers) leaves metadata working; a node whose link goes
down is dropped by the master within its heartbeat timeout and taken back, with its blocks, once the link
is up; everything reads back whole once healed. Each test undoes its fault (the cluster is shared).

Loopback variant kept: `test_client_worker_connections_reset_loopback` (a TCP FaultProxy that sends RST on
every open and new connection). Routes cannot do that: a route change leaves established connections
silently dead, never reset, and this box has no nftables to inject resets. Worker SIGKILL/SIGSTOP stay in
test_reliability_worker_faults.py on loopback: they are process faults, not link faults.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from node_client import NodeClient, RemoteCall
from reliability_faults import (
    DEADLINE,
    SLACK,
    FaultProxy,
    check_payload,
    free_loopback_port,
    payload,
    timed,
    wait_until,
)

from l2fs.client import L2fsError
from l2fs.testing.cluster import LocalCluster
from l2fs.testing.netns import NetnsCluster, NetnsError, check_host

SIZE = 256 * 1024
DEAD_AFTER = 3.0  # the master's heartbeat timeout here
CLIENT_NODE = 3   # the node of the client under test: no worker of its own


@pytest.fixture(scope="module")
def netns_l2fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NetnsCluster, LocalCluster]]:
    """3 nodes: workers on node-1 and node-2, node-3 for clients; the master in the control namespace."""
    try:
        check_host()
    except NetnsError as e:
        pytest.skip(str(e))
    base = tmp_path_factory.mktemp("netns-rel")
    with NetnsCluster(3) as net, LocalCluster(base, workers=2, netns=net, heartbeat_timeout=DEAD_AFTER,
                                              heartbeat_interval=0.5) as cluster:
        yield net, cluster


def _bounded(call: RemoteCall) -> float:
    assert call.seconds <= DEADLINE + SLACK, f"{call.op} took {call.seconds:.2f}s with a {DEADLINE}s deadline: {call}"
    return call.seconds


def _get_whole(c: NodeClient, key: str, within: float) -> None:
    """Once healed, key reads back whole from the node within `within` seconds."""
    wait_until(lambda: c.call("get", key).result is not None, within, interval=0.1)
    check_payload(c.call("get", key).result, SIZE, key)


@pytest.mark.parametrize("kind", ["blackhole", "prohibit"])
def test_client_worker_partition(netns_l2fs: tuple[NetnsCluster, LocalCluster], kind: str,
                                 record_property: Any) -> None:
    """node-3 cut from both worker nodes, still reaching the master: the partition the master cannot see
    (the workers keep heartbeating), so only the client's deadlines protect the caller."""
    net, cluster = netns_l2fs
    keys = [f"/net/w-{kind}/{i}" for i in range(3)]
    with NodeClient(net, CLIENT_NODE, cluster.master, timeout=DEADLINE) as c:
        for i, k in enumerate(keys):
            assert c.call("put", k, payload(i, SIZE, k)).result is True
        assert all(c.call("get", k).result is not None for k in keys)
        try:
            for w in (1, 2):
                net.partition(CLIENT_NODE, w, kind=kind)
            worst = 0.0
            for k in keys:
                call = c.call("get", k)
                assert call.error is None and call.result is None, call  # a miss, not an error
                worst = max(worst, _bounded(call))
            call = c.call("put", f"/net/w-{kind}/new", payload(9, SIZE, "/net/new"))
            assert call.l2fs_error, call
            worst = max(worst, _bounded(call))
            assert c.call("prefix_lookup", keys).result == len(keys)  # the master is reachable
            with cluster.client() as host:
                assert sum(w.alive for w in host.report().workers) == 2  # and sees nothing wrong
            record_property("worst_call_s", round(worst, 2))
        finally:
            for w in (1, 2):
                net.heal(CLIENT_NODE, w)
        t0 = time.monotonic()
        for k in keys:
            _get_whole(c, k, 10)
        record_property("heal_s", round(time.monotonic() - t0, 2))


@pytest.mark.parametrize("kind", ["blackhole", "prohibit"])
def test_client_master_partition(netns_l2fs: tuple[NetnsCluster, LocalCluster], kind: str) -> None:
    """node-3 cut from the control namespace (the master) only: reads are misses, metadata and writes
    l2fs errors, each within the deadline; after healing the same client reads the object whole."""
    net, cluster = netns_l2fs
    k = f"/net/m/{kind}"
    with NodeClient(net, CLIENT_NODE, cluster.master, timeout=DEADLINE) as c:
        assert c.call("put", k, payload(1, SIZE, k)).result is True
        try:
            net.partition(CLIENT_NODE, "ctl", kind=kind)
            for op, args in (("get", [k]), ("exists", [k]), ("prefix_lookup", [[k]]), ("put", [k + "x", b"y" * 100])):
                call = c.call(op, *args)
                _bounded(call)
                if op == "get":
                    assert call.error is None and call.result is None, call
                else:
                    assert call.l2fs_error, call
        finally:
            net.heal(CLIENT_NODE, "ctl")
        _get_whole(c, k, 30)  # generous: gRPC reconnects with backoff after the partition


def test_node_link_down_is_dropped_then_taken_back(netns_l2fs: tuple[NetnsCluster, LocalCluster],
                                                   record_property: Any) -> None:
    """node-1's link goes down: the master drops worker-1 within its heartbeat timeout, node-3's reads of
    worker-1's blocks are misses within the deadline, writes go to worker-2; link up: worker-1 comes back
    with its blocks, all whole."""
    net, cluster = netns_l2fs
    keys = [f"/net/link/{i}" for i in range(6)]
    with NodeClient(net, 1, cluster.master, timeout=DEADLINE) as writer, \
            NodeClient(net, CLIENT_NODE, cluster.master, timeout=DEADLINE) as reader, cluster.client() as host:
        for i, k in enumerate(keys):
            assert writer.call("put", k, payload(i, SIZE, k)).result is True
        assert all(host.stat(k).nodes == ["node-1"] for k in keys)  # local-first: all on the victim's node

        def worker1_alive() -> bool | None:
            return next((w.alive for w in host.report().workers if w.node_id == "node-1"), None)

        try:
            net.link_down(1)
            t0 = time.monotonic()
            call = reader.call("get", keys[0])  # before detection the master still points at node-1
            assert call.error is None and call.result is None, call
            _bounded(call)
            wait_until(lambda: worker1_alive() is not True, DEAD_AFTER + 10, interval=0.1)
            detect = time.monotonic() - t0
            record_property("detect_s", round(detect, 2))
            assert detect <= DEAD_AFTER + SLACK, f"worker-1 dropped {detect:.2f}s after its link went down"
            assert host.prefix_lookup(keys) == 0, "the master still points at the unreachable node"
            for k in keys[1:3]:
                call = reader.call("get", k)
                assert call.error is None and call.result is None, call
                _bounded(call)
            k_new = "/net/link/during"
            assert reader.call("put", k_new, payload(7, SIZE, k_new)).result is True
            assert host.stat(k_new).nodes == ["node-2"]
        finally:
            net.link_up(1)
        t1 = time.monotonic()
        wait_until(lambda: host.prefix_lookup(keys) == len(keys), 30, interval=0.1)
        record_property("link_up_to_readable_s", round(time.monotonic() - t1, 2))
        for k in keys:
            check_payload(reader.call("get", k).result, SIZE, k)


def test_client_worker_connections_reset_loopback(make_cluster: Any, record_property: Any) -> None:
    """Loopback on purpose: every open and new client <-> worker connection is reset (RST) by a TCP proxy,
    which no route in the namespace cluster can do. Calls end within the deadline; all reads back once healed."""
    # The worker advertises 127.0.0.2 (still loopback): its gRPC port and its raw-TCP data port are both
    # reached through proxies there, so every byte between client and worker crosses a FaultProxy.
    data_port = free_loopback_port()
    proxy = FaultProxy("127.0.0.1:1", listen=("127.0.0.2", 0))  # target set once the worker's port is known
    data_proxy = FaultProxy(f"127.0.0.1:{data_port}", listen=("127.0.0.2", data_port))
    proxies = (proxy, data_proxy)
    try:
        cluster = make_cluster(workers=1, worker_args=["--advertise", proxy.address, "--data-port", str(data_port)])
        proxy.target = ("127.0.0.1", cluster.workers[0].port)
        c = cluster.client(node_id="elsewhere", timeout=DEADLINE, short_circuit=False)
        keys = [f"/net/reset/{i}" for i in range(3)]
        for i, k in enumerate(keys):
            assert c.put(k, payload(i, SIZE, k)) is True
        assert all(c.get(k) is not None for k in keys)

        for p in proxies:
            p.set_mode("drop")
        worst = 0.0
        for k in keys:
            call = timed("get", k, lambda k=k: c.get(k))
            assert call.error is None and call.result is None, call
            worst = max(worst, call.seconds)
        call = timed("put", "/net/new", lambda: c.put("/net/reset/new", payload(9, SIZE, "/net/new")))
        assert isinstance(call.error, L2fsError), call
        worst = max(worst, call.seconds)
        assert c.prefix_lookup(keys) == len(keys)  # metadata is unaffected: the master is reachable
        record_property("worst_call_s", round(worst, 2))
        assert worst <= DEADLINE + SLACK, f"a call took {worst:.2f}s while connections were reset"

        for p in proxies:
            p.set_mode("pass")
        wait_until(lambda: c.get(keys[0]) is not None, 10, interval=0.1)
        for k in keys:
            check_payload(c.get(k), SIZE, k)
    finally:
        for p in proxies:
            p.close()
