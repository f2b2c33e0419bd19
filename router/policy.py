"""Routing decisions: one cost for every cache-aware strategy, a bounded-load cap and random tie-break.

cost(r) = uncached_prefill_tokens(r) + inflight_prefill_tokens(r) + beta * active_decode_tokens(r)
          + n * (ext_waiting(r) + beta * ext_running(r)) + request_cost * requests_in_flight(r) - session_bonus(r)

The ext_* terms are other routers' requests on r (scraped from the replica's own metrics, see
router/replicas.py); we do not know their sizes, so each counts as one request of this one's size n.

uncached(r) = n - hit(r) - l2_credit * max(0, l2_hit - hit(r)): blocks in a replica's L0/L1 are free, blocks
only in L2 (reachable by every replica) are cheaper than recompute but not free. A replica is eligible only
while its load (ours + other routers') stays under ceil((1+eps) * mean after admission) (bounded-load hashing), so a hot
shared prompt can never pin all traffic to one replica; affinity yields, it is a score, not a pin.

One class per strategy (REGISTRY, names from kvtier.contract.STRATEGIES): a cache-aware strategy only says
which replicas hold how much of the prompt (`hits`) and what to remember after routing (`record`); the
choice is Policy.least_cost for all of them. A new strategy is a class with @register and a contract name.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
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
    request_cost: float = 0.0  # prompt tokens each request in flight on a replica costs, whatever its length
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
    affinity: bool = False  # a prefix no replica holds goes to its rendezvous-hash home (see _home)

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
        if name not in REGISTRY:
            raise UnknownStrategy(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
        return name

    def _eligible(self, cands: Sequence[Replica]) -> list[Replica]:
        total = sum(r.load for r in cands) + 1
        cap = math.ceil((1 + self.load_epsilon) * total / len(cands))
        ok = [r for r in cands if r.load < cap]
        return ok or list(cands)

    def _pick_min(self, scored: list[tuple[float, Replica]]) -> Replica:
        best = min(c for c, _ in scored)
        ties = [r for c, r in scored if c <= best + 1e-9]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def _home(self, toks: Sequence[int], elig: Sequence[Replica]) -> Replica:
        """Rendezvous (highest-random-weight) hash of the prompt's first block over the eligible replicas:
        every router process computes the same home for the same prefix without sharing any state, so N
        routers send a new shared prefix to one replica, not to N. Seed-free (blake2b), unlike str hash."""
        head = ",".join(map(str, toks[:self.block_size])).encode()
        return max(elig, key=lambda r: hashlib.blake2b(head + b"|" + r.url.encode(), digest_size=8).digest())

    def cost(self, r: Replica, n: int, hit: float, l2_tokens: int) -> float:
        """The one cost every cache-aware strategy minimises (see the module docstring)."""
        uncached = n - hit - self.l2_credit * max(0.0, l2_tokens - hit)
        ext = n * (r.ext_waiting + self.decode_beta * r.ext_running)
        return uncached + r.prefill_tokens + self.decode_beta * r.decode_tokens + ext + self.request_cost * r.load

    def choose(self, strategy: str, cands: Sequence[Replica], tokens: Sequence[int] | None, *,
               session: str | None = None, model: str | None = None, cache_salt: str | None = None,
               l2_tokens: int | Mapping[str | None, int] = 0) -> Decision:
        return self.plan(strategy, cands, tokens, session=session, model=model,
                         cache_salt=cache_salt).decide(l2_tokens)

    def plan(self, strategy: str, cands: Sequence[Replica], tokens: Sequence[int] | None, *,
             session: str | None = None, model: str | None = None, cache_salt: str | None = None) -> Plan:
        """The choice up to the L2 hit: `Plan.l2_can_change()` says whether an L2 lookup is worth waiting
        for, `Plan.decide(l2)` finishes it. Decide right away (no await in between): costs read live loads."""
        if not cands:
            raise LookupError("no replica available")
        return REGISTRY[self.check_strategy(strategy)].plan(self, RouteRequest(
            cands, tokens or (), session, model, cache_salt))

    def least_cost(self, strat: Strategy, req: RouteRequest) -> Plan:
        """Shared by the cache-aware strategies: cheapest eligible replica by `cost`, given strat's hits.
        Scored here without L2 (cost(l2) = cost(0) - l2_credit * max(0, l2 - hit)); L2 enters in decide."""
        toks, n = req.tokens, len(req.tokens)
        root = root_key(req.model) if req.model and req.model in self.kv.loras else root_key()
        extra0 = ("salt", str(req.cache_salt)) if req.cache_salt else None
        keys = block_keys(toks, self.block_size, root, extra0)
        hits = strat.hits(self, keys, toks, root, extra0)
        sticky = self._sessions.get(req.session) if req.session else None
        elig = self._eligible(req.cands)
        held = [min(hits.get(r.url, 0.0), n) for r in elig]
        base = []
        for r, h in zip(elig, held, strict=True):
            cost = self.cost(r, n, h, 0)
            if strat.sticky and r.url == sticky:
                cost -= self.session_bonus_frac * max(n, 1) + 1
            base.append(cost)
        home = bool(self.affinity and toks and not any(h > 0 for h in held) and (
            not strat.sticky or sticky not in {e.url for e in elig}))
        return _CostPlan(self, strat, req, keys, hits, elig, held, base, sticky, home)

    def _finish(self, plan: _CostPlan, l2_tokens: int | Mapping[str | None, int]) -> Decision:
        """least_cost's second half: add the L2 credit, pick, name the reason, remember the session."""
        strat, req, elig, sticky, hits = plan.strat, plan.req, plan.elig, plan.sticky, plan.hits
        n = len(req.tokens)
        req.l2_tokens = l2_tokens
        if plan.home:
            r = self._home(req.tokens, elig)  # nobody holds it: the home all routers agree on
        else:
            r = self._pick_min([(c - self.l2_credit * max(0.0, req.l2_of(e) - h), e)
                                for c, e, h in zip(plan.base, elig, plan.held, strict=True)])
        h = int(min(hits.get(r.url, 0.0), n))
        if strat.sticky and sticky == r.url:
            reason = "session"
        elif plan.home:
            reason = "affinity"
        elif h > 0:
            reason = "cache_hit"
        elif len(elig) < len(req.cands) and any(hits.get(c.url, 0) > 0 for c in req.cands if c not in elig):
            reason = "load_cap"
        else:
            reason = "least_cost"
        if req.session:
            self._sessions[req.session] = r.url
            self._sessions.move_to_end(req.session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return Decision(r, reason, h, req.l2_of(r), int(n - h), plan.keys)

    def record(self, strategy: str, d: Decision) -> None:
        """Remember where this prefix went (what that means is the strategy's)."""
        REGISTRY[strategy].record(self, d)


@dataclass
class RouteRequest:
    """What a strategy sees of one request."""

    cands: Sequence[Replica]
    tokens: Sequence[int]
    session: str | None = None
    model: str | None = None
    cache_salt: str | None = None
    l2_tokens: int | Mapping[str | None, int] = 0  # one L2 hit for all, or per kv-prefix (None: the default)

    def l2_of(self, r: Replica) -> int:
        """The L2 hit replica r can load: the one under the kv-prefix its pod announces."""
        if isinstance(self.l2_tokens, int):
            return self.l2_tokens
        return self.l2_tokens.get(r.kv_prefix, 0)


class Plan:
    """A routing choice up to the L2 hit (Policy.plan)."""

    def l2_can_change(self) -> bool:
        """Whether some L2 hit could pick another replica than none would (so the lookup is worth its wait)."""
        return False

    def decide(self, l2_tokens: int | Mapping[str | None, int] = 0) -> Decision:
        raise NotImplementedError


@dataclass
class _Fixed(Plan):
    """A strategy whose choice ignores L2 (roundrobin): decide just runs it."""

    run: Callable[[], Decision]

    def decide(self, l2_tokens: int | Mapping[str | None, int] = 0) -> Decision:
        return self.run()


@dataclass
class _CostPlan(Plan):
    """least_cost scored without L2: base[i] is elig[i]'s cost at an L2 hit of 0, held[i] its capped hit."""

    policy: Policy
    strat: Strategy
    req: RouteRequest
    keys: list[int]
    hits: dict[str, float]
    elig: list[Replica]
    held: list[float]
    base: list[float]
    sticky: str | None
    home: bool

    def l2_can_change(self) -> bool:
        """An L2 hit L lowers elig[i]'s cost by credit * max(0, L - held[i]), so replica j gains at most
        credit * max(0, held[w] - held[j]) on the cheapest w, whatever L is: if every other replica's cost
        gap to w exceeds that, no lookup answer changes the pick. Replicas with equal hits move together.
        Nobody holding the prompt (the home hash decides) is the common case; one kv-prefix per fleet is
        assumed (several: each gets its own L2 hit, so always look)."""
        c = self.policy.l2_credit
        if self.home or c <= 0 or len(self.elig) < 2:
            return False
        if len({r.kv_prefix for r in self.elig}) > 1:
            return True
        w = min(range(len(self.elig)), key=self.base.__getitem__)
        return any(j != w and self.held[j] != self.held[w]
                   and self.base[j] - self.base[w] <= c * max(0.0, self.held[w] - self.held[j]) + 1e-9
                   for j in range(len(self.elig)))

    def decide(self, l2_tokens: int | Mapping[str | None, int] = 0) -> Decision:
        return self.policy._finish(self, l2_tokens)


class Strategy:
    """One routing strategy. Cache-aware ones only say which replicas hold how much of the prompt (`hits`);
    the choice itself is Policy.least_cost, so every strategy trades cache against load the same way."""

    name: str = ""
    sticky = False  # the session bonus applies

    def plan(self, policy: Policy, req: RouteRequest) -> Plan:
        return policy.least_cost(self, req)

    def hits(self, policy: Policy, keys: list[int], toks: Sequence[int], root: int,
             extra0: object) -> dict[str, float]:
        """Predicted cached tokens per replica URL."""
        return {}

    def record(self, policy: Policy, d: Decision) -> None:
        """Remember a routed request (what later `hits` read)."""


REGISTRY: dict[str, Strategy] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    if cls.name not in STRATEGIES:
        raise ValueError(f"strategy {cls.name!r} is not in kvtier.contract.STRATEGIES")
    REGISTRY[cls.name] = cls()
    return cls


@register
class RoundRobin(Strategy):
    """Cache-blind rotation (the baseline; no tokenization needed)."""

    name = "roundrobin"

    def plan(self, policy: Policy, req: RouteRequest) -> Plan:
        def run() -> Decision:
            r = req.cands[policy._rr % len(req.cands)]
            policy._rr += 1
            return Decision(r, "roundrobin", uncached=len(req.tokens))
        return _Fixed(run)


@register
class PrefixAware(Strategy):
    """Hits = where the router itself sent each prefix before (an approximate tree, no engine events)."""

    name = "prefixaware"

    def hits(self, policy: Policy, keys: list[int], toks: Sequence[int], root: int,
             extra0: object) -> dict[str, float]:
        return {url: b * policy.block_size for url, b in policy.tree.match(keys).items()}

    def record(self, policy: Policy, d: Decision) -> None:
        policy.tree.insert(d.keys, d.replica.url)


@register
class Session(PrefixAware):
    """prefixaware plus a bonus for the replica that served the session last."""

    name = "session"
    sticky = True


@register
class KVAware(Strategy):
    """Hits = the engines' own KV events (per block size and medium weight), plus what we routed in the
    last few seconds and the events have not confirmed yet; L2 presence enters through the cost."""

    name = "kvaware"

    def hits(self, policy: Policy, keys: list[int], toks: Sequence[int], root: int,
             extra0: object) -> dict[str, float]:
        hits = {url: float(b * policy.block_size) for url, b in policy.spec.match(keys).items()}
        for bs in policy.kv.block_sizes() or {policy.block_size}:
            ks = keys if bs == policy.block_size else block_keys(toks, bs, root, extra0)
            for url, (_b, weighted) in policy.kv.match(ks).items():
                if policy.kv.block_size(url) == bs:
                    hits[url] = max(hits.get(url, 0.0), weighted * bs)
        return hits

    def record(self, policy: Policy, d: Decision) -> None:
        policy.spec.insert(d.keys, d.replica.url, ttl=policy.speculative_ttl)


if set(REGISTRY) != set(STRATEGIES):
    raise ImportError(f"strategies without a class: {sorted(set(STRATEGIES) - set(REGISTRY))}")
