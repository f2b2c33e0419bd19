"""32 concurrent writers of one key plus readers of it.

Exactly one version is published (exactly one put returns True, the rest are successful no-ops);
every read sees nothing or one whole object, and once a reader has seen a version it never sees
another. Writers come from separate processes as well as threads, through both write paths
(short-circuit on the worker's node and streamed over gRPC from the other node).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

from reliability_faults import DEADLINE, check_payload, files_under, payload, wait_until

SIZE = 1 << 20
WRITERS = 32
READERS = 8


def _proc_writer(master: str, node: str, ids: list[int], key: str, out: Any) -> None:
    """Writer process: several put attempts of distinct objects to the same key."""
    from l2fs.client import Client

    with Client(master, node_id=node, timeout=10.0) as c:
        for i in ids:
            try:
                out.put((i, c.put(key, payload(i, SIZE, key)), None))
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test on it
                out.put((i, None, repr(e)))


def test_32_writers_one_key_exactly_one_version(make_cluster: Any, record_property: Any) -> None:
    cluster = make_cluster(workers=2)
    key = "/rel/race/one"
    nodes = [w.node_id for w in cluster.workers]
    clients = [cluster.client(node_id=nodes[i % 2], timeout=10.0, short_circuit=bool(i % 3)) for i in range(4)]
    readers = [cluster.client(node_id=nodes[i % 2], timeout=DEADLINE) for i in range(2)]

    results: dict[int, Any] = {}
    seen: list[list[int]] = [[] for _ in range(READERS)]
    errors: list[str] = []
    start = threading.Barrier(WRITERS // 2 + READERS + 1)
    done = threading.Event()

    def write(i: int) -> None:
        start.wait()
        try:
            results[i] = clients[i % 4].put(key, payload(i, SIZE, key))
        except Exception as e:  # noqa: BLE001 - any failure here is reported, never fatal
            errors.append(f"writer {i}: {e!r}")

    def read(r: int) -> None:
        start.wait()
        c = readers[r % 2]
        while True:
            stop = done.is_set()  # one more full read after the writers finished
            try:
                data = c.get(key)
                if data is not None:
                    seen[r].append(check_payload(data, SIZE, key))
            except AssertionError as e:
                errors.append(f"reader {r}: {e}")
                return
            if stop:
                return

    # Half the writers are threads in this process, half live in two separate processes.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_proc_writer, args=(cluster.master, nodes[p], list(range(WRITERS // 2 + p, WRITERS, 2)), key, q))
        for p in range(2)
    ]
    for p in procs:
        p.start()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(WRITERS // 2)]
    threads += [threading.Thread(target=read, args=(r,)) for r in range(READERS)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads[: WRITERS // 2]:
        t.join(60)
    for _ in range(WRITERS - WRITERS // 2):
        i, ok, err = q.get(timeout=120)
        results[i] = ok
        if err:
            errors.append(f"writer {i}: {err}")
    for p in procs:
        p.join(30)
    done.set()
    for t in threads[WRITERS // 2 :]:
        t.join(60)

    assert not errors, errors[:5]
    assert len(results) == WRITERS
    winners = [i for i, ok in results.items() if ok is True]
    assert len(winners) == 1, f"{len(winners)} puts claimed to publish: {winners}"
    assert all(ok is False for i, ok in results.items() if i not in winners)
    final = readers[0].get(key)
    assert check_payload(final, SIZE, key) == winners[0]
    for r, versions in enumerate(seen):
        assert set(versions) <= {winners[0]}, f"reader {r} saw versions {sorted(set(versions))}"
    record_property("reads_seen", sum(len(s) for s in seen))
    # Exactly one copy is stored: losers' blocks were not left behind on the workers.
    st = readers[0].stat(key)
    assert st is not None and st.size == SIZE and len(st.nodes) == 1, st

    def big_files() -> int:
        return sum(1 for w in cluster.workers for p in files_under(w.data_dir) if p.stat().st_size >= SIZE)

    # Losers wrote whole blocks that were never published; they must not stay on disk (capacity leak).
    wait_until(lambda: big_files() == 1, 15)


def test_concurrent_overwrite_renames_never_tear(make_cluster: Any) -> None:
    """LMCache's fs connector writes a temp file and renames it over the key: with 16 racing
    tmp+rename publishers, a reader only ever sees one whole object, and the end state is one of them."""
    cluster = make_cluster(workers=2)
    key = "/rel/race/renamed"
    nodes = [w.node_id for w in cluster.workers]
    clients = [cluster.client(node_id=nodes[i % 2], timeout=10.0) for i in range(4)]
    errors: list[str] = []
    done = threading.Event()

    def publish(i: int) -> None:
        c = clients[i % 4]
        tmp = f"{key}.tmp{i}"
        try:
            assert c.put(tmp, payload(i, 256 * 1024, key)) is True
            c.rename(tmp, key, overwrite=True)
        except Exception as e:  # noqa: BLE001 - any failure here is reported, never fatal
            errors.append(f"publisher {i}: {e!r}")

    def read() -> None:
        c = cluster.client(node_id=nodes[1], timeout=DEADLINE)
        while not done.is_set():
            data = c.get(key)
            if data is not None:
                try:
                    check_payload(data, 256 * 1024, key)
                except AssertionError as e:
                    errors.append(f"reader: {e}")
                    return

    rt = [threading.Thread(target=read) for _ in range(4)]
    for t in rt:
        t.start()
    pt = [threading.Thread(target=publish, args=(i,)) for i in range(16)]
    for t in pt:
        t.start()
    for t in pt:
        t.join(60)
    done.set()
    for t in rt:
        t.join(30)
    assert not errors, errors[:5]
    check_payload(clients[0].get(key), 256 * 1024, key)
    leftovers = [e.path for e in clients[0].ls("/rel/race") if ".tmp" in e.path]
    assert not leftovers, leftovers
