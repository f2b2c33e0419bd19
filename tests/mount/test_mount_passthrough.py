"""`l2fs mount --passthrough` (l2fs/fuse/passthrough.py): reads through FUSE passthrough (writes:
test_mount_passthrough_rw.py). Real processes: a LocalCluster (node-1, node-2) and passthrough mount processes as node-1 and
node-2; the server's own counters (--metrics-port) show whether a READ request ever reached it."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from mount_helpers import Mount, metric

from l2fs import fuse
from l2fs.client import Client
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster

MIB = 1 << 20
SIZES = {"empty.bin": 0, "small.bin": 1000, "one.bin": MIB, "big.bin": 17 * MIB + 3}


class PtMount:
    """A passthrough mount process and its counters."""

    def __init__(self, m: Mount, port: int) -> None:
        self.m, self.port = m, port

    def __truediv__(self, other: str) -> Path:
        return self.m.path / other

    def count(self, name: str) -> float:
        return metric(self.port, f"l2fs_mount_{name}_total")


@pytest.fixture
def pt_mount(mount_factory: Callable[..., Mount], tmp_path: Path) -> Callable[..., PtMount]:
    """pt_mount(master, node, *args): a passthrough mount as `node`; skips where the kernel grants none."""
    def make(master: str, node: str, *args: str) -> PtMount:
        port = free_port()
        cache = tmp_path / f"cache-{node}-{port}"
        cache.mkdir()
        m = mount_factory(master, "--passthrough", "--node-id", node, "--metrics-port", str(port),
                          "--cache-dir", str(cache), *args, name=f"pt-{node}-{port}")
        if "--process-reads" not in args:
            for _ in range(100):  # INIT is answered right after the mount appears
                text = m.log.read_text()
                if "passthrough on" in text or "passthrough off" in text:
                    break
                threading.Event().wait(0.05)
            if "passthrough on" not in m.log.read_text():
                pytest.skip("the kernel grants no FUSE passthrough (needs Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH)")
        return PtMount(m, port)
    return make


@pytest.fixture(scope="module")
def files(cluster: LocalCluster) -> dict[str, bytes]:
    """Files written through node-1 (local-first: their blocks live on node-1's worker)."""
    c = Client(cluster.master, node_id="node-1")
    data = {f"/pt/{name}": os.urandom(size) for name, size in SIZES.items()}
    for p, d in data.items():
        c.put(p, d, if_absent=False)
    c.close()
    return data


def read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_ls_stat_read_same_and_cross_node(cluster: LocalCluster, files: dict[str, bytes],
                                           pt_mount: Callable[..., PtMount]) -> None:
    m1, m2 = pt_mount(cluster.master, "node-1"), pt_mount(cluster.master, "node-2")
    for m in (m1, m2):
        assert sorted(os.listdir(m / "pt")) == sorted(SIZES)
        for p, d in files.items():
            assert os.stat(m / p.lstrip("/")).st_size == len(d)
            assert read(m / p.lstrip("/")) == d, p
        assert m.count("opens_passthrough") == len(files)
        assert m.count("read_requests") == 0  # the kernel read the backing files itself
        assert m.count("opens_process") == 0
    assert m1.count("verified_blocks") == len(files)  # same node: the worker's block files, CRC-checked once
    assert m1.count("cache_fetches") == 0
    assert m2.count("cache_fetches") == len(files)  # cross node: one verified local copy each
    for p, d in files.items():  # a re-read opens the copy again, no fetch, and the same block file is not re-read
        assert read(m2 / p.lstrip("/")) == d
        assert read(m1 / p.lstrip("/")) == d
    assert m2.count("cache_fetches") == len(files) and m2.count("cache_hits") == len(files)
    assert m1.count("verified_blocks") == len(files)
    with pytest.raises(FileNotFoundError):
        os.stat(m1 / "pt/missing.bin")


def test_passthrough_reads_need_no_server(cluster: LocalCluster, files: dict[str, bytes],
                                          pt_mount: Callable[..., PtMount]) -> None:
    """Bytes of a passthrough open come from the kernel: a stopped server does not hold them up."""
    m1 = pt_mount(cluster.master, "node-1")
    want = files["/pt/big.bin"]
    buf = bytearray(len(want) + 1)

    def read_all(f: object) -> None:
        n = 0
        while k := f.readinto(memoryview(buf)[n:]):  # type: ignore[attr-defined]  # raw readinto: no fstat
            n += k
        got.append(n)

    got: list[int] = []
    with open(m1 / "pt/big.bin", "rb", buffering=0) as f:
        os.kill(m1.m.proc.pid, signal.SIGSTOP)
        try:
            t = threading.Thread(target=read_all, args=(f,), daemon=True)
            t.start()
            t.join(20)
            finished_while_stopped = not t.is_alive()
        finally:
            os.kill(m1.m.proc.pid, signal.SIGCONT)
        t.join(20)
    assert finished_while_stopped, "the read waited for the server: not passthrough"
    assert got == [len(want)] and buf[:len(want)] == want


def test_fallback_reads_served_by_the_process(cluster: LocalCluster, files: dict[str, bytes],
                                              pt_mount: Callable[..., PtMount]) -> None:
    m1, m2 = (pt_mount(cluster.master, n, "--process-reads") for n in ("node-1", "node-2"))
    for m in (m1, m2):
        for p, d in files.items():
            assert read(m / p.lstrip("/")) == d, p
        assert m.count("opens_passthrough") == 0
        assert m.count("opens_process") == len(files)
        assert m.count("read_bytes") == sum(len(d) for d in files.values())
        assert m.count("read_requests") >= 18  # 17 MiB in requests of at most 1 MiB


def corrupt_block(cluster: LocalCluster, data: bytes) -> None:
    """Flip one byte of the block file holding `data` on node-1's worker, in place (same size)."""
    for p in (cluster.workers[0].data_dir / "blocks").glob("*/*"):
        if p.is_file() and p.stat().st_size == len(data) and p.read_bytes() == data:
            with open(p, "r+b") as f:
                f.seek(len(data) // 2)
                f.write(bytes([data[len(data) // 2] ^ 0xFF]))
            return
    raise AssertionError("block file not found")


@pytest.mark.parametrize("verify", ["open", "write"])
def test_corrupt_block_is_eio(cluster: LocalCluster, pt_mount: Callable[..., PtMount], verify: str) -> None:
    """A block changed on disk after the write is never served: EIO on the node holding it and on the node
    that fetches it, with either --verify mode."""
    c = Client(cluster.master, node_id="node-1")
    local, remote = os.urandom(3 * MIB), os.urandom(3 * MIB)
    c.put(f"/bad-{verify}/local.bin", local, if_absent=False)
    c.put(f"/bad-{verify}/remote.bin", remote, if_absent=False)
    c.close()
    m1 = pt_mount(cluster.master, "node-1", "--verify", verify)
    m2 = pt_mount(cluster.master, "node-2", "--verify", verify)
    corrupt_block(cluster, local)
    corrupt_block(cluster, remote)
    with pytest.raises(OSError) as e:
        read(m1 / f"bad-{verify}/local.bin")
    assert e.value.errno == errno.EIO
    with pytest.raises(OSError) as e:
        read(m2 / f"bad-{verify}/remote.bin")
    assert e.value.errno == errno.EIO
    assert m1.count("crc_errors") == 1
    assert not any(Path(m2.m.path.parent).glob("cache-node-2-*/*/*remote*"))


def test_cross_node_copies_are_bounded(cluster: LocalCluster, pt_mount: Callable[..., PtMount],
                                       tmp_path: Path) -> None:
    c = Client(cluster.master, node_id="node-1")
    data = {f"/lru/{i}.bin": os.urandom(2 * MIB) for i in range(4)}
    for p, d in data.items():
        c.put(p, d, if_absent=False)
    c.close()
    m2 = pt_mount(cluster.master, "node-2", "--cache-size", "5M")
    for p, d in data.items():
        assert read(m2 / p.lstrip("/")) == d
    copies = [f for f in tmp_path.glob("cache-node-2-*/*/*") if f.is_file()]
    assert sum(f.stat().st_size for f in copies) <= 5 * MIB
    assert m2.count("cache_evictions") >= 2
    assert read(m2 / "lru/0.bin") == data["/lru/0.bin"]  # evicted, fetched again
    assert m2.count("cache_fetches") == 5


def test_unmount_is_clean(cluster: LocalCluster, files: dict[str, bytes], pt_mount: Callable[..., PtMount],
                          tmp_path: Path) -> None:
    m2 = pt_mount(cluster.master, "node-2")
    assert read(m2 / "pt/one.bin") == files["/pt/one.bin"]
    assert any(f.is_file() for f in tmp_path.glob("cache-node-2-*/*/*"))
    assert m2.m.stop() == 0
    assert fuse.mount_type(m2.m.path) is None
    assert not any(tmp_path.glob("cache-node-2-*/*"))  # its cross-node copies are gone with it


def test_sharded_masters(pt_mount: Callable[..., PtMount], make_cluster: Callable[..., LocalCluster]) -> None:
    """With a path-hash sharded namespace (2 masters), each path is looked up on its own shard and
    directories that live on either shard are listed."""
    c = make_cluster(2, capacity="256M", shards=2)
    cl = Client(c.master, node_id="node-1")
    data = {f"/s/{d}/{i}.bin": os.urandom(4096 + i) for d in ("a", "b", "c") for i in range(4)}
    for p, d in data.items():
        cl.put(p, d, if_absent=False)
    cl.close()
    m1, m2 = pt_mount(c.master, "node-1"), pt_mount(c.master, "node-2")
    for m in (m1, m2):
        assert sorted(os.listdir(m / "s")) == ["a", "b", "c"]
        for p, d in data.items():
            assert read(m / p.lstrip("/")) == d, p
        assert m.count("opens_passthrough") == len(data)
    m1.m.stop()
    m2.m.stop()
