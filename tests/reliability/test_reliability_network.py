"""Dropped and black-holed connections between clients and servers (a real TCP proxy in the path).

The worker stays alive for the master (heartbeats bypass the proxy): this is the partition the master
cannot see, so only the client's deadlines protect the caller. Every call must end within its deadline
as a miss (reads) or an l2fs error (writes, metadata), and everything must read back once healed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from reliability_faults import DEADLINE, SLACK, FaultProxy, check_payload, free_loopback_port, payload, timed

from l2fs.client import L2fsError

SIZE = 256 * 1024


@pytest.mark.parametrize("mode", ["blackhole", "drop"])
def test_client_worker_partition(make_cluster: Any, mode: str, record_property: Any) -> None:
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
        keys = [f"/net/{mode}/{i}" for i in range(3)]
        for i, k in enumerate(keys):
            assert c.put(k, payload(i, SIZE, k)) is True
        assert all(c.get(k) is not None for k in keys)

        for p in proxies:
            p.set_mode(mode)
        worst = 0.0
        for k in keys:
            call = timed("get", k, lambda k=k: c.get(k))
            assert call.error is None and call.result is None, call
            worst = max(worst, call.seconds)
        call = timed("put", "/net/new", lambda: c.put(f"/net/{mode}/new", payload(9, SIZE, "/net/new")))
        assert isinstance(call.error, L2fsError), call
        worst = max(worst, call.seconds)
        assert c.prefix_lookup(keys) == len(keys)  # metadata is unaffected: the master is reachable
        record_property("worst_call_s", round(worst, 2))
        assert worst <= DEADLINE + SLACK, f"a call took {worst:.2f}s during a {mode} partition"

        for p in proxies:
            p.set_mode("pass")
        t0 = time.monotonic()
        while c.get(keys[0]) is None and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        for k in keys:
            check_payload(c.get(k), SIZE, k)
        record_property("heal_s", round(time.monotonic() - t0, 2))
    finally:
        for p in proxies:
            p.close()


@pytest.mark.parametrize("mode", ["blackhole", "drop"])
def test_client_master_partition(make_cluster: Any, mode: str) -> None:
    cluster = make_cluster(workers=1)
    with FaultProxy(cluster.master) as proxy:
        from l2fs.client import Client

        c = Client(proxy.address, timeout=DEADLINE)
        k = f"/net/m/{mode}"
        assert c.put(k, payload(1, SIZE, k)) is True
        proxy.set_mode(mode)
        for op, fn in (("get", lambda: c.get(k)), ("exists", lambda: c.exists(k)),
                       ("prefix", lambda: c.prefix_lookup([k])), ("put", lambda: c.put(k + "x", b"y" * 100))):
            call = timed(op, k, fn)
            assert call.seconds <= DEADLINE + SLACK, call
            if op == "get":
                assert call.error is None and call.result is None, call
            else:
                assert isinstance(call.error, L2fsError), call
        proxy.set_mode("pass")
        t0 = time.monotonic()
        data = c.get(k)
        while data is None and time.monotonic() - t0 < 30:  # generous: a loaded box once needed > 10 s
            time.sleep(0.1)
            data = c.get(k)
        if data is None:  # say which side is stuck: this client, or the healed path itself
            fresh = Client(proxy.address, timeout=DEADLINE)
            raise AssertionError(f"still a miss 30 s after healing; a new client through the proxy: "
                                 f"{'hit' if fresh.get(k) is not None else 'miss'}, direct stat: "
                                 f"{cluster.client().stat(k)}")
        check_payload(data, SIZE, k)  # the object the healed path served, whole
        c.close()
