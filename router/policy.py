"""Routing decisions: one cost for every cache-aware strategy, a bounded-load cap and random tie-break.

cost(r) = uncached_prefill_tokens(r) + inflight_prefill_tokens(r) + beta * active_decode_tokens(r)
          - session_bonus(r)

uncached(r) = n - hit(r) - l2_credit * max(0, l2_hit - hit(r)): blocks in a replica's L0/L1 are free, blocks
only in L2 (reachable by every replica) are cheaper than recompute but not free. A replica is eligible only
while its in-flight count stays under ceil((1+eps) * mean after admission) (bounded-load hashing), so a hot
shared prompt can never pin all traffic to one replica; affinity yields, it is a score, not a pin.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.contract import STRATEGIES  # re-exported: router.policy.STRATEGIES stays importable
from router.index import KVIndex, PrefixTree, block_keys, root_key
from router.replicas import Replica


class UnknownStrategy(ValueError):
    pass


@dataclass
class Decision:
    replica: Replica
    reason: str
    hit_tokens: int = 0  # predicted L0/L1 hit on the chosen replica
    l2_tokens: int = 0
    uncached: int = 0
    keys: list[int] = field(default_factory=list)


@dataclass
class Policy:
    block_size: int = 16
    load_epsilon: float = 0.25
    decode_beta: float = 0.1
    l2_credit: float = 0.5
    session_bonus_frac: float = 1.0  # bonus = this fraction of the prompt length
    speculative_ttl: float = 5.0
    max_tree_blocks: int = 1_000_000
    max_sessions: int = 100_000
    tree: PrefixTree = field(init=False)
    kv: KVIndex = field(default_factory=KVIndex)
    _rr: int = 0
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _rng: random.Random = field(default_factory=random.Random)

    spec: PrefixTree = field(init=False)

    def __post_init__(self) -> None:
        self.tree = PrefixTree(self.max_tree_blocks)  # prefixaware / session: where we sent each prefix
        self.spec = PrefixTree(self.max_tree_blocks)  # kvaware: routed-but-not-yet-evented, short TTL

    def forget(self, replica: str) -> None:
        """A replica died, restarted or left: nothing it held can be trusted."""
        self.tree.purge(replica)
        self.spec.purge(replica)
        self.kv.clear(replica)

    @staticmethod
    def check_strategy(name: str) -> str:
        if name not in STRATEGIES:
            raise UnknownStrategy(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
        return name

    def _eligible(self, cands: Sequence[Replica]) -> list[Replica]:
        total = sum(r.inflight for r in cands) + 1
        cap = math.ceil((1 + self.load_epsilon) * total / len(cands))
        ok = [r for r in cands if r.inflight < cap]
        return ok or list(cands)

    def _pick_min(self, scored: list[tuple[float, Replica]]) -> Replica:
        best = min(c for c, _ in scored)
        ties = [r for c, r in scored if c <= best + 1e-9]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def choose(self, strategy: str, cands: Sequence[Replica], tokens: Sequence[int] | None, *,
               session: str | None = None, model: str | None = None, cache_salt: str | None = None,
               l2_tokens: int = 0) -> Decision:
        if not cands:
            raise LookupError("no replica available")
        if strategy == "roundrobin":
            r = cands[self._rr % len(cands)]
            self._rr += 1
            return Decision(r, "roundrobin", uncached=len(tokens or ()))
        toks = tokens or ()
        n = len(toks)
        root = root_key(model) if model and model in self.kv.loras else root_key()
        extra0 = ("salt", str(cache_salt)) if cache_salt else None
        keys = block_keys(toks, self.block_size, root, extra0)
        hits: dict[str, float] = {}
        if strategy in ("prefixaware", "session"):
            for url, b in self.tree.match(keys).items():
                hits[url] = b * self.block_size
        elif strategy == "kvaware":
            spec = self.spec.match(keys)  # speculative: what we routed in the last few seconds
            for url, b in spec.items():
                hits[url] = b * self.block_size
            bss = self.kv.block_sizes()
            for bs in bss or {self.block_size}:
                ks = keys if bs == self.block_size else block_keys(toks, bs, root, extra0)
                for url, (_b, weighted) in self.kv.match(ks).items():
                    if self.kv.block_size(url) == bs:
                        hits[url] = max(hits.get(url, 0.0), weighted * bs)
        sticky = None
        if session:
            sticky = self._sessions.get(session)
        elig = self._eligible(cands)
        scored = []
        for r in elig:
            h = min(hits.get(r.url, 0.0), n)
            uncached = n - h - self.l2_credit * max(0.0, l2_tokens - h)
            cost = uncached + r.prefill_tokens + self.decode_beta * r.decode_tokens
            if strategy == "session" and r.url == sticky:
                cost -= self.session_bonus_frac * max(n, 1) + 1
            scored.append((cost, r))
        r = self._pick_min(scored)
        h = int(min(hits.get(r.url, 0.0), n))
        if strategy == "session" and sticky == r.url:
            reason = "session"
        elif h > 0:
            reason = "cache_hit"
        elif len(elig) < len(cands) and any(hits.get(c.url, 0) > 0 for c in cands if c not in elig):
            reason = "load_cap"
        else:
            reason = "least_cost"
        if session:
            self._sessions[session] = r.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return Decision(r, reason, h, l2_tokens, int(n - h), keys)

    def record(self, strategy: str, d: Decision) -> None:
        """Remember where this prefix went: the prefix tree for prefixaware, a short TTL for kvaware."""
        if strategy in ("prefixaware", "session"):
            self.tree.insert(d.keys, d.replica.url)
        elif strategy == "kvaware":
            self.spec.insert(d.keys, d.replica.url, ttl=self.speculative_ttl)
