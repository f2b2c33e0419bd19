"""Engine-side key-drift check: hash kvtier.contract.KAT_TOKENS with the INSTALLED LMCache / vLLM at start-up.

Why: kvtier.contract reimplements (or, for blake3, pins) how the engine names chunks, and the router looks
chunks up by those names. An LMCache or vLLM that hashes differently writes keys nobody can find: the router
credits nothing and, worse, replicas of the old and the new version miss each other's chunks silently. So
each engine-side component (the LMCache plugin, the MP adapter, the native tier) checks once at start-up
and, on a mismatch, stops writing L2 (reads stay: they are misses at worst), with one ERROR line starting
"KVTIER KEY DRIFT" and the gauge kvtier_key_check{component,state} (1 for the current state).

What is compared, per hash algorithm:
* LMCache `builtin` (in-process mode): the installed ChunkedTokenDatabase's chain == contract.builtin_chain
  from the NONE_HASH it uses, and that NONE_HASH == hash(seed string) (vLLM's init_none_hash rule); and when
  this process's string hash is keyed by its PYTHONHASHSEED, the keys == contract.chunk_hashes(seed), i.e.
  what the router computes. Whether replicas agree on the seed itself is connector.fingerprint's check.
* MP mode `blake3` (LMCache's default): the installed TokenHasher's digests == contract.MP_BLAKE3_KAT.
* vLLM native `sha256` (vLLM's default): hash_block_tokens with vLLM's own sha256 and NONE_HASH ==
  contract.vllm_block_hashes.
Anything else has no reference here: KEY_UNVERIFIED, a warning, writes continue.

The LMCache plugin also publishes its verdict and the keys it computed (Verdict.record) in its key-compat record
(connector.fingerprint), so the router, whose image has no LMCache, checks the engines' keys against its own
contract (router.l2).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from kvtier import contract

log = logging.getLogger("kvtier.connector.keycheck")

try:  # optional: a gauge in whatever registry this process exports
    from prometheus_client import Gauge

    GAUGE: Any = Gauge("kvtier_key_check", "Start-up check of chunk keys against kvtier.contract: 1 for the "
                       "current state (ok, drift = L2 writes stopped, unverified)", ["component", "state"])
except Exception:  # noqa: BLE001 - duplicate registration or no prometheus_client
    GAUGE = None


@dataclass(frozen=True)
class Verdict:
    state: str  # contract.KEY_OK | KEY_DRIFT | KEY_UNVERIFIED
    detail: str
    keys: tuple[int, ...] = ()  # what the installed library computed for KAT_TOKENS (builtin checks only)
    chunk_size: int = 0
    seed: str = ""  # the PYTHONHASHSEED this process's string hash is keyed by ("" = not known to be)

    @property
    def writes_allowed(self) -> bool:
        return self.state != contract.KEY_DRIFT

    def record(self) -> dict[str, Any]:
        """This verdict as the engine publishes it in its key-compat record (contract.KAT_RECORD_FIELD), so a
        router without LMCache can check the engine's keys against its own contract."""
        return contract.kat_record(self.state, self.chunk_size, self.seed, self.keys, self.detail)


def lmcache_builtin(cfg: Any, meta: Any) -> Verdict:
    """The in-process LMCache plugin's keys (ChunkedTokenDatabase of this engine's config) vs the contract."""
    algo = str(getattr(cfg, "pre_caching_hash_algorithm", "builtin") or "builtin")
    chunk = int(getattr(cfg, "chunk_size", 0) or contract.CHUNK_SIZE)
    if algo != "builtin":
        return Verdict(contract.KEY_UNVERIFIED, f"hash algorithm {algo!r} has no reference in kvtier.contract "
                                                "(the router computes builtin keys only)")
    from lmcache.v1 import token_database as tdb

    db = tdb.ChunkedTokenDatabase(cfg, meta)
    got = [int(h) for _s, _e, h in db.process_tokens(tokens=list(contract.KAT_TOKENS), make_key=False)]
    env_seed = os.environ.get("PYTHONHASHSEED")
    keyed = ""  # the seed this process's string hash is keyed by, when the environment's is (a router recomputes)
    if env_seed is not None and env_seed.isdigit() and int(env_seed) <= 0xFFFFFFFF:
        probe = "kvtier-probe"
        if hash(probe) == contract.str_hash(probe, int(env_seed)):
            keyed = env_seed

    def verdict(state: str, detail: str) -> Verdict:  # with the keys, for the engine's published record
        return Verdict(state, detail, tuple(got), chunk, keyed)

    none = int(tdb.NONE_HASH)
    if got != contract.builtin_chain(contract.KAT_TOKENS, chunk, none):
        return verdict(contract.KEY_DRIFT, "the installed LMCache chains chunk hashes differently from "
                                           f"kvtier.contract (chunk {chunk}): first {got[:1]}")
    seed_text = env_seed if env_seed is not None else contract.VLLM_DEFAULT_NONE_HASH_SEED
    if none != hash(seed_text):
        return verdict(contract.KEY_DRIFT, f"the installed LMCache/vLLM derive NONE_HASH otherwise than "
                                           f"hash({seed_text!r}) (kvtier.contract.none_hash)")
    if keyed:
        if got != contract.chunk_hashes(contract.KAT_TOKENS, chunk, keyed):
            return verdict(contract.KEY_DRIFT, f"chunk keys differ from kvtier.contract's (seed {keyed})")
        return verdict(contract.KEY_OK, f"LMCache builtin keys match kvtier.contract (seed {keyed})")
    return verdict(contract.KEY_OK, "LMCache builtin chaining matches kvtier.contract (this process's string "
                                    "hash is not keyed by a PYTHONHASHSEED: seed agreement not checked here)")


