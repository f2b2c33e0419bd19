"""The router reads the engines' key-check records (router.l2.L2Lookup.scan_key_records) from a real l2fs
cluster with scoped tokens, as its router-role token: agreeing records give "ok (verified by N engine
records)", one disagreeing record turns L2 credit off (drift, naming the replica) until it agrees again, and
malformed, old-format, stale and other-model records are no evidence (the malformed ones logged once).

The records here are written as the LMCache plugin writes them (kvtier.contract.kat_record, same path and
fields as connector.fingerprint); tests/router/test_router_engine_keydrift.py has a real plugin write one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from kvtier import contract
from l2fs.client import Client
from router.l2 import L2Lookup

MODEL = "org/model-a"
WORKER_TOKEN = "worker-token-0123456789"
MASTER_TOKEN = "master-token-0123456789"
ROUTER_TOKEN = "router-token-0123456789"
ADMIN_TOKEN = "admin-token-01234567890"
TOKENS = [
    {"name": "master", "token": MASTER_TOKEN, "role": "worker"},
    {"name": "worker-node-1", "token": WORKER_TOKEN, "role": "worker", "node": "node-1"},
    {"name": "router-default", "token": ROUTER_TOKEN, "role": "router"},
    {"name": "ops", "token": ADMIN_TOKEN, "role": "admin"},
]
GOOD_KEYS = contract.chunk_hashes(contract.KAT_TOKENS, contract.CHUNK_SIZE, "0")


@pytest.fixture
def l2(tmp_path, make_cluster: Callable[..., Any]) -> Any:
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(TOKENS))
    return make_cluster(1, token=ADMIN_TOKEN, master_args=["--tokens-file", str(f), "--token", MASTER_TOKEN],
                        worker_args=["--tokens-file", str(f), "--token", WORKER_TOKEN])


def _write(admin: Client, replica: str, body: object, model: str = MODEL) -> None:
    """An engine's key-compat record (the admin token stands in for the engine's)."""
    d = contract.model_dir(contract.META_PREFIX, model)
    admin.mkdir(d, parents=True, exist_ok=True)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    admin.put(f"{d}/{contract.esc(replica)}.json", raw, if_absent=False)


def _record(replica: str, keys: list[int] = GOOD_KEYS, state: str = contract.KEY_OK, seed: str = "0") -> dict:
    return {"model_name": MODEL, "chunk_size": 256, "python_hash_seed": seed, "replica": replica,
            "node_id": "node-1", contract.KAT_RECORD_FIELD: contract.kat_record(state, 256, seed, keys, "engine")}


def _lookup(l2: Any, **kw: Any) -> L2Lookup:
    """A router's lookup on its router-role token; key_check off: only the records scans decide (no child)."""
    return L2Lookup(l2.master, client=Client(l2.master, token=ROUTER_TOKEN, timeout=5.0), key_check=False, **kw)


def _scan(lk: L2Lookup) -> tuple[str, str]:
    lk.scan_key_records()
    return lk.key_state, lk.key_detail


