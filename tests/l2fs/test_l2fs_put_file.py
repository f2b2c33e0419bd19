"""`Client.put_file`: a put of a file's bytes from a mapping of the file (the passthrough mount publishes its
writers' temp files with it). Real master and workers; the file is an unlinked temp file as the mount's are."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import crc32c
import pytest

from l2fs.client import Client, QuotaExceeded, Unavailable
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster

MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    return {"capacity": "1G", "master_args": ["--prefix-quota", "/quota=1MiB"]}


def _tmpfile(where: Path, data: bytes) -> int:
    fd = os.open(where, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.pwrite(fd, data, 0)
    return fd


def test_put_file_publishes_the_files_bytes_and_reports_refusals(cluster: LocalCluster, tmp_path: Path) -> None:
    """Same node and another node, put-if-absent as put, an empty file; a refused put (over a prefix quota, or
    no master at all) raises the client's own error, not the mapping's BufferError (a raised error's traceback
    holds the frames that hold views of the mapping, so closing it fails), and the file can be put again."""
    data = os.urandom(5 * MIB + 3)
    fd = _tmpfile(tmp_path, data)
    try:
        for node in ("node-1", "node-elsewhere"):
            with cluster.client(node_id=node) as c:
                assert c.put_file(f"/pf/{node}", fd) is True
                assert c.put_file(f"/pf/{node}", fd) is False
                assert c.put_file(f"/pf/{node}", fd, if_absent=False) is True
                assert c.get(f"/pf/{node}") == data
                assert c.stat(f"/pf/{node}").crc32c == crc32c.crc32c(data)
        with cluster.client(node_id="node-1") as c:
            with pytest.raises(QuotaExceeded):
                c.put_file("/quota/big", fd)
            assert c.get("/quota/big") is None
            assert c.put_file("/pf/after-refusal", fd) is True
            assert c.get("/pf/after-refusal") == data
        with Client(f"127.0.0.1:{free_port()}", timeout=0.5) as dead:
            with pytest.raises(Unavailable):
                dead.put_file("/pf/nowhere", fd)
    finally:
        os.close(fd)
    empty = _tmpfile(tmp_path, b"")
    try:
        with cluster.client(node_id="node-1") as c:
            assert c.put_file("/pf/empty", empty) is True
            assert c.get("/pf/empty") == b""
    finally:
        os.close(empty)
