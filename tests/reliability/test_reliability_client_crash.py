"""Writers killed (-9) in the middle of puts: whatever becomes visible is whole, now and after a restart.

A client can die after writing part of a block (short-circuit temp file or a gRPC / data-plane stream),
or after the worker sealed the block but before the master published it. Neither may ever show a torn
object, and a worker restart (which re-reports sealed blocks) must not surface one either.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from reliability_faults import DEADLINE, check_payload, find_block_files, payload, wait_until

from l2fs.client import Client
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

SIZE = 4 << 20  # large enough that a kill often lands mid-write

WRITER = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[4], sys.argv[4] + "/.."]  # reliability_faults, and the suite's polling it imports
    from l2fs.client import Client
    from reliability_faults import payload
    master, node, sc = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    c = Client(master, node_id=node, timeout=30, short_circuit=sc)
    print("ready", flush=True)
    i = 0
    while True:
        k = f"/crash/{node}-{int(sc)}-{i}"
        c.put(k, payload(i, int(sys.argv[5]), k), if_absent=False)
        i += 1
""")


def _writer(cluster: Any, node: str, short_circuit: bool) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WRITER, cluster.master, node, "1" if short_circuit else "0",
                          str(Path(__file__).resolve().parent), str(SIZE)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _all_whole(client: Any) -> int:
    entries = client.ls("/crash") if client.exists("/crash") else []
    for e in entries:
        data = client.get(e.path)
        if data is not None:  # a miss is fine (e.g. evicted); a torn object is not
            check_payload(data, SIZE, e.path)
    return len(entries)


def test_writers_killed_mid_put_never_publish_torn_objects(make_cluster: Any, record_property: Any) -> None:
    cluster = make_cluster(workers=2)
    reader = cluster.client(node_id=cluster.workers[1].node_id, timeout=DEADLINE, short_circuit=False)
    rng = random.Random(4)
    kills = 0
    for round_ in range(6):
        # Writer on node-1: short-circuit writes to its own worker, or streamed (gRPC / data plane).
        p = _writer(cluster, cluster.workers[0].node_id, short_circuit=round_ % 2 == 0)
        time.sleep(rng.uniform(0.3, 1.2))
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
    visible = _all_whole(reader)
    # Worker restarts re-report every sealed block; those whose put never committed must stay unpublished.
    for i in range(2):
        cluster.kill_worker(i, signal.SIGKILL)
        cluster.start_worker(i)
    wait_until(lambda: all(w.alive for w in reader.report().workers), 30)
    after = _all_whole(reader)
    record_property("kills", kills)
    record_property("visible_before_after_restart", (visible, after))
    assert visible > 0, "the writers never published anything: the test did not exercise puts"
    # Reservations of killed writers do not leak forever: usage returns to the sealed blocks' bytes.
    used = sum(w.used for w in reader.report().workers)
    record_property("used_after_restart", used)
    assert used <= (after + 2 * kills) * SIZE


def _sealed_uncommitted(cluster: Any, path: str, data: bytes) -> tuple[pbg.MasterStub, str]:
    """What a writer killed between the worker's seal and the master's commit leaves behind."""
    master = pbg.MasterStub(grpc.insecure_channel(cluster.master))
    a = master.Allocate(pb.AllocateRequest(path=path, size=len(data), node_id=cluster.workers[0].node_id),
                        timeout=5)
    worker = pbg.WorkerStub(grpc.insecure_channel(a.worker.address))
    res = worker.WriteBlock(Client._frames(a.block_id, path, memoryview(data), 0, a.worker.capability), timeout=5)
    assert res.crc32c and len(find_block_files([cluster.workers[0].data_dir], data[1000:1064])) == 1
    return master, a.block_id


def _commit(master: pbg.MasterStub, cluster: Any, path: str, bid: str, size: int) -> grpc.StatusCode | None:
    try:
        master.Commit(pb.CommitRequest(path=path, block_id=bid, worker_id=cluster.workers[0].worker_id,
                                       size=size), timeout=5)
    except grpc.RpcError as e:
        return e.code()
    return None


def test_sealed_uncommitted_block_never_surfaces_after_worker_restart(make_cluster: Any) -> None:
    cluster = make_cluster(workers=1)
    c = cluster.client(timeout=DEADLINE, short_circuit=False)
    path, data = "/crash/sealed-only", payload(7, 256 << 10, "/crash/sealed-only")
    master, bid = _sealed_uncommitted(cluster, path, data)
    assert not c.exists(path)
    cluster.kill_worker(0, signal.SIGKILL)
    cluster.start_worker(0)
    wait_until(lambda: all(w.alive for w in c.report().workers), 30)
    assert not c.exists(path) and c.get(path) is None  # re-reported, refused, deleted
    wait_until(lambda: not find_block_files([cluster.workers[0].data_dir], data[1000:1064]), 10)
    assert _commit(master, cluster, path, bid, len(data)) == grpc.StatusCode.FAILED_PRECONDITION
    assert c.put(path, data) is True and c.get(path) == data  # the path itself is fine


@pytest.mark.parametrize("ttl", [2])
def test_expired_allocation_is_deleted_and_its_late_commit_refused(make_cluster: Any, ttl: int) -> None:
    cluster = make_cluster(workers=1, master_args=["--allocation-ttl", str(ttl)])
    c = cluster.client(timeout=DEADLINE, short_circuit=False)
    path, data = "/crash/late", payload(8, 256 << 10, "/crash/late")
    master, bid = _sealed_uncommitted(cluster, path, data)
    assert c.put("/crash/normal", data) is True  # a put that commits in time is untouched by the sweep
    assert len(find_block_files([cluster.workers[0].data_dir], data[1000:1064])) == 2
    wait_until(lambda: len(find_block_files([cluster.workers[0].data_dir], data[1000:1064])) == 1, ttl + 10)
    assert _commit(master, cluster, path, bid, len(data)) == grpc.StatusCode.FAILED_PRECONDITION
    assert not c.exists(path) and c.get("/crash/normal") == data
