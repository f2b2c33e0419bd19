"""Corruption of stored blocks: bit flips, truncation, extension, deletion behind the worker's back.

A damaged block is detected on read, reported as a miss (never returned), and dropped from the
namespace so lookups stop claiming it; the path can then be written again.
LMCache-level "output identical to a recompute under corruption" lives in the connector suite.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from reliability_faults import (
    DEADLINE,
    SLACK,
    check_payload,
    find_block_files,
    flip_bit,
    payload,
    timed,
    truncate,
    wait_until,
)

SIZE = 512 * 1024


def _block_file(cluster: Any, worker: int, data: bytes) -> Path:
    """The one file on the worker's disk that holds `data` (found by content, not by layout)."""
    needle = data[SIZE // 3 : SIZE // 3 + 64]
    hits = find_block_files([cluster.workers[worker].data_dir], needle)
    assert len(hits) == 1, f"expected one block file holding the payload, found {hits}"
    return hits[0]


def _damage(path: Path, how: str) -> None:
    if how == "flip-first":
        flip_bit(path, 0)
    elif how == "flip-middle":
        flip_bit(path, bit=5)
    elif how == "flip-last":
        flip_bit(path, path.stat().st_size - 1, bit=7)
    elif how == "truncate-half":
        truncate(path)
    elif how == "truncate-zero":
        truncate(path, 0)
    elif how == "extend":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
    elif how == "unlink":
        os.unlink(path)
    else:
        raise ValueError(how)


DAMAGE = ["flip-first", "flip-middle", "flip-last", "truncate-half", "truncate-zero", "extend", "unlink"]


@pytest.fixture(scope="module")
def corrupt_cluster(cluster_factory: Callable[..., Any]) -> Any:
    """One 2-worker cluster shared by the damage cases (each case uses its own paths)."""
    return cluster_factory(2, name="corrupt")


@pytest.mark.parametrize("via", ["tcp", "grpc", "short-circuit"])
@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_block_is_a_miss_and_dropped(corrupt_cluster: Any, how: str, via: str) -> None:
    """Every read path: the raw-TCP data plane, gRPC streaming, and short-circuit local reads."""
    cluster = corrupt_cluster
    owner = cluster.workers[0].node_id
    writer = cluster.client(node_id=owner, timeout=DEADLINE)
    # Short-circuit reads happen on the owner's node; remote reads come from the other node.
    short_circuit = via == "short-circuit"
    reader_node = owner if short_circuit else cluster.workers[1].node_id
    reader = cluster.client(node_id=reader_node, timeout=DEADLINE, short_circuit=short_circuit,
                            data_plane=via == "tcp")
    key = f"/rel/corrupt/{how}-{via}"
    data = payload(1, SIZE, key)
    assert writer.put(key, data) is True
    assert reader.get(key) == data  # sanity: whole before the damage

    _damage(_block_file(cluster, 0, data), how)

    c = timed("get", key, lambda: reader.get(key))
    assert c.error is None, f"a damaged block must read as a miss, not raise: {c.error!r}"
    assert c.result is None, f"{how}: damaged bytes were returned ({len(c.result)} bytes)"
    assert c.seconds <= DEADLINE + SLACK
    buf = bytearray(SIZE + 8192)
    assert reader.get_into(key, buf) is None
    assert reader.get_many([key]) == [None]
    # Detected -> dropped: lookups stop claiming it (so LMCache recomputes instead of retrying forever).
    wait_until(lambda: not reader.exists(key) and reader.prefix_lookup([key]) == 0, 5)
    # The path is writable again and reads back whole.
    data2 = payload(2, SIZE, key)
    assert writer.put(key, data2) is True
    check_payload(reader.get(key), SIZE, key)


def test_grpc_stream_spanning_frames_verifies_at_the_end(corrupt_cluster: Any) -> None:
    """The gRPC read path streams a block frame by frame (4 MiB) instead of buffering it whole, so damage in
    the last frame is only seen after earlier frames were sent: still a miss, and the block is dropped."""
    cluster = corrupt_cluster
    owner = cluster.workers[0].node_id
    writer = cluster.client(node_id=owner, timeout=DEADLINE)
    reader = cluster.client(node_id=cluster.workers[1].node_id, timeout=DEADLINE, short_circuit=False,
                            data_plane=False)
    big = os.urandom(9 << 20)  # three frames
    assert writer.put("/rel/frames/big", big) is True and writer.put("/rel/frames/empty", b"") is True
    assert reader.get("/rel/frames/big") == big
    buf = bytearray(len(big))
    assert reader.get_into("/rel/frames/big", buf) == len(big) and buf == big
    assert reader.get("/rel/frames/empty") == b""
    hits = find_block_files([cluster.workers[0].data_dir], big[-4096:-4032])
    assert len(hits) == 1
    flip_bit(hits[0], len(big) - 10, bit=1)
    assert reader.get("/rel/frames/big") is None
    wait_until(lambda: not reader.exists("/rel/frames/big"), 5)


def test_corruption_while_worker_down_is_caught_after_restart(make_cluster: Any) -> None:
    """Damage done while the worker is stopped (e.g. a bad disk) is caught when it serves again."""
    cluster = make_cluster(workers=2)
    owner = cluster.workers[0].node_id
    writer = cluster.client(node_id=owner, timeout=DEADLINE)
    reader = cluster.client(node_id=cluster.workers[1].node_id, timeout=DEADLINE, short_circuit=False)
    keys = [f"/rel/offline/{i}" for i in range(4)]
    blobs = {k: payload(i, SIZE, k) for i, k in enumerate(keys)}
    for k, d in blobs.items():
        assert writer.put(k, d) is True
    victims = {keys[0]: _block_file(cluster, 0, blobs[keys[0]]), keys[1]: _block_file(cluster, 0, blobs[keys[1]])}
    cluster.kill_worker(0, signal.SIGKILL)
    flip_bit(victims[keys[0]], bit=3)
    truncate(victims[keys[1]], 100)
    cluster.start_worker(0)
    wait_until(lambda: reader.exists(keys[2]) and reader.exists(keys[3]), 30)
    for k in keys[:2]:
        got = reader.get(k)
        assert got is None, f"{k}: corrupted on disk while the worker was down, yet returned"
    for k in keys[2:]:
        assert reader.get(k) == blobs[k]
    wait_until(lambda: reader.prefix_lookup(keys[:1]) == 0 and not reader.exists(keys[1]), 5)


def test_bulk_random_bit_flips_never_return_wrong_bytes(make_cluster: Any, record_property: Any) -> None:
    """Flip one random bit in each of 20 blocks at random offsets; not one wrong byte may come back."""
    cluster = make_cluster(workers=1)
    c = cluster.client(node_id=cluster.workers[0].node_id, timeout=DEADLINE, short_circuit=False)
    keys = [f"/rel/bulk/{i}" for i in range(20)]
    blobs = {k: payload(i, 64 * 1024, k) for i, k in enumerate(keys)}
    for k, d in blobs.items():
        assert c.put(k, d) is True
    for i, k in enumerate(keys):
        hits = find_block_files([cluster.workers[0].data_dir], blobs[k][20000:20064])
        assert len(hits) == 1
        flip_bit(hits[0], seed=i + 1, bit=i % 8)
    results = c.get_many(keys)
    wrong = [k for k, r in zip(keys, results, strict=True) if r is not None]
    record_property("returned_despite_flip", len(wrong))
    assert not wrong, f"{len(wrong)} bit-flipped blocks were returned: {wrong[:3]}"
