"""The KV-event decoder against vLLM's own msgspec classes (current map events) and the older array_like form."""

from __future__ import annotations

import msgspec
import pytest

from router.index import KVIndex, PrefixTree, block_keys
from router.kvevents import DecodeError, apply_events, decode_batch

kv_events = pytest.importorskip("vllm.distributed.kv_events")


class OldBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    """vLLM before PR #42892: events were positional arrays [tag, fields...]."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class OldBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldCleared]
    data_parallel_rank: int | None = None


TOK = list(range(100, 164))  # 4 blocks of 16


def _vllm_payload(events: list) -> bytes:
    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))


def test_decodes_vllm_map_events_and_builds_the_same_keys_as_requests():
    ev = [kv_events.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=TOK[:32], block_size=16,
                                lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                                kv_cache_spec_kind="full_attention"),
          kv_events.BlockStored(block_hashes=[13, 14], parent_block_hash=12, token_ids=TOK[32:], block_size=16,
                                lora_id=None, medium="GPU", lora_name=None)]
    ts, events, dp = decode_batch(_vllm_payload(ev))
    assert ts == 1.0 and dp == 0 and [e["type"] for e in events] == ["BlockStored", "BlockStored"]
    idx = KVIndex()
    apply_events(idx, "r1", events)
    keys = block_keys(TOK + [1, 2, 3], 16)
    assert idx.match(keys)["r1"][0] == 4
    # removing block 13 cuts the contiguous prefix at 2 blocks
    _, events, _ = decode_batch(_vllm_payload([kv_events.BlockRemoved(block_hashes=[13], medium="GPU")]))
    apply_events(idx, "r1", events)
    assert idx.match(keys)["r1"][0] == 2
    _, events, _ = decode_batch(_vllm_payload([kv_events.AllBlocksCleared()]))
    apply_events(idx, "r1", events)
    assert idx.match(keys) == {} and len(idx) == 0


def test_decodes_older_array_events_identically():
    old = msgspec.msgpack.encode(OldBatch(2.0, [OldBlockStored([21, 22, 23, 24], None, TOK, 16, None, "GPU"),
                                                 OldBlockRemoved([24], "GPU")]))
    ts, events, _ = decode_batch(old)
    assert ts == 2.0 and events[0]["token_ids"] == TOK and events[1]["block_hashes"] == [24]
    idx = KVIndex()
    apply_events(idx, "r2", events)
    assert idx.match(block_keys(TOK, 16))["r2"][0] == 3
    _, events, _ = decode_batch(msgspec.msgpack.encode(OldBatch(3.0, [OldCleared()])))
    apply_events(idx, "r2", events)
    assert len(idx) == 0


def test_sliding_window_groups_and_cpu_medium():
    ev = [kv_events.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOK[:16], block_size=16,
                                lora_id=None, medium="GPU", lora_name=None, group_idx=1,
                                kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128),
          kv_events.BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=TOK[:16], block_size=16,
                                lora_id=None, medium="CPU", lora_name=None)]
    _, events, _ = decode_batch(_vllm_payload(ev))
    idx = KVIndex()
    apply_events(idx, "r", events)
    n, weighted = idx.match(block_keys(TOK[:16], 16))["r"]
    assert n == 1 and weighted == pytest.approx(0.8)  # only the CPU copy counts, at the CPU weight


def test_orphan_blocks_and_garbage():
    idx = KVIndex()
    _, events, _ = decode_batch(_vllm_payload([kv_events.BlockStored(
        block_hashes=[5], parent_block_hash=999, token_ids=TOK[:16], block_size=16, lora_id=None, medium="GPU",
        lora_name=None)]))
    apply_events(idx, "r", events)
    assert len(idx) == 0 and idx.orphans == 1
    for bad in (b"\xc1", msgspec.msgpack.encode(42), msgspec.msgpack.encode([1.0, [["Nope", 1]]])):
        with pytest.raises(DecodeError):
            decode_batch(bad)


def test_prefix_tree_lru_cap_and_purge():
    t = PrefixTree(max_blocks=8)
    a = block_keys(list(range(64)), 16)
    b = block_keys(list(range(1000, 1080)), 16)
    t.insert(a, "r1")
    assert t.match(a) == {"r1": 4}
    t.insert(b, "r2")  # 4 + 5 > 8: the least recently used blocks of `a` go
    assert len(t) == 8 and t.match(a).get("r1", 0) < 4 and t.match(b) == {"r2": 5}
    t.purge("r2")
    assert t.match(b) == {}
    t.insert(b, "r2", ttl=0.0001)
    import time

    time.sleep(0.01)
    assert t.match(b) == {}
