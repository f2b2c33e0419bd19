"""The MP-mode L2 adapter against LMCache's L2 adapter contract, on CPU, over a real l2fs LocalCluster.

Loaded the way `lmcache server --l2-adapter '{"type":"plugin",...}'` loads it (LMCache's own JSON parsing
and factory), then: distinct event fds that fire, task ids, pop/query exactly once, lookup bitmaps, load
copies the bytes into caller-owned buffers, a missing or unreachable L2 is a miss, close is idempotent.
"""

from __future__ import annotations

import argparse
import json
import select

import pytest
import torch

pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

from connector import keys as ckeys
from connector.mp_l2fs import L2fsL2Adapter
from l2fs.common import free_port
from l2fs.testing.cluster import LocalCluster

SHAPE = torch.Size([2, 2, 256, 64])


def _adapter(master: str, node: str = "node-1", **params) -> L2fsL2Adapter:
    spec = {"type": "plugin", "module_path": "connector.mp_l2fs", "class_name": "L2fsL2Adapter",
            "adapter_params": {"master": master, "node_id": node, "timeout": 1.0, **params}}
    ns = argparse.Namespace(l2_adapter=[json.dumps(spec)])
    cfgs = parse_args_to_l2_adapters_config(ns)
    ad = create_l2_adapter_from_registry(cfgs.adapters[0])
    assert isinstance(ad, L2fsL2Adapter)
    return ad


def _objs(n: int, seed: int) -> list:
    alloc = AdHocMemoryAllocator("cpu")
    out = []
    for i in range(n):
        o = alloc.allocate(SHAPE, torch.float32, MemoryFormat.KV_2LTD)
        o.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed * 100 + i)))
        out.append(o)
    return out


def _key(i: int, model: str = "org/m") -> ObjectKey:
    return ObjectKey(chunk_hash=bytes([i]) * 32, model_name=model, kv_rank=(1 << 24) | (1 << 8), cache_salt="")


def _poll(fn, fd: int, timeout: float = 10.0):
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        res = fn()
        if res is not None and not (isinstance(res, dict) and not res):
            return res
        select.select([fd], [], [], 0.2)
    raise AssertionError("task did not complete")


def test_object_key_names_are_reversible() -> None:
    for k in (_key(1), ObjectKey(chunk_hash=b"\x00\xff" * 16, model_name="a/b%c", kv_rank=7, object_group_id=3,
                                 cache_salt="user-1")):
        name = ckeys.object_key_name(k)
        assert "/" not in name and ckeys.name_to_object_key(name) == k


def test_l2_adapter_contract(cluster: LocalCluster) -> None:
    a = _adapter(cluster.master, "node-1")
    b = _adapter(cluster.master, "node-2")
    try:
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3
        keys = [_key(i) for i in range(4)]
        objs = _objs(4, seed=1)
        t1 = a.submit_store_task(keys, objs)
        t2 = a.submit_store_task(keys[:1], objs[:1])  # already there: put-if-absent, still a success
        assert t1 != t2
        done = _poll(lambda: a.pop_completed_store_tasks(), a.get_store_event_fd())
        while len(done) < 2:
            done.update(_poll(lambda: a.pop_completed_store_tasks(), a.get_store_event_fd()))
        assert set(done) == {t1, t2} and all(int(r) >= 0 for r in done.values())
        assert int(done[t1]) == 4 * SHAPE.numel() * 4
        assert a.pop_completed_store_tasks() == {}  # popped once

        # node-2 looks up (a hole in the middle stays a hole: bitmap, not prefix)
        probe = [keys[0], _key(200), keys[2], keys[3]]
        tl = b.submit_lookup_and_lock_task(probe, {})
        bm = _poll(lambda: b.query_lookup_and_lock_result(tl), b.get_lookup_and_lock_event_fd())
        assert [bm.test(i) for i in range(4)] == [True, False, True, True]
        assert b.query_lookup_and_lock_result(tl) is None  # returned once
        b.submit_unlock(probe)

        dst = _objs(4, seed=9)
        tload = b.submit_load_task(probe, dst)
        bm = _poll(lambda: b.query_load_result(tload), b.get_load_event_fd())
        assert [bm.test(i) for i in range(4)] == [True, False, True, True]
        assert torch.equal(dst[0].tensor, objs[0].tensor) and torch.equal(dst[2].tensor, objs[2].tensor)
        assert not torch.equal(dst[1].tensor, objs[1].tensor)
        assert b.query_load_result(tload) is None

        b.delete([keys[3]])
        tl = b.submit_lookup_and_lock_task([keys[3]], {})
        assert not _poll(lambda: b.query_lookup_and_lock_result(tl), b.get_lookup_and_lock_event_fd()).test(0)
    finally:
        a.close()
        b.close()
    a.close()  # idempotent


def test_unreachable_l2fs_is_a_miss_not_an_error() -> None:
    ad = _adapter(f"127.0.0.1:{free_port()}", timeout=0.3)
    try:
        objs = _objs(2, seed=3)
        ts = ad.submit_store_task([_key(1), _key(2)], objs)
        res = _poll(lambda: ad.pop_completed_store_tasks(), ad.get_store_event_fd())
        assert int(res[ts]) == -1
        tl = ad.submit_lookup_and_lock_task([_key(1)], {})
        assert not _poll(lambda: ad.query_lookup_and_lock_result(tl), ad.get_lookup_and_lock_event_fd()).test(0)
        tload = ad.submit_load_task([_key(1)], objs[:1])
        assert not _poll(lambda: ad.query_load_result(tload), ad.get_load_event_fd()).test(0)
    finally:
        ad.close()


def test_bad_adapter_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="master"):
        _adapter("")
