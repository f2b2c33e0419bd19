"""File safety in the worker's data dir, against real `l2fs master`/`worker` processes.

In plugin mode vLLM pods mount the worker's data dir read-write, so anything a pod can plant in
`<data-dir>/tmp` (a symlink or hard link to a file outside, a file at the next temp name) must never be
served, adopted or written through, and the CRC a short-circuit writer names must match the bytes.
Each attack here worked on the code before the fix (the worker followed links and believed the CRC).
"""

from __future__ import annotations

import os
import socket
import struct
import uuid
from pathlib import Path
from typing import Any

import crc32c
import grpc
import pytest
from reliability_faults import DEADLINE
from test_reliability_security import TOKEN, _data_address, _dp

from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

MD = (("authorization", f"Bearer {TOKEN}"),)
SECRET = b"root-only secret outside the data dir\n" * 8


def _setup(make_cluster: Any, tmp_path: Path) -> tuple[Any, pbg.WorkerStub, str, Path]:
    """A one-worker cluster with a token, the worker's stub, its data-plane address and a 0600 file
    outside the data dir (the target of the planted links)."""
    cluster = make_cluster(workers=1, token=TOKEN, block_key=False)  # token mode: raw calls with the token (capabilities: tests/l2fs/test_l2fs_capabilities.py)
    c = cluster.client(timeout=DEADLINE, short_circuit=False)
    assert c.put("/trust/seed", b"seed" * 100) is True
    data_addr, _ = _data_address(cluster.master, "/trust/seed", MD)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    w = pbg.WorkerStub(grpc.insecure_channel(cluster.workers[0].address))
    return cluster, w, data_addr, secret


def _links_in(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_symlink()]


def _assert_not_held(w: pbg.WorkerStub, data_addr: str, bid: str) -> None:
    """Neither transport serves `bid`, and no secret byte comes back."""
    status, rest = _dp(data_addr, b"R", TOKEN.encode(), bid)
    assert status == 1 and SECRET[:20] not in rest, (status, rest[:80])  # NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        list(w.ReadBlock(pb.ReadRequest(block_id=bid), timeout=DEADLINE, metadata=MD))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_planted_link_in_tmp_is_never_adopted_or_served(make_cluster: Any, tmp_path: Path, link: str) -> None:
    """A pod reserves a block, then puts a link to a root-only file at the temp name and adopts it with
    the right size and CRC: refused, the reservation is released, nothing is served."""
    cluster, w, data_addr, secret = _setup(make_cluster, tmp_path)
    bid = uuid.uuid4().hex
    tmp = w.ReserveLocal(pb.ReserveRequest(block_id=bid, size=len(SECRET)), timeout=DEADLINE, metadata=MD).tmp_path
    (os.symlink if link == "symlink" else os.link)(secret, tmp)
    with pytest.raises(grpc.RpcError) as e:
        w.AdoptLocal(pb.AdoptRequest(block_id=bid, path="/trust/steal", size=len(SECRET),
                                     crc32c=crc32c.crc32c(SECRET)), timeout=DEADLINE, metadata=MD)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    _assert_not_held(w, data_addr, bid)
    assert secret.read_bytes() == SECRET and not _links_in(cluster.workers[0].data_dir / "blocks")
    # The reservation was released: the same id can be written normally (over the data plane).
    assert _dp_write(data_addr, bid, "/trust/after", b"fine")[0] == 0


def _dp_write(address: str, bid: str, path: str, data: bytes) -> tuple[int, bytes]:
    """A raw data-plane write; returns (first refusal status or the final status, rest)."""
    host, port = address.rsplit(":", 1)
    tok, p = TOKEN.encode(), path.encode()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("<4scH", b"L2D1", b"W", len(tok)) + tok + bid.encode()
                  + struct.pack("<H", len(p)) + p + struct.pack("<Qq", len(data), 0))
        go = s.recv(1, socket.MSG_WAITALL)
        if go != b"\x00":
            return go[0], s.recv(1 << 16)
        s.sendall(data)
        out = s.recv(1 << 16)
        return out[0], out[1:]


@pytest.mark.parametrize("transport", ["data-plane", "grpc"])
def test_write_never_goes_through_a_planted_symlink(make_cluster: Any, tmp_path: Path, transport: str) -> None:
    """A symlink planted at the temp name of the next write: the write is refused and the file the link
    points to keeps its bytes (before the fix it was truncated and overwritten)."""
    cluster, w, data_addr, victim = _setup(make_cluster, tmp_path)
    bid = uuid.uuid4().hex
    os.symlink(victim, cluster.workers[0].data_dir / "tmp" / f"{bid}.part")
    evil = b"overwritten by a data-plane write" * 4
    if transport == "data-plane":
        status, _ = _dp_write(data_addr, bid, "/trust/over", evil)
        assert status != 0
    else:
        with pytest.raises(grpc.RpcError) as e:
            w.WriteBlock(iter([pb.WriteChunk(block_id=bid, path="/trust/over", size=len(evil), data=evil)]),
                         timeout=DEADLINE, metadata=MD)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert victim.read_bytes() == SECRET
    _assert_not_held(w, data_addr, bid)
    assert not _links_in(cluster.workers[0].data_dir / "blocks")


def test_adopt_recomputes_the_crc(make_cluster: Any, tmp_path: Path) -> None:
    """A short-circuit writer naming a CRC that does not match its bytes is refused (before the fix the
    worker published the client's CRC); the right CRC is adopted and served."""
    _, w, data_addr, _ = _setup(make_cluster, tmp_path)
    data = b"short-circuit bytes " * 50
    bid = uuid.uuid4().hex
    tmp = w.ReserveLocal(pb.ReserveRequest(block_id=bid, size=len(data)), timeout=DEADLINE, metadata=MD).tmp_path
    Path(tmp).write_bytes(data)
    with pytest.raises(grpc.RpcError) as e:
        w.AdoptLocal(pb.AdoptRequest(block_id=bid, path="/trust/crc", size=len(data),
                                     crc32c=crc32c.crc32c(b"other bytes")), timeout=DEADLINE, metadata=MD)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "CRC" in (e.value.details() or "")
    status, _ = _dp(data_addr, b"R", TOKEN.encode(), bid)
    assert status == 1  # not held
    good = uuid.uuid4().hex
    tmp = w.ReserveLocal(pb.ReserveRequest(block_id=good, size=len(data)), timeout=DEADLINE, metadata=MD).tmp_path
    Path(tmp).write_bytes(data)
    r = w.AdoptLocal(pb.AdoptRequest(block_id=good, path="/trust/crc", size=len(data), crc32c=crc32c.crc32c(data)),
                     timeout=DEADLINE, metadata=MD)
    assert r.crc32c == crc32c.crc32c(data)
    status, rest = _dp(data_addr, b"R", TOKEN.encode(), good)
    assert status == 0 and rest.endswith(data)
