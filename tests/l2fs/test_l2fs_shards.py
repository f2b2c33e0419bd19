"""Path-hash sharded namespace: 2 masters (`--shard K/2`) x 2 workers as real processes.

Every master holds only its hash class, refuses another shard's paths, and rebuilds only its shard from the
workers' reports; the client routes, splits batches and fans prefix lookups out; one dead master costs only
its own paths."""

from __future__ import annotations

import errno
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
from l2fs_helpers import wait_until

from l2fs.client import Client, CrossShard, L2fsError, NotFound, Unavailable, WrongShard, combine_prefix
from l2fs.common import (
    BlockKey,
    PathError,
    _norm_path_checked,
    norm_path,
    parse_masters,
    parse_shard,
    shard_of,
)
from l2fs.common.capability import seal_mac
from l2fs.common.protocol import PROTOCOL_VERSION
from l2fs.testing.cluster import LocalCluster
from l2fs.worker.registration import MasterLink
from l2fs.worker.store import Store

N = 2


def _paths(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/chunk-{i:03d}" for i in range(n)]


def _of(paths: list[str], shard: int) -> list[str]:
    return [p for p in paths if shard_of(p, N) == shard]


@pytest.fixture(scope="module")
def sharded(cluster_factory: Callable[..., LocalCluster]) -> LocalCluster:
    return cluster_factory(2, name="l2fs-shards", capacity="256M", shards=N, heartbeat_timeout=4.0)


def _direct(cluster: LocalCluster, shard: int, **kw: object) -> Client:
    """A client that believes shard `shard`'s master is the whole namespace (a misconfigured one)."""
    return Client(f"127.0.0.1:{cluster.master_ports[shard]}", **kw)  # type: ignore[arg-type]


def _listed(c: Client, path: str) -> set[str]:
    """The paths listed under `path`; none while a restarted master has not heard of it yet."""
    try:
        return {i.path for i in c.ls(path)}
    except NotFound:
        return set()


# ---------- in-process pieces ----------

@pytest.mark.unit
def test_control_characters_rejected_exactly_as_before() -> None:
    """norm_path's compiled check refuses exactly the characters the per-character generator did."""
    for code in list(range(0, 0x3000)) + [0xFEFF, 0x10FFFF]:
        ch = chr(code)
        old_rejects = code < 32 or code == 127
        try:
            norm_path(f"/a{ch}b")
            rejected = False
        except PathError as e:
            rejected = "control" in str(e)
            assert rejected or ch == "/", (code, e)
        assert rejected == old_rejects, hex(code)


@pytest.mark.unit
def test_fast_path_agrees_with_the_long_route() -> None:
    """norm_path's one-regex route for already-normal ASCII paths returns or refuses exactly what the
    component-by-component route does (random paths from the tricky pieces)."""
    import random

    def outcome(path: str) -> tuple[str, str]:
        try:
            return "ok", norm_path(path)
        except PathError as e:
            return "refused", str(e)

    def reference(path: str) -> tuple[str, str]:
        try:
            return "ok", _norm_path_checked(path)
        except PathError as e:
            return "refused", str(e)

    pieces = ["/", "/", ".", "..", "a", "\x00", "\x1f", "\x7f", "é", " ", "x" * 200, "y" * 60, "~"]
    rnd = random.Random(17)
    accepted = 0
    for _ in range(20000):
        path = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 12)))
        path = "/" + path if rnd.random() < 0.7 else path
        assert outcome(path) == reference(path), path
        accepted += outcome(path)[0] == "ok"
    assert accepted > 1000
    for path in ["/", "/a/", "//", "/...", "/a/..", "/a/.b", "/" + "x" * 255, "/" + "x" * 256,
                 "/" + "a/" * 2047 + "a", "/" + "a/" * 2048 + "a"]:
        assert outcome(path) == reference(path), path