def test_records_verify_drift_and_clear(l2: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.router.l2")
    admin = l2.client(timeout=5.0)
    lk = _lookup(l2, model_name=MODEL)
    tokens = [(i * 31 + 7) % 50000 for i in range(2 * 256)]
    for h in contract.chunk_hashes(tokens):  # the chunks an engine of today's LMCache wrote: 512 tokens of credit
        admin.put(contract.plugin_path(contract.KV_PREFIX, MODEL, 1, 0, h, "float"), b"kv")

    assert _scan(lk) == (contract.KEY_PENDING, "not checked yet")  # no records: no evidence
    assert lk.lookup(tokens, MODEL) == 512

    _write(admin, "rep-a", _record("rep-a"))
    _write(admin, "rep-b", _record("rep-b"))
    _write(admin, "old", {"model_name": MODEL, "replica": "old"})  # before the field: no evidence
    _write(admin, "unseeded", _record("unseeded", seed=""))  # keys not computable here: no evidence
    _write(admin, "garbage", b"{not json")
    _write(admin, "badkeys", {**_record("badkeys"), contract.KAT_RECORD_FIELD: {"state": "ok", "keys": "x",
                                                                                "chunk_size": 256, "seed": "0"}})
    _write(admin, "notdict", [1, 2])
    # another model's drifted engine does not count for a router of MODEL
    _write(admin, "other", _record("other", state=contract.KEY_DRIFT), model="org/other")
    assert _scan(lk) == (contract.KEY_OK, "verified by 2 engine records")
    ignored = [r.getMessage() for r in caplog.records if "ignored (malformed" in r.getMessage()]
    assert len(ignored) == 3 and all(any(n in m for m in ignored) for n in ("garbage", "badkeys", "notdict"))
    _scan(lk)
    assert len([r for r in caplog.records if "ignored (malformed" in r.getMessage()]) == 3  # logged once each
    assert lk.lookup(tokens, MODEL) == 512

    # an engine whose LMCache computes other keys (its own check said ok: e.g. kvtier and LMCache changed together)
    _write(admin, "rep-new", _record("rep-new", keys=[k + 1 for k in GOOD_KEYS]))
    state, detail = _scan(lk)
    assert state == contract.KEY_DRIFT and "rep-new" in detail and "rep-a" not in detail
    drift = [r for r in caplog.records if r.getMessage().startswith("KVTIER KEY DRIFT")]
    assert len(drift) == 1 and drift[0].levelno == logging.ERROR and "rep-new" in drift[0].getMessage()
    assert lk.lookup(tokens, MODEL) == 0  # no L2 credit
    _scan(lk)
    assert len([r for r in caplog.records if r.getMessage().startswith("KVTIER KEY DRIFT")]) == 1  # no repeat

    # its record says drift (its own check) even with the contract's keys
    _write(admin, "rep-new", _record("rep-new", state=contract.KEY_DRIFT))
    assert _scan(lk)[0] == contract.KEY_DRIFT

    # rolled back: the same replica rewrites an agreeing record; the next scan clears the drift
    _write(admin, "rep-new", _record("rep-new"))
    assert _scan(lk) == (contract.KEY_OK, "verified by 3 engine records")
    assert any("drift cleared" in r.getMessage() for r in caplog.records)
    assert lk.lookup(tokens, MODEL) == 512

    # a router without --l2fs-model-name reads every model's records: the other model's drift counts there
    every = _lookup(l2)
    state, detail = _scan(every)
    assert state == contract.KEY_DRIFT and "'other'" in detail

    # records older than the max age are a gone engine's: no evidence
    stale = _lookup(l2, model_name=MODEL, key_records_max_age=1e-6)
    assert _scan(stale)[0] == contract.KEY_PENDING

    # a scan that fails (master gone) changes nothing
    _write(admin, "rep-new", _record("rep-new", keys=[k + 1 for k in GOOD_KEYS]))
    assert _scan(lk)[0] == contract.KEY_DRIFT
    admin.close()
    l2.kill_master()
    assert _scan(lk)[0] == contract.KEY_DRIFT
    assert any("key records unreadable" in r.getMessage() for r in caplog.records)


@pytest.mark.unit
def test_kat_record_verdicts() -> None:
    """contract.kat_record_verdict on its own: what counts as evidence, drift, or garbage."""
    good = _record("r")
    assert contract.kat_record_verdict(good) == (contract.KEY_OK, "its chunk keys match kvtier.contract (seed 0, "
                                                                  "chunk 256)")
    assert contract.kat_record_verdict({"replica": "r"}) is None
    assert contract.kat_record_verdict(_record("r", keys=[])) is None
    assert contract.kat_record_verdict(_record("r", seed="random")) is None
    assert contract.kat_record_verdict(_record("r", keys=GOOD_KEYS[:1]))[0] == contract.KEY_DRIFT
    other_seed = contract.chunk_hashes(contract.KAT_TOKENS, 256, "7")
    assert contract.kat_record_verdict(_record("r", keys=other_seed, seed="7"))[0] == contract.KEY_OK  # its own seed
    for bad in ([], {contract.KAT_RECORD_FIELD: "x"}, {contract.KAT_RECORD_FIELD: {"state": "maybe"}},
                {contract.KAT_RECORD_FIELD: {**good[contract.KAT_RECORD_FIELD], "chunk_size": 0}},
                {contract.KAT_RECORD_FIELD: {**good[contract.KAT_RECORD_FIELD], "keys": [True]}}):
        with pytest.raises(ValueError):
            contract.kat_record_verdict(bad)
