"""In-process unit tier for the router's data structures: PrefixTree, KVIndex and the Policy cost/strategies."""

from __future__ import annotations

import random
import time

import pytest

from kvtier import contract
from router.index import KVIndex, PrefixTree, block_keys, contiguous_match, root_key
from router.policy import REGISTRY, Decision, Policy, UnknownStrategy
from router.replicas import Replica

pytestmark = pytest.mark.unit

TOK = list(range(1000, 1064))  # 4 blocks of 16


# -- keys ------------------------------------------------------------------------------------------------
def test_block_keys_are_chained_full_blocks_only() -> None:
    k = block_keys(TOK + [1, 2, 3], 16)
    assert len(k) == 4 and k == block_keys(TOK, 16)
    changed = block_keys([7, *TOK[1:]], 16)
    assert all(a != b for a, b in zip(k, changed, strict=True))  # a change in block 0 changes every key
    assert block_keys(TOK, 16, root_key("lora-a")) != k  # a LoRA / salt root is its own namespace
    assert block_keys(TOK, 16, extra0=("salt", "s"))[0] != k[0]


def test_contiguous_match_stops_at_the_first_gap() -> None:
    have = {1: ["a", "b"], 2: ["a"], 3: ["a", "b"], 4: ["b"]}
    assert contiguous_match([1, 2, 3, 4], lambda k: have.get(k, [])) == {"a": 3, "b": 1}
    assert contiguous_match([9, 1], lambda k: have.get(k, [])) == {}


# -- PrefixTree -------------------------------------------------------------------------------------------
def test_prefix_tree_match_purge_ttl_and_lru_cap() -> None:
    t = PrefixTree(max_blocks=6)
    keys = block_keys(TOK, 16)
    t.insert(keys[:3], "a")
    t.insert(keys, "b")
    assert t.match(keys) == {"a": 3, "b": 4}
    t.purge("a")  # O(1) generation bump: a's entries no longer count
    assert t.match(keys) == {"b": 4}
    t.insert(keys[:2], "a")  # and new ones after the purge do
    assert t.match(keys) == {"a": 2, "b": 4}
    t.insert(keys[:1], "c", ttl=0.05)
    assert t.match(keys)["c"] == 1
    time.sleep(0.1)
    assert "c" not in t.match(keys)  # speculative entries expire
    other = block_keys(list(range(5000, 5064)), 16)
    t.match(keys[:1])  # touch: keys[0] is now most recent
    t.insert(other, "x")  # 4 + 4 > 6: the 2 least recently used blocks go
    assert len(t) == 6 and keys[0] in t._nodes and keys[1] not in t._nodes


def test_prefix_tree_flapping_replica_leaves_bounded_entries() -> None:
    """A purge moves a replica to a new tag; the old tag's entries go the next time their block is written, so a
    replica that flaps (down, up, down...) cannot grow a block's entries without bound."""
    t = PrefixTree()
    keys = block_keys(TOK, 16)
    for _ in range(50):
        t.insert(keys, "a")
        t.insert(keys, "b")
        t.purge("a")
    assert t.match(keys) == {"b": 4}
    assert max(len(n) for n in t._nodes.values()) <= 3  # live tags (a's new one, b) plus at most one purged


# -- KVIndex ----------------------------------------------------------------------------------------------
def test_kv_index_chains_engine_hashes_media_and_removal() -> None:
    idx = KVIndex()
    keys = block_keys(TOK, 16)
    idx.stored("r", [11, 12], None, TOK[:32], 16, "GPU")
    idx.stored("r", [13, 14], 12, TOK[32:], 16, "GPU")  # parent = engine hash of block 2
    assert idx.match(keys) == {"r": (4, 4.0)} and len(idx) == 4 and idx.block_sizes() == {16}
    idx.stored("s", [11], None, TOK[:16], 16, "CPU")
    n, weighted = idx.match(keys)["s"]
    assert n == 1 and weighted == pytest.approx(0.8)
    idx.removed("r", [13], "GPU")
    assert idx.match(keys)["r"][0] == 2
    idx.stored("q", [99], 12345, TOK[:16], 16)  # parent never seen: chain unknown, counted, not indexed
    assert idx.orphans == 1 and "q" not in idx.match(keys)
    idx.clear("r")
    assert "r" not in idx.match(keys) and idx.block_size("r") is None
    idx.clear("s")
    assert len(idx) == 0


def test_kv_index_same_block_on_two_media_needs_both_removed() -> None:
    idx = KVIndex()
    key = block_keys(TOK[:16], 16)
    idx.stored("r", [1], None, TOK[:16], 16, "GPU")
    idx.stored("r", [1], None, TOK[:16], 16, "CPU")
    idx.removed("r", [1], "GPU")
    assert idx.match(key)["r"][0] == 1  # still on CPU
    idx.removed("r", [1], "CPU")
    assert idx.match(key) == {}