def lmcache_mp(hash_algorithm: str = "blake3", chunk_size: int = contract.CHUNK_SIZE) -> Verdict:
    """The MP server's keys: the installed LMCache TokenHasher on KAT_TOKENS vs the contract."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    th = TokenHasher(chunk_size=chunk_size, hash_algorithm=hash_algorithm)
    got = th.compute_chunk_hashes(list(contract.KAT_TOKENS))
    if hash_algorithm == "blake3" and chunk_size == contract.CHUNK_SIZE:
        hexes = tuple(bytes(h).hex() for h in got)
        if hexes != contract.MP_BLAKE3_KAT:
            return Verdict(contract.KEY_DRIFT, "the installed LMCache MP server hashes chunks otherwise than "
                                               f"kvtier.contract.MP_BLAKE3_KAT (first {hexes[:1]})")
        return Verdict(contract.KEY_OK, "LMCache MP blake3 keys match kvtier.contract")
    return Verdict(contract.KEY_UNVERIFIED, f"no reference in kvtier.contract for MP hash {hash_algorithm!r} "
                                            f"with chunk {chunk_size}")


def vllm_native(hash_algorithm: str = "sha256", block_size: int = 16) -> Verdict:
    """vLLM's own block hashes (what native offloading keys are) vs contract.vllm_block_hashes."""
    if hash_algorithm != "sha256":
        return Verdict(contract.KEY_UNVERIFIED, f"no reference in kvtier.contract for vLLM hash {hash_algorithm!r}")
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

    fn = get_hash_fn_by_name(hash_algorithm)
    seed = resolve_none_hash_seed(fn)
    parent, got = fn(seed), []
    toks = contract.KAT_TOKENS
    for i in range(0, len(toks) - len(toks) % block_size, block_size):
        parent = hash_block_tokens(fn, parent, toks[i:i + block_size], None)
        got.append(bytes(parent))
    if got != contract.vllm_block_hashes(toks, block_size, seed):
        return Verdict(contract.KEY_DRIFT, "the installed vLLM hashes blocks otherwise than "
                                           "kvtier.contract.vllm_block_hashes")
    return Verdict(contract.KEY_OK, "vLLM sha256 block hashes match kvtier.contract")


def run(component: str, check: Any, *args: Any, **kwargs: Any) -> Verdict:
    """Run one check; a check that itself fails is KEY_UNVERIFIED (start-up never fails because of it)."""
    try:
        v = check(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        v = Verdict(contract.KEY_UNVERIFIED, f"the check could not run: {e}")
    report(component, v)
    return v


def report(component: str, v: Verdict) -> None:
    if v.state == contract.KEY_DRIFT:
        log.error("KVTIER KEY DRIFT: %s: %s; L2 writes are stopped (they would be keys no router or other "
                  "replica finds); reads continue", component, v.detail)
    elif v.state == contract.KEY_UNVERIFIED:
        log.warning("kvtier key check (%s): unverified: %s", component, v.detail)
    else:
        log.info("kvtier key check (%s): %s", component, v.detail)
    if GAUGE is not None:
        for s in (contract.KEY_OK, contract.KEY_DRIFT, contract.KEY_UNVERIFIED):
            GAUGE.labels(component, s).set(1 if s == v.state else 0)
