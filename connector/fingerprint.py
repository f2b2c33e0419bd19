"""Key-compatibility fingerprints: detect replicas that would silently miss each other's L2 chunks.

Why: LMCache chunk keys depend on PYTHONHASHSEED (builtin hash), the model name, KV dtype, chunk size, the
hash algorithm and the world size. Two replicas that differ in any of these never hit each other's chunks,
and nothing in LMCache says so. Each replica's L2 connector writes its fingerprint to
/kvtier/meta/<escaped model>/<replica id>.json at start (and re-checks periodically); any other record for
the same model that differs is reported LOUDLY: an ERROR log line starting with "KVTIER KEY MISMATCH" and the
Prometheus counter `kvtier_key_mismatch_total`. `kvtier lmcache-config check` lists the records.

The LMCache plugin adds its start-up key check (connector.keycheck: the keys its installed LMCache computed for
kvtier.contract.KAT_TOKENS, field kvtier.contract.KAT_RECORD_FIELD) and rewrites the record every
kvtier.contract.KEY_RECORD_REFRESH_S; the router reads these (router.l2) to notice engines whose LMCache hashes
otherwise than its contract. Older records without the field are no evidence to it.

The record also holds the model revision (connector.revision: weights identity). Replicas of different
revisions write under different prefixes, so they never load each other's chunks (a mismatch is a miss);
two replicas of the same model name with different revisions are still reported loudly, because outside a
rolling update that means one name serves two different models.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from kvtier import envs as kvtier_envs
from kvtier.contract import META_PREFIX, esc

log = logging.getLogger("kvtier.connector.fingerprint")
KEY_FIELDS = ("model_name", "kv_dtype", "chunk_size", "hash_algorithm", "python_hash_seed", "world_size",
              "model_revision")

try:  # optional: a counter in whatever registry this process exports
    from prometheus_client import Counter

    MISMATCH: Any = Counter("kvtier_key_mismatch", "Replicas whose LMCache key fingerprint differs from ours")
except Exception:  # noqa: BLE001 - duplicate registration or no prometheus_client
    MISMATCH = None


def fingerprint(cfg: Any, meta: Any, revision: str = "") -> dict[str, Any]:
    """The fields that decide LMCache chunk keys (and, with the revision, chunk contents) for this process."""
    algo = str(getattr(cfg, "pre_caching_hash_algorithm", "builtin") or "builtin")
    seed = os.environ.get("PYTHONHASHSEED", "")
    return {
        "model_name": str(meta.model_name),
        "kv_dtype": str(meta.kv_dtype).replace("torch.", ""),
        "chunk_size": int(getattr(cfg, "chunk_size", 0) or meta.chunk_size),
        "hash_algorithm": algo,
        # only the builtin hash depends on the seed; other algorithms are seed-free
        "python_hash_seed": seed if algo == "builtin" else "n/a",
        "world_size": int(meta.world_size),
        "model_revision": revision or None,  # None = not configured (records written before revisions too)
    }


def replica_id(node_id: str = "") -> str:
    return kvtier_envs.get("KVTIER_REPLICA_ID") or f"{node_id or socket.gethostname()}-{os.getpid()}"


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (a.get(k), b.get(k)) for k in KEY_FIELDS if a.get(k) != b.get(k)}


def publish(client: Any, cfg: Any, meta: Any, *, node_id: str = "", revision: str = "",
            extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """Write (or rewrite) our record; returns (fingerprint, replica id). `extra`: more fields, e.g. the key
    check's known-answer result (kvtier.contract.KAT_RECORD_FIELD), which readers without it take as no evidence."""
    fp = fingerprint(cfg, meta, revision)
    rid = replica_id(node_id)
    d = f"{META_PREFIX}/{esc(fp['model_name'])}"
    client.mkdir(d, parents=True, exist_ok=True)
    rec = {**(extra or {}), **fp, "replica": rid, "node_id": node_id, "time": time.time()}
    client.put(f"{d}/{esc(rid)}.json", json.dumps(rec).encode(), if_absent=False)
    return fp, rid


def record_and_check(client: Any, cfg: Any, meta: Any, *, node_id: str = "", revision: str = "",
                     extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Publish our record, compare with the others of the same model; returns the mismatching records."""
    fp = fingerprint(cfg, meta, revision)
    if fp["hash_algorithm"] == "builtin" and fp["python_hash_seed"] in ("", "random"):
        _loud(f"PYTHONHASHSEED is not fixed in replica {replica_id(node_id)}: LMCache's builtin chunk hash "
              "differs per process, so no other process (not even this replica's scheduler) can hit its chunks. "
              "Set PYTHONHASHSEED=0.")
    fp, rid = publish(client, cfg, meta, node_id=node_id, revision=revision, extra=extra)
    return check(client, fp, rid)


def load_records(client: Any, model_name: str) -> list[dict[str, Any]]:
    d = f"{META_PREFIX}/{esc(model_name)}"
    out = []
    for info in client.ls(d):
        raw = client.get(info.path)
        if raw is None:
            continue
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


def check(client: Any, fp: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    bad = []
    for rec in load_records(client, fp["model_name"]):
        if rec.get("replica") == rid:
            continue
        dd = diff(fp, rec)
        if dd:
            bad.append(rec)
            what = ", ".join(f"{k}: ours={a!r} theirs={b!r}" for k, (a, b) in dd.items())
            if "model_revision" in dd:
                what += ("; different model weights under one model name: their chunks live under separate "
                         "revision prefixes and are never loaded across (expected only during a model update)")
            _loud(f"replica {rid} and replica {rec.get('replica')} (node {rec.get('node_id')}) use "
                  f"incompatible LMCache keys for model {fp['model_name']!r} ({what}); they will never hit "
                  "each other's L2 chunks")
    return bad


def _loud(msg: str) -> None:
    log.error("KVTIER KEY MISMATCH: %s", msg)
    if MISMATCH is not None:
        MISMATCH.inc()