def test_kv_index_salted_first_block_matches_request_keys() -> None:
    idx = KVIndex()
    idx.stored("r", [1, 2], None, TOK[:32], 16, extra_keys=[("salt-1",), None])
    assert idx.match(block_keys(TOK[:32], 16, extra0=("salt", "salt-1")))["r"][0] == 2
    assert idx.match(block_keys(TOK[:32], 16)) == {}


# -- Policy -----------------------------------------------------------------------------------------------
def reps(n: int) -> list[Replica]:
    return [Replica(f"http://r{i}") for i in range(n)]


def test_registry_is_the_contract_and_unknown_names_fail() -> None:
    assert set(REGISTRY) == set(contract.STRATEGIES)
    with pytest.raises(UnknownStrategy):
        Policy().choose("fastest", reps(1), TOK)
    with pytest.raises(LookupError):
        Policy().choose("prefixaware", [], TOK)


def test_cost_function() -> None:
    p = Policy(decode_beta=0.1, l2_credit=0.5)
    r = Replica("http://r", prefill_tokens=100, decode_tokens=1000)
    assert p.cost(r, n=64, hit=0, l2_tokens=0) == pytest.approx(64 + 100 + 100)
    assert p.cost(r, n=64, hit=32, l2_tokens=0) == pytest.approx(32 + 200)
    assert p.cost(r, n=64, hit=16, l2_tokens=48) == pytest.approx(48 - 0.5 * 32 + 200)  # L2 half price
    assert p.cost(r, n=64, hit=48, l2_tokens=16) == pytest.approx(16 + 200)  # L2 below the hit adds nothing


def test_request_cost_lets_a_short_prompt_yield_to_load_and_a_long_one_keep_its_hit() -> None:
    """Each request in flight costs the same whatever the new prompt's length, so the load it takes to outweigh
    a hit grows with the prompt: a short prompt moves to the idle replica, a long one stays with its prefix."""
    for request_cost, n, moves in ((0.0, 64, False), (32.0, 64, True), (32.0, 640, False)):
        p, (held, idle) = Policy(block_size=16, load_epsilon=10.0, request_cost=request_cost), reps(2)
        toks = list(range(1000, 1000 + n))
        p.record("prefixaware", Decision(held, "least_cost", keys=block_keys(toks, 16, root_key())))
        held.inflight = 3
        d = p.choose("prefixaware", [held, idle], toks)
        assert (d.replica is idle) == moves, (request_cost, n, d)
        assert p.cost(held, n, n, 0) == pytest.approx(request_cost * 3)


def test_l2_can_change_is_exact_where_it_says_no_and_decide_matches_choose() -> None:
    """Plan.l2_can_change() == False must mean no L2 hit of any length picks another replica (the router then
    skips the lookup); decide(l2) must pick as choose(l2_tokens=l2) does. Random fleets of 2-4 replicas with
    random holdings, loads and in-flight requests, every L2 length in whole chunks."""
    rng = random.Random(7)
    skipped = looked = 0
    for trial in range(400):
        k = rng.randint(2, 4)
        n = rng.choice((64, 300, 1100))
        toks = list(range(trial * 5000, trial * 5000 + n))
        p, rs = Policy(block_size=16, load_epsilon=10.0, request_cost=rng.choice((0.0, 100.0, 800.0)),
                       l2_credit=rng.choice((0.3, 0.5, 0.9))), reps(k)
        for r in rs:
            if rng.random() < 0.6:
                p.record("prefixaware", Decision(r, "least_cost", keys=block_keys(toks[:rng.randint(16, n)], 16,
                                                                                   root_key())))
            r.inflight = rng.randint(0, 3)
            r.prefill_tokens = rng.randint(0, 400)
        plan = p.plan("prefixaware", rs, toks)
        picks = set()
        for l2 in range(0, n + 256, 256):
            p._rng = random.Random(0)
            d = p.plan("prefixaware", rs, toks).decide(l2)
            p._rng = random.Random(0)
            assert p.choose("prefixaware", rs, toks, l2_tokens=l2).replica is d.replica
            picks.add(d.replica.url)
        if plan.l2_can_change():
            looked += 1
        else:
            skipped += 1
            assert len(picks) == 1, (trial, picks)
    assert skipped > 100 and looked > 20, (skipped, looked)  # both branches exercised


def test_l2_can_change_only_when_the_holder_is_ahead_by_less_than_l2_could_give() -> None:
    p, (held, idle) = Policy(block_size=16, load_epsilon=10.0, request_cost=800.0, l2_credit=0.5), reps(2)
    toks = list(range(1000, 2100))  # 1,100 tokens, 1,088 in whole blocks
    assert not p.plan("prefixaware", [held, idle], toks).l2_can_change()  # nobody holds it
    p.record("prefixaware", Decision(held, "least_cost", keys=block_keys(toks, 16, root_key())))
    assert not p.plan("prefixaware", [held, idle], toks).l2_can_change()  # idle holder: ahead by 1,088 > 544
    held.inflight = 1  # ahead by 288 now, and L2 could give the other replica up to 544
    plan = p.plan("prefixaware", [held, idle], toks)
    assert plan.l2_can_change()
    assert plan.decide(1024).replica is idle and p.plan("prefixaware", [held, idle], toks).decide(0).replica is held
    assert not p.plan("roundrobin", [held, idle], toks).l2_can_change()