@pytest.mark.unit
def test_shard_hash_and_specs() -> None:
    import zlib

    assert shard_of("/kv/x", 1) == 0
    assert [shard_of(p, 4) for p in ("/a", "/b", "/kv/abc")] == [zlib.crc32(p.encode()) % 4 for p in
                                                                   ("/a", "/b", "/kv/abc")]
    assert parse_masters("a:1,b:2;c:3") == [["a:1", "b:2"], ["c:3"]]
    assert parse_masters("a:1,b:2") == [["a:1", "b:2"]]
    for bad in ("a:1;", ";a:1", ""):
        with pytest.raises(ValueError):
            parse_masters(bad)
    assert parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "-1/2", "x", "1/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)


@pytest.mark.unit
def test_prefix_recombination() -> None:
    """Chain of 6 over 2 shards (shard 0 asked indexes 0,2,4; shard 1 asked 1,3,5)."""
    parts = [[0, 2, 4], [1, 3, 5]]
    assert combine_prefix(parts, [3, 3], 6) == 6
    assert combine_prefix(parts, [3, 1], 6) == 3  # shard 1's 2nd path (index 3) is the first miss
    assert combine_prefix(parts, [1, 3], 6) == 2  # a gap on shard 0 at index 2, later hits do not count
    assert combine_prefix(parts, [3, Unavailable("down")], 6) == 1  # a dead shard misses at its first path
    with pytest.raises(Unavailable):
        combine_prefix(parts, [Unavailable("a"), Unavailable("b")], 6)


# ---------- real processes ----------

def test_puts_land_on_their_shard_and_others_are_refused(sharded: LocalCluster) -> None:
    paths = _paths("/sh/land", 40)
    with sharded.client(node_id="node-1") as c:
        assert c.put_many([(p, p.encode()) for p in paths]) == [True] * len(paths)
        assert c.get_many(paths) == [p.encode() for p in paths]
    for k in range(N):
        mine = _of(paths, k)
        assert 0 < len(mine) < len(paths)
        with _direct(sharded, k) as d:
            # this master's namespace holds exactly its hash class of the directory
            assert sorted(i.path for i in d.ls("/sh/land")) == sorted(mine)
            other = next(p for p in paths if p not in mine)
            with pytest.raises(WrongShard, match=f"shard {1 - k} of 2"):
                d.stat(other)
            with pytest.raises(WrongShard):
                d.prefix_lookup([other])
            new = [f"/sh/land/new-{k}-{i}" for i in range(100)]
            theirs = next(p for p in new if shard_of(p, N) != k)
            ours = next(p for p in new if shard_of(p, N) == k)
            with pytest.raises(WrongShard):  # a misconfigured writer must not split the namespace
                d.put(theirs, b"x")
            r = d.put_many([(theirs, b"x"), (ours, b"y")], return_exceptions=True)
            assert isinstance(r[0], WrongShard) and r[1] is True  # a refused item fails only itself
            assert d.stat(mine[0]) is not None
            assert d.stat("/sh/land").is_dir  # directories are every shard's


def test_metadata_across_shards(sharded: LocalCluster) -> None:
    chain = _paths("/sh/chain", 16)
    with sharded.client(node_id="node-2") as c:
        assert c.put_many([(p, b"v" * 100) for p in chain]) == [True] * 16
        assert c.prefix_lookup(chain) == 16
        assert [s is not None for s in c.stat_many(chain)] == [True] * 16
        assert c.locate_many(chain) == 16
        gap = 9
        assert c.rm(chain[gap])
        assert c.prefix_lookup(chain) == gap  # the earliest first miss, whichever shard holds it
        assert c.prefix_lookup(chain[:gap]) == gap
        assert c.get(chain[gap]) is None and c.get(chain[gap + 1]) == b"v" * 100
        # listing merges both shards' entries; mkdir/rmdir reach every shard
        assert [i.path for i in c.ls("/sh/chain")] == sorted(p for i, p in enumerate(chain) if i != gap)
        assert {i.path for i in c.ls("/sh")} >= {"/sh/chain", "/sh/land"}
        c.mkdir("/sh/empty/deeper")
        assert c.stat("/sh/empty/deeper").is_dir and c.stat("/sh/empty").is_dir
        with pytest.raises(L2fsError) as notempty:
            c.rmdir("/sh/empty")
        assert notempty.value.errno == errno.ENOTEMPTY
        c.rmdir("/sh/empty/deeper")
        assert c.rm("/sh/empty")
        assert c.stat("/sh/empty") is None
        with pytest.raises(NotFound):
            c.ls("/sh/empty")
        # rename: within a shard it is the master's atomic rename; across shards or of a directory, EXDEV
        src = chain[0]
        same = next(f"/sh/renamed-{i}" for i in range(1000) if shard_of(f"/sh/renamed-{i}", N) == shard_of(src, N))
        other = next(f"/sh/moved-{i}" for i in range(1000) if shard_of(f"/sh/moved-{i}", N) != shard_of(src, N))
        c.rename(src, same)
        assert c.get(same) == b"v" * 100 and c.stat(src) is None
        with pytest.raises(CrossShard) as exc:
            c.rename(same, other)
        assert exc.value.errno == errno.EXDEV
        assert c.get(same) == b"v" * 100  # refused: nothing moved
        with pytest.raises(CrossShard):
            c.rename("/sh/chain", "/sh/chain2")
        assert c.report().files >= 16 + 40


