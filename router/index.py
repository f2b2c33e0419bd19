"""Prefix indexes: our own chained block keys, an approximate router-side tree and the event-driven KV index.

Both indexes speak one key space: key[i] = hash((key[i-1], tokens of block i)), a hash-chained trie over
full token blocks (a radix tree whose edges are blocks: vLLM only ever hits on whole blocks). We never try
to reproduce the engine's own block hashes (seeded sha256/pickle; the router cannot match them reliably):
KV events carry the block's token ids, so we recompute our key and keep an engine-hash -> key map.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")
ROOT = 0
MEDIUM_WEIGHT = {"GPU": 1.0, None: 1.0, "CPU": 0.8, "cpu": 0.8, "DISK": 0.5}


class Table(dict[K, V]):
    """A dict the cyclic GC always tracks, for the indexes' long-lived maps. CPython leaves an empty plain dict
    untracked and tracks it from its first container entry on, so a map created empty at start-up would miss the
    heap the router freezes once it serves (router.gcpause) and every full collection would walk all its entries
    (13-19 ms at 70 k blocks, on the request path). One of these is frozen with the rest of the start-up heap."""

    __slots__ = ()


def root_key(salt: object = None) -> int:
    """Chain root; a LoRA adapter or cache_salt gets its own namespace so they never collide."""
    return ROOT if salt is None else hash(("kvtier-root", salt))


def block_keys(tokens: Sequence[int], block_size: int, root: int = ROOT, extra0: object = None) -> list[int]:
    """Chained keys of every full block of `tokens` (ints hash deterministically in CPython)."""
    keys: list[int] = []
    parent = root
    n = len(tokens) // block_size
    for i in range(n):
        blk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = hash((parent, blk, extra0)) if (i == 0 and extra0 is not None) else hash((parent, blk))
        keys.append(parent)
    return keys


def contiguous_match(keys: Sequence[int], holders_of) -> dict[str, int]:
    """Leading blocks held by each replica; `holders_of(key)` returns the replicas holding that key."""
    result: dict[str, int] = {}
    alive: set[str] | None = None
    for i, k in enumerate(keys):
        h = holders_of(k)
        now = set(h) if alive is None else alive.intersection(h)
        if alive is not None:
            for r in alive - now:
                result[r] = i
        alive = now
        if not alive:
            break
    if alive:
        for r in alive:
            result[r] = len(keys)
    return result


class PrefixTree:
    """Router-side record of which replica was sent which prefix (no engine feedback).

    LRU over blocks with a hard size cap; each (block, replica) entry may carry an expiry so that kvaware
    can use it as a short-lived speculative index that covers the gap until the real KV events arrive.
    Purging a replica is O(1): entries are keyed by the replica's current tag (its URL and a serial), a purge
    retires it and the next insert makes a new one. A block's entries map tag (str) -> expiry (float), atomic values only, so the cyclic GC
    never tracks them: with (generation, expiry) tuples every new block's dict was tracked until the next full
    collection, which then walked them all (13-16 ms per full collection at 400 req/s in kvaware's router).
    """

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._nodes: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._tags_made = 0  # a new tag's suffix: unique, so a purged tag never comes back
        self._tag: dict[str, str] = Table()  # replica -> its current tag
        self._live: dict[str, str] = Table()  # current tag -> replica (a purged tag is absent)

    def __len__(self) -> int:
        return len(self._nodes)

    def _tag_of(self, replica: str) -> str:
        tag = self._tag.get(replica)
        if tag is None:
            tag = self._tag[replica] = f"{replica}\x00{self._tags_made}"
            self._tags_made += 1
            self._live[tag] = replica
        return tag

    def insert(self, keys: Iterable[int], replica: str, ttl: float | None = None) -> None:
        exp = time.monotonic() + ttl if ttl else float("inf")
        tag = self._tag_of(replica)
        nodes, live = self._nodes, self._live
        for k in keys:
            node = nodes.get(k)
            if node is None:
                node = nodes[k] = {}
            else:
                nodes.move_to_end(k)
                if len(node) > len(live):  # purged tags only leave here: at most one per live replica, plus one
                    for t in [t for t in node if t not in live]:
                        del node[t]
            node[tag] = exp
        while len(nodes) > self.max_blocks:
            nodes.popitem(last=False)

    def holders(self, key: int, now: float | None = None) -> list[str]:
        node = self._nodes.get(key)
        if not node:
            return []
        if now is None:
            now = time.monotonic()
        live = self._live
        return [live[t] for t, exp in node.items() if t in live and exp > now]

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """Matched leading blocks per replica (also refreshes the LRU position of what matched)."""
        m = self._contiguous(keys)
        best = max(m.values(), default=0)
        for k in keys[:best]:
            if k in self._nodes:
                self._nodes.move_to_end(k)
        return m

    def _contiguous(self, keys: Sequence[int]) -> dict[str, int]:
        """contiguous_match over this tree, inlined: on the hot path of every request (one dict lookup per
        block instead of two calls and a list and a set per block; ~10 % of the router's CPU at 200 req/s)."""
        now = time.monotonic()  # once per request, not once per block
        live, nodes = self._live, self._nodes
        result: dict[str, int] = {}
        alive: list[str] = []  # tags still matching
        for i, k in enumerate(keys):
            node = nodes.get(k)
            if i == 0:
                if not node:
                    return result
                alive = [t for t, exp in node.items() if t in live and exp > now]
                if len(alive) == 1:  # the common case (a prefix lives on one replica): no per-block list
                    return self._single(keys, alive[0], now)
            elif node is None:
                for t in alive:
                    result[live[t]] = i
                return result
            else:
                still = []
                for t in alive:
                    exp = node.get(t)
                    if exp is None or exp <= now:
                        result[live[t]] = i
                    else:
                        still.append(t)
                alive = still
            if not alive:
                return result
        for t in alive:
            result[live[t]] = len(keys)
        return result

    def _single(self, keys: Sequence[int], tag: str, now: float) -> dict[str, int]:
        """_contiguous when only one replica (tag) holds the first block: one dict lookup and one check per block."""
        nodes, r = self._nodes, self._live[tag]
        for i in range(1, len(keys)):
            node = nodes.get(keys[i])
            exp = node.get(tag) if node is not None else None
            if exp is None or exp <= now:
                return {r: i}
        return {r: len(keys)}

    def purge(self, replica: str) -> None:
        tag = self._tag.pop(replica, None)
        if tag is not None:
            del self._live[tag]


@dataclass
class _ReplicaBlocks:
    engine_to_key: dict[tuple[object, object], int] = field(default_factory=Table)  # (engine hash, medium) -> key
    block_size: int | None = None


class KVIndex:
    """Ground truth from engine KV events: which replica holds which block, on which medium."""

    def __init__(self) -> None:
        # a block's weight by the medium it is stored on; per index, so each router sets its own L1 cost
        self.medium_weight: dict[str | None, float] = dict(MEDIUM_WEIGHT)
        self._holders: dict[int, dict[str, float]] = Table()
        self._replicas: dict[str, _ReplicaBlocks] = Table()
        self._refcount: dict[tuple[int, str], int] = Table()
        self.orphans = 0  # BlockStored whose parent we never saw (chain unknown: skipped)
        self.loras: set[str] = set()

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, replica: str) -> None:
        """Make replica's engine-hash map now: a router adding its replicas before it serves gets the map frozen
        with its start-up heap (router.gcpause) instead of walked by every full collection."""
        self._replicas.setdefault(replica, _ReplicaBlocks())

    def block_size(self, replica: str) -> int | None:
        rb = self._replicas.get(replica)
        return rb.block_size if rb else None

    def block_sizes(self) -> set[int]:
        return {rb.block_size for rb in self._replicas.values() if rb.block_size}

    def stored(self, replica: str, block_hashes: Sequence[object], parent: object, token_ids: Sequence[int],
               block_size: int, medium: str | None = None, lora_name: str | None = None,
               extra_keys: Sequence[object] | None = None) -> None:
        rb = self._replicas.setdefault(replica, _ReplicaBlocks())
        rb.block_size = block_size
        if lora_name:
            self.loras.add(lora_name)
        if parent is None:
            pkey = root_key(lora_name)
        else:
            pkey = None
            for med in (medium, "GPU", None, "CPU"):
                pkey = rb.engine_to_key.get((parent, med))
                if pkey is not None:
                    break
            if pkey is None:
                self.orphans += len(block_hashes)
                return
        w = self.medium_weight.get(medium, 0.5)
        for i, h in enumerate(block_hashes):
            blk = tuple(token_ids[i * block_size:(i + 1) * block_size])
            if len(blk) < block_size:
                break
            extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            if extra is not None and pkey == root_key(lora_name):
                # only the first block's extra key (cache_salt) is reproducible from a request
                salt = extra[-1] if isinstance(extra, (list, tuple)) and extra else extra
                pkey = hash((pkey, blk, ("salt", str(salt))))
            else:
                pkey = hash((pkey, blk))
            ek = (h, medium)
            old = rb.engine_to_key.get(ek)
            if old == pkey:
                continue
            if old is not None:
                self._drop(replica, old)
            rb.engine_to_key[ek] = pkey
            self._refcount[(pkey, replica)] = self._refcount.get((pkey, replica), 0) + 1
            holders = self._holders.setdefault(pkey, {})
            holders[replica] = max(holders.get(replica, 0.0), w)

    def _drop(self, replica: str, key: int) -> None:
        """One engine block fewer maps to key on replica; the replica stops holding it at zero."""
        rc = self._refcount.get((key, replica), 0) - 1
        if rc > 0:
            self._refcount[(key, replica)] = rc
            return
        self._release(replica, key)

    def _release(self, replica: str, key: int) -> None:
        """replica no longer holds key at all (whatever its count was)."""
        self._refcount.pop((key, replica), None)
        holders = self._holders.get(key)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._holders[key]

    def removed(self, replica: str, block_hashes: Sequence[object], medium: str | None = None) -> None:
        rb = self._replicas.get(replica)
        if rb is None:
            return
        for h in block_hashes:
            key = rb.engine_to_key.pop((h, medium), None)
            if key is not None:
                self._drop(replica, key)

    def clear(self, replica: str) -> None:
        """AllBlocksCleared, a sequence gap we cannot replay, a restart or a failed health check."""
        rb = self._replicas.pop(replica, None)
        if rb is None:
            return
        for key in rb.engine_to_key.values():
            self._release(replica, key)

    def holders(self, key: int) -> dict[str, float]:
        return self._holders.get(key, {})

    def match(self, keys: Sequence[int]) -> dict[str, tuple[int, float]]:
        """Per replica: (leading blocks held, medium-weighted block count)."""
        counts = contiguous_match(keys, self.holders)
        out: dict[str, tuple[int, float]] = {}
        for r, n in counts.items():
            out[r] = (n, sum(self._holders[k][r] for k in keys[:n]))
        return out
