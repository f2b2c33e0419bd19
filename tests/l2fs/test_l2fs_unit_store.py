"""Unit tier: the worker's block store (l2fs.worker.store) in process, on tmp_path: reservations, the one write
path, watermarks and the eviction policy, tiers, damage checks and the manifest across a restart."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import crc32c
import grpc
import pytest

from l2fs.common import RpcError
from l2fs.worker.store import Store

pytestmark = pytest.mark.unit
KB = 1024


def bid() -> str:
    return uuid.uuid4().hex


def put(store: Store, data: bytes, *, path: str | None = None, hint: int = 0, pieces: int = 3) -> str:
    """Write `data` through Store.receive in a few pieces; returns the block id."""
    b = bid()
    step = max(1, len(data) // pieces)
    store.receive(b, path or f"/f/{b}", len(data), hint, [data[i:i + step] for i in range(0, len(data), step)])
    return b


def code_of(exc: pytest.ExceptionInfo[RpcError]) -> grpc.StatusCode:
    return exc.value.code


def test_receive_seals_checksummed_block_that_survives_restart(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])
    data = os.urandom(10 * KB)
    b = put(store, data, path="/a/x", hint=7)
    blk = store.blocks[b]
    assert (blk.size, blk.crc32c, blk.path, blk.order_hint) == (len(data), crc32c.crc32c(data), "/a/x", 7)
    assert Path(store.local_path(blk)).read_bytes() == data
    assert store.used == len(data) and not store.reservations
    assert not list((tmp_path / "d" / "tmp").iterdir())
    again = Store([(tmp_path / "d", 100 * KB)])  # a restarted worker rebuilds from the manifest
    assert again.blocks[b].crc32c == blk.crc32c and again.used == len(data)
    assert [r.block_id for r in again.reports()] == [b]


@pytest.mark.parametrize("pieces,declared", [([b"x" * 10], 20), ([b"x" * 10, b"y" * 11], 20)])
def test_receive_of_wrong_length_releases_reservation(tmp_path: Path, pieces: list[bytes], declared: int) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])
    b = bid()
    with pytest.raises(RpcError) as e:
        store.receive(b, "/x", declared, 0, pieces)
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT
    assert b not in store.blocks and not store.reservations and store.used == 0
    assert not list((tmp_path / "d" / "tmp").iterdir())
    put(store, b"ok")  # the store still works


def test_receive_failing_source_releases_reservation(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])

    def broken() -> Iterator[bytes]:
        yield b"abc"
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        store.receive(bid(), "/x", 10, 0, broken())
    assert store.used == 0 and not store.reservations


def test_reserve_rules(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], max_file_size=50 * KB, max_reserved=0.25)
    with pytest.raises(RpcError) as e:
        store.reserve(bid(), 51 * KB)
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT
    b = bid()
    store.reserve(b, 40 * KB)  # more than the 25 % cap, admitted because it is the only one
    with pytest.raises(RpcError) as e:
        store.reserve(b, 1)
    assert code_of(e) == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(RpcError) as e:
        store.reserve(bid(), 1 * KB)  # now the promised bytes are over the cap: a write miss, retry later
    assert code_of(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
    store.release(b)
    assert store.used == 0
    big = Store([(tmp_path / "small", 10 * KB)])
    with pytest.raises(RpcError) as e:
        big.reserve(bid(), 9 * KB)  # over the low watermark (80 %) of every dir
    assert code_of(e) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_reservations_do_not_evict_live_blocks(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], max_reserved=1.0)
    kept = [put(store, os.urandom(20 * KB)) for _ in range(4)]  # 80 KB sealed, under the 90 % high mark
    store.reserve(bid(), 15 * KB)  # 95 KB promised + sealed: still fits the capacity
    store.maybe_evict()
    assert all(b in store.blocks for b in kept) and not store.removed


def test_seal_over_high_watermark_evicts_to_low_and_keeps_new_block(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], high=0.9, low=0.5)
    old = [put(store, os.urandom(20 * KB)) for _ in range(4)]
    new = put(store, os.urandom(20 * KB))  # 100 KB sealed > 90 KB: evict down to 50 KB
    assert new in store.blocks
    assert store.used <= 50 * KB
    gone = [b for b in old if b not in store.blocks]
    assert len(gone) == 3 and sorted(store.removed) == sorted((b, "evicted") for b in gone)
    for b in gone:
        assert not (tmp_path / "d" / "blocks" / b[:2] / b).exists()


def _aged(store: Store, ages: dict[str, float]) -> None:
    now = time.time()
    for b, age in ages.items():
        store.blocks[b].last_access = now - age


def test_eviction_policy_coldest_read_first(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], high=0.9, low=0.6, evict_granularity=1.0)
    a, b, c, d = (put(store, os.urandom(20 * KB), hint=h) for h in (9, 0, 0, 0))
    _aged(store, {a: 10, b: 300, c: 100, d: 200})  # a has the deepest hint but was read most recently
    put(store, os.urandom(20 * KB))
    assert [x for x, _ in store.removed] == [b, d]


def test_eviction_policy_deepest_chain_position_first_within_granularity(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], high=0.9, low=0.6, evict_granularity=1e9)
    a, b, c, d = (put(store, os.urandom(20 * KB), hint=h) for h in (3, 1, 4, 2))
    _aged(store, {a: 1, b: 4, c: 2, d: 3})  # all in one time bucket: order hint decides, deepest first
    put(store, os.urandom(20 * KB))
    assert [x for x, _ in store.removed] == [c, a]


def test_touch_protects_a_block_from_eviction(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], high=0.9, low=0.6, evict_granularity=0.001)
    first, *rest = (put(store, os.urandom(20 * KB)) for _ in range(4))
    _aged(store, {first: 100, **{r: 50 for r in rest}})
    store.touch(first)
    put(store, os.urandom(20 * KB))
    assert first in store.blocks and all(b in rest for b, _ in store.removed)


def test_tiers_new_blocks_fastest_and_cold_ones_demoted(tmp_path: Path) -> None:
    mem, ssd = (tmp_path / "mem", 50 * KB, 0), (tmp_path / "ssd", 200 * KB, 1)
    store = Store([mem, ssd], high=0.9, low=0.5)
    blocks = [put(store, os.urandom(20 * KB)) for _ in range(3)]  # the third pushes MEM over 90 %
    assert store.blocks[blocks[-1]].dir_idx == 0
    moved = dict(store.moved)
    assert moved and not store.removed
    for b, local in moved.items():
        assert store.blocks[b].dir_idx == 1 and local == store.local_path(store.blocks[b])
        assert Path(local).exists() and not (tmp_path / "mem" / "blocks" / b[:2] / b).exists()
    again = Store([mem, ssd])  # both manifests agree after the move
    assert {b: again.blocks[b].dir_idx for b in blocks} == {b: store.blocks[b].dir_idx for b in blocks}


@pytest.mark.parametrize("damage", ["truncate", "extend", "delete"])
def test_open_block_drops_damaged_files(tmp_path: Path, damage: str) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])
    b = put(store, os.urandom(4 * KB))
    f = Path(store.local_path(store.blocks[b]))
    if damage == "truncate":
        os.truncate(f, 100)
    elif damage == "extend":
        with open(f, "ab") as fh:
            fh.write(b"!")
    else:
        f.unlink()
    assert store.open_block(b) is None
    assert b not in store.blocks and store.removed == [(b, "corrupt")] and store.used == 0


def test_verify_drops_flipped_bytes_and_keeps_good_blocks(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])
    good, bad = put(store, os.urandom(8 * KB)), put(store, os.urandom(8 * KB))
    f = Path(store.local_path(store.blocks[bad]))
    raw = bytearray(f.read_bytes())
    raw[100] ^= 0xFF  # same size: only the checksum can tell
    f.write_bytes(bytes(raw))
    opened = store.open_block(bad)
    assert opened is not None  # the size matches: opening alone does not see it
    opened[2].close()
    assert store.verify(good) and not store.verify(bad)
    assert good in store.blocks and bad not in store.blocks and store.removed == [(bad, "corrupt")]


def test_adopt_checks_the_file_size(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])
    b = bid()
    i = store.reserve(b, 10, expires=True)
    store.dirs[i].tmp_file(b).write_bytes(b"short")
    with pytest.raises(RpcError) as e:
        store.adopt(b, "/x", 10, 0, 0)
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT and not store.reservations and store.used == 0
    with pytest.raises(RpcError) as e:
        store.adopt(b, "/x", 10, 0, 0)
    assert code_of(e) == grpc.StatusCode.FAILED_PRECONDITION
    b2 = bid()
    i = store.reserve(b2, 5, expires=True)
    store.dirs[i].tmp_file(b2).write_bytes(b"hello")
    blk = store.adopt(b2, "/y", 5, crc32c.crc32c(b"hello"), 1)
    assert Path(store.local_path(blk)).read_bytes() == b"hello" and store.verify(b2)


def test_unadopted_reservations_expire(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)], reservation_ttl=0.01)
    streamed, local = bid(), bid()
    store.reserve(streamed, KB)  # released by the receiving thread, never by expiry
    store.reserve(local, KB, expires=True)
    time.sleep(0.05)
    store.maybe_evict()
    assert list(store.reservations) == [streamed] and store.used == KB


def test_load_discards_leftovers(tmp_path: Path) -> None:
    store = Store([(tmp_path / "d", 100 * KB)])
    b = put(store, b"data")
    stray = tmp_path / "d" / "blocks" / "ab" / ("ab" + "0" * 30)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"nobody's")
    (tmp_path / "d" / "tmp" / f"{bid()}.part").write_bytes(b"half")
    store.dirs[0].db.execute("INSERT INTO blocks (block_id, path, size, crc32c, sealed, mtime, last_access, order_hint)"
                             " VALUES (?,?,?,?,0,0,0,0)", (bid(), "/unsealed", 1, 0))
    again = Store([(tmp_path / "d", 100 * KB)])
    assert list(again.blocks) == [b]
    assert not stray.exists() and not list((tmp_path / "d" / "tmp").iterdir())
    assert again.dirs[0].db.execute("SELECT COUNT(*) FROM blocks").fetchone() == (1,)