def test_fsspec_is_sharded_through_client(sharded: LocalCluster) -> None:
    fs = fsspec.filesystem("l2fs", master=sharded.master, node_id="node-1", skip_instance_cache=True)
    names = [f"/sh/fs/f{i}" for i in range(8)]
    assert {shard_of(p, N) for p in names} == {0, 1}
    for p in names:
        fs.pipe(p, p.encode())
    assert sorted(fs.ls("/sh/fs", detail=False)) == sorted(names)
    assert fs.info(names[0])["size"] == len(names[0])
    assert [fs.cat(p) for p in names] == [p.encode() for p in names]


def test_worker_link_reports_only_its_shard(sharded: LocalCluster, tmp_path: Path) -> None:
    """A worker's link to shard K reports only K's blocks, speaks the versioned protocol and is refused
    nothing; the other shard's block stays on the worker (not deleted by a master that does not own it)."""
    store = Store([(tmp_path / "d", 1 << 20)])
    got = {}
    assert sharded.block_key_file is not None  # every shard's master has the same key: ids as one minted them
    key = BlockKey(sharded.block_key_file.read_bytes())
    for p in ("/sh/link/a", "/sh/link/b", "/sh/link/c", "/sh/link/d"):
        bid = key.mint("w-shard-link", 3)
        b = store.receive(bid, p, 3, 0, [b"abc"])
        store.seal_blocks([(bid, b.crc32c, seal_mac(key.key, "w-shard-link", bid, 3, b.crc32c, p))])  # committed
        got[p] = bid
    assert {shard_of(p, N) for p in got} == {0, 1}
    link = MasterLink(store, master=f"127.0.0.1:{sharded.master_ports[1]}", tls_ca=None, token=None,
                      worker_id="w-shard-link", node_id="n-link", address="127.0.0.1:2", data_address="",
                      heartbeat_interval=1.0, shard=(1, N))
    link._register()  # noqa: SLF001
    assert link.registered and link.master_version == PROTOCOL_VERSION
    assert set(store.blocks) == set(got.values())  # nothing of shard 0 was deleted
    with _direct(sharded, 1) as d:
        listed = {i.path for i in d.ls("/sh/link")}
    assert listed == set(_of(list(got), 1))