def test_roundrobin_rotates() -> None:
    p, rs = Policy(), reps(3)
    assert [p.choose("roundrobin", rs, None).replica.url for _ in range(4)] == [r.url for r in rs + rs[:1]]


def test_prefixaware_follows_the_prefix_and_yields_to_load() -> None:
    p, rs = Policy(block_size=16, load_epsilon=0.25), reps(2)
    p._rng = random.Random(1)
    d = p.choose("prefixaware", rs, TOK)
    assert d.reason == "least_cost" and d.uncached == 64 and len(d.keys) == 4
    p.record("prefixaware", d)
    again = p.choose("prefixaware", rs, TOK + [5] * 20)
    assert again.replica is d.replica and again.reason == "cache_hit" and again.hit_tokens == 64
    d.replica.inflight = 5  # over the bounded-load cap: affinity yields
    moved = p.choose("prefixaware", rs, TOK)
    assert moved.replica is not d.replica and moved.reason == "load_cap"


def test_prefix_affinity_homes_agree_across_policies_and_yield_to_load() -> None:
    a, b = Policy(block_size=16, affinity=True), Policy(block_size=16, affinity=True)
    ra, rb = reps(4), reps(4)  # two routers' own Replica objects for the same four URLs
    homes = set()
    for doc in range(8):
        toks = [doc * 100 + i for i in range(64)]
        da, db = a.choose("prefixaware", ra, toks), b.choose("prefixaware", rb, toks)
        assert da.reason == db.reason == "affinity" and da.replica.url == db.replica.url
        homes.add(da.replica.url)
    assert len(homes) > 1  # spread by the hash
    toks = list(range(5000, 5064))
    home = a.choose("prefixaware", ra, toks).replica
    home.inflight = 5  # over the bounded-load cap: the home yields to the next replica in hash order
    moved = a.choose("prefixaware", ra, toks)
    assert moved.replica is not home and moved.reason == "affinity"
    for r in rb:  # the other router sees the same load: it yields the same way
        r.inflight = 5 if r.url == home.url else 0
    assert b.choose("prefixaware", rb, toks).replica.url == moved.replica.url


def test_session_bonus_and_kvaware_uses_events_and_speculation() -> None:
    p, rs = Policy(block_size=16), reps(2)
    d = p.choose("session", rs, list(range(64)), session="s1")
    other = next(r for r in rs if r is not d.replica)
    other.prefill_tokens = 0
    d.replica.prefill_tokens = 40  # busier, but within the session bonus
    assert p.choose("session", rs, list(range(64)), session="s1").reason == "session"
    # kvaware: engine events say r1 holds the prompt
    p2, rs2 = Policy(block_size=16), reps(2)
    p2.kv.stored(rs2[1].url, [1, 2, 3, 4], None, TOK, 16, "GPU")
    d2 = p2.choose("kvaware", rs2, TOK)
    assert d2.replica is rs2[1] and d2.reason == "cache_hit" and d2.hit_tokens == 64
    # speculative: a prompt routed a moment ago counts before its events arrive
    fresh = list(range(3000, 3032))
    d3 = p2.choose("kvaware", rs2, fresh)
    p2.record("kvaware", d3)
    assert p2.choose("kvaware", rs2, fresh).replica is d3.replica
    assert isinstance(d3, Decision) and d3.l2_tokens == 0


def test_kvaware_credits_l2_per_replica_kv_prefix():
    """An L2 hit counts only for replicas whose announced kv-prefix holds it; no annotation = the default."""
    p = Policy(block_size=16)
    a, b, c = Replica("http://a", kv_prefix="/kvtier/kv/ep/rev-1"), Replica("http://b", kv_prefix="/kvtier/kv/ep/rev-2"), \
        Replica("http://c")
    toks = list(range(5000, 5512))
    d = p.choose("kvaware", [a, b, c], toks, l2_tokens={"/kvtier/kv/ep/rev-2": 512, None: 0, "/kvtier/kv/ep/rev-1": 0})
    assert d.replica is b and d.l2_tokens == 512
    d = p.choose("kvaware", [a, b, c], list(range(6000, 6512)), l2_tokens={None: 256})
    assert d.replica is c and d.l2_tokens == 256  # unannotated replica: the --l2fs-prefix lookup
    d = p.choose("kvaware", [a], list(range(7000, 7512)), l2_tokens=128)  # one number: shared by all
    assert d.l2_tokens == 128