def test_one_dead_master_costs_only_its_shard(sharded: LocalCluster) -> None:
    paths = _paths("/sh/outage", 24)
    with sharded.client(node_id="node-1", timeout=1.5) as c:
        assert c.put_many([(p, p.encode()) for p in paths]) == [True] * 24
        with _direct(sharded, 0) as d0:
            before0 = {i.path for i in d0.ls("/sh/outage")}
        sharded.kill_master(shard=1)
        try:
            for p in paths:
                t0 = time.monotonic()
                got = c.get(p)
                assert time.monotonic() - t0 < 1.5 + 1.0
                assert got == (p.encode() if shard_of(p, N) == 0 else None), p
            fresh = _paths("/sh/outage2", 8)
            r = c.put_many([(p, b"n") for p in fresh], return_exceptions=True)
            for p, x in zip(fresh, r, strict=True):
                assert (x is True) if shard_of(p, N) == 0 else isinstance(x, Unavailable), (p, x)
            first1 = next(i for i, p in enumerate(paths) if shard_of(p, N) == 1)
            assert c.prefix_lookup(paths) == first1  # the dead shard misses; the live one still answers
        finally:
            sharded.start_master(shard=1)
        # the restarted master rebuilds its shard, and only its shard, from the workers' reports
        with _direct(sharded, 1) as d:
            wait_until(lambda: _listed(d, "/sh/outage") == set(_of(paths, 1)), timeout=30)
            ids = {w.worker_id for w in sharded.workers}
            wait_until(lambda: {w.worker_id for w in d.report().workers if w.alive} >= ids, timeout=30)
            names = [i.path for i in d.ls("/sh")]
            assert names and all(re.match(r"^/sh/", n) for n in names)
            for sub in ("/sh/outage", "/sh/land", "/sh/chain"):
                assert all(shard_of(i.path, N) == 1 for i in d.ls(sub) if not i.is_dir)
        with _direct(sharded, 0) as d0:
            assert {i.path for i in d0.ls("/sh/outage")} == before0
        wait_until(lambda: c.prefix_lookup(paths) == 24, timeout=30)
        assert c.get_many(paths) == [p.encode() for p in paths]


def test_dead_worker_dropped_and_rereported_on_every_shard(sharded: LocalCluster) -> None:
    """Each shard's master notices a dead worker on its own (its own heartbeats) and drops that worker's
    files of its shard; the restarted worker re-registers with every master, each taking its blocks back."""
    paths = _paths("/sh/dead", 16)
    with sharded.client(node_id="node-2", timeout=1.5) as c:
        assert c.put_many([(p, b"d") for p in paths]) == [True] * 16
        on2 = [p for p, st in zip(paths, c.stat_many(paths), strict=True) if st is not None and st.nodes == ["node-2"]]
        assert {shard_of(p, N) for p in on2} == {0, 1}  # local-first: node-2's worker holds both shards' files
        sharded.kill_worker(1)
        try:
            wait_until(lambda: all(s is None for s in c.stat_many(on2)), timeout=20)
        finally:
            sharded.start_worker(1)
        wait_until(lambda: all(s is not None for s in c.stat_many(on2)), timeout=30)
        assert c.get_many(on2) == [b"d"] * len(on2)


@pytest.mark.unit
def test_worker_queues_reach_every_shard(tmp_path: Path) -> None:
    """An eviction (or any removal the worker reports) goes to every shard's link, a tier move only to the
    link of the shard owning the block's path, and a link's full report clears only its own queues."""
    from l2fs.worker.registration import MasterLinks

    store = Store([(tmp_path / "d", 1 << 20)])
    ids = {}
    for p in ("/q/a", "/q/b", "/q/c", "/q/d"):
        ids[p] = uuid.uuid4().hex
        store.receive(ids[p], p, 3, 0, [b"abc"])
    assert {shard_of(p, N) for p in ids} == {0, 1}
    links = MasterLinks(store, master="127.0.0.1:1;127.0.0.1:2", tls_ca=None, token=None, worker_id="w",
                        node_id="n", address="127.0.0.1:3", data_address="", heartbeat_interval=1.0).links
    assert [(k.shard, k.shards) for k in links] == [(0, 2), (1, 2)]
    store.delete(ids["/q/a"], "evicted")
    with store.lock:
        store.moved += [(ids["/q/b"], "/new/b"), (ids["/q/c"], "/new/c")]
    links[0]._drain()  # noqa: SLF001 - what each link's loop does first
    assert not store.removed and not store.moved
    for k in links:
        assert k.removed == [(ids["/q/a"], "evicted")]
        assert k.moved == [(ids[p], f"/new/{p[-1]}") for p in ("/q/b", "/q/c") if shard_of(p, N) == k.shard]
    links[1].removed.clear()
    assert links[0].removed  # one shard's re-registration does not swallow the other's pending reports
