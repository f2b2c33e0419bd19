"""Read scopes (trust as deployed): an engine or mount credential of endpoint A reads, lists and looks up only
under its own prefixes and the shared key-compat records, against real master and worker processes with a
scoped tokens file and a block key (what `kvtier tokens generate` and deploy/ give every cluster).

Before, an engine token read and looked up everything: A listed /kvtier/kv and saw B's (salted) directory
names, stat'ed B's chunks (with a read capability for each block), read them and ran prefix lookups over B's
keys. Now a path outside the caller's read scope gets the answer a missing path gets (Stat/StatMany: not there,
PrefixLookup: the chain's first miss, List: NOT_FOUND; a mount's Delete: nothing removed, Rename: NOT_FOUND),
whether it exists or not, and a listing of a directory on the way to its prefixes (/, /kvtier, /kvtier/kv)
shows only the entries on that way. The router and admin tokens still read everything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from reliability_faults import DEADLINE, payload

from kvtier import contract
from l2fs.client import L2fsError, NotFound
from l2fs.common import TokensFileError, load_tokens_file, make_channel
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

MASTER = "master-token-0123456789abcdef"
WORKER = "worker-token-0123456789abcdef"
ENGINE_A = "engine-a-token-0123456789abcdef"
ENGINE_B = "engine-b-token-0123456789abcdef"
ENGINE_C = "engine-c-token-0123456789abcdef"
MOUNT_A = "mount-a-token-0123456789abcdef"
ROUTER = "router-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
KV = contract.KV_PREFIX
A, B, C = f"{KV}/ep-a", f"{KV}/ep-b", f"{KV}/ep-c"
SHARED = "/shared/models"
# entries as an older `kvtier tokens generate` wrote them (no read_prefixes: the default scope), and one with
# explicit read_prefixes (C: its prefix and SHARED, not the key-compat records)
TOKENS = [
    {"name": "master", "token": MASTER, "role": "worker"},
    {"name": "worker", "token": WORKER, "role": "worker"},
    {"name": "engine-ep-a", "token": ENGINE_A, "role": "engine", "prefixes": [A]},
    {"name": "engine-ep-b", "token": ENGINE_B, "role": "engine", "prefixes": [B]},
    {"name": "engine-ep-c", "token": ENGINE_C, "role": "engine", "prefixes": [C], "read_prefixes": [SHARED]},
    {"name": "mount-ep-a", "token": MOUNT_A, "role": "mount", "prefixes": [A]},
    {"name": "router-team", "token": ROUTER, "role": "router"},
    {"name": "ops", "token": ADMIN, "role": "admin"},
]
MODEL = "/opt/ml/model"
SALT_B = "b" * 64
B_DIR = contract.salted_prefix(f"{B}/rev1", SALT_B)  # B's chunks: <B>/rev1/salt@<hmac>
A_DIR = f"{A}/rev1"
B_CHUNKS = [f"{B_DIR}/k{i}.data" for i in range(4)]
A_CHUNKS = [f"{A_DIR}/k{i}.data" for i in range(4)]
META_DIR = f"{contract.META_PREFIX}/{contract.esc(MODEL)}"


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _security(f: Path) -> dict[str, Any]:
    return {"token": ADMIN, "master_args": ["--tokens-file", str(f), "--token", MASTER],
            "worker_args": ["--tokens-file", str(f), "--token", WORKER]}


@pytest.fixture(scope="module")
def scoped(cluster_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One worker, the tokens above, B's salted chunks, A's chunks, two replicas' key-compat records (written as
    the admin: the records' writers are not what this module tests) and a file under SHARED."""
    f = tmp_path_factory.mktemp("readscope") / "tokens.json"
    f.write_text(json.dumps(TOKENS))
    cl = cluster_factory(1, name="readscope", capacity="256M", **_security(f))
    with cl.client(token=ENGINE_B, timeout=DEADLINE) as b, cl.client(token=ENGINE_A, timeout=DEADLINE) as a:
        assert all(b.put_many([(p, payload(i, 8192, "b")) for i, p in enumerate(B_CHUNKS)]))
        assert all(a.put_many([(p, payload(i, 8192, "a")) for i, p in enumerate(A_CHUNKS)]))
    with cl.client(token=ADMIN, timeout=DEADLINE) as admin:
        for rid in ("replica-a", "replica-b"):
            admin.put(f"{META_DIR}/{rid}.json", json.dumps({"model_name": MODEL, "replica": rid}).encode())
        admin.put(f"{SHARED}/tokenizer.json", b"{}")
    yield cl


def _names(entries: Any) -> list[str]:
    return sorted(e.path.rsplit("/", 1)[1] for e in entries)


def test_engine_cannot_list_or_look_up_another_endpoints_chunks(scoped: Any) -> None:
    """Engine A (an entry without read_prefixes, as older tokens files have) lists /kvtier/kv and sees only its
    own directory, not B's; B's prefix, revision and salted directory list as missing; B's chunks do not stat,
    exist, read, prefix-look-up or locate, and a raw Stat/StatMany hands out no location and no read
    capability for B's blocks: the same answers a path that does not exist gets. A's own reads are whole, and
    B's reads of its own chunks, symmetrically blind to A's; the router still looks up and reads both."""
    cl = scoped
    with cl.client(token=ENGINE_A, timeout=DEADLINE) as a, cl.client(token=ADMIN, timeout=DEADLINE) as admin:
        assert _names(admin.ls(KV)) == ["ep-a", "ep-b"]  # both there
        assert _names(a.ls(KV)) == ["ep-a"]
        assert _names(a.ls("/kvtier")) == ["kv", "meta"]
        assert _names(a.ls("/")) == ["kvtier"]  # the LMCache plugin's master probe (ls "/") still answers
        for d in (B, f"{B}/rev1", B_DIR, f"{KV}/ep-none"):
            with pytest.raises(NotFound):
                a.ls(d)
            assert a.stat(d) is None
        assert a.stat(KV) is not None and a.stat(KV).is_dir  # a directory on the way to its own prefix
        assert [a.stat(p) for p in B_CHUNKS] == [None] * 4
        assert not any(a.exists(p) for p in B_CHUNKS)
        assert [a.get(p) for p in B_CHUNKS] == [None] * 4
        assert a.prefix_lookup(B_CHUNKS) == 0
        assert a.prefix_lookup([*A_CHUNKS[:2], B_CHUNKS[0], A_CHUNKS[2]]) == 2  # B's path is the chain's miss
        assert a.locate_many(B_CHUNKS) == 0
        mixed = a.stat_many([A_CHUNKS[0], B_CHUNKS[0], A_CHUNKS[1], B_CHUNKS[1]])  # per item, the rest answered
        assert [s is not None for s in mixed] == [True, False, True, False]
        assert [a.get(p) for p in A_CHUNKS] == [payload(i, 8192, "a") for i in range(4)]
        assert a.walk(KV).keys() == set(A_CHUNKS)  # a walk from the KV prefix finds only its own files

        m = pbg.MasterStub(make_channel(cl.master, None))
        missing = f"{B_DIR}/never-written.data"
        for path in (B_CHUNKS[0], missing):
            st = m.Stat(pb.PathRequest(path=path), timeout=5, metadata=_md(ENGINE_A))
            assert not st.exists and not st.locations, st
        many = m.StatMany(pb.PathsRequest(paths=[*B_CHUNKS, missing]), timeout=5, metadata=_md(ENGINE_A))
        assert [(s.exists, len(s.locations)) for s in many.stats] == [(False, 0)] * 5
        assert m.PrefixLookup(pb.PathsRequest(paths=B_CHUNKS), timeout=5, metadata=_md(ENGINE_A)).count == 0
        codes = []
        for d in (B, B_DIR, B_CHUNKS[0], f"{KV}/ep-none"):
            with pytest.raises(grpc.RpcError) as e:
                m.List(pb.ListRequest(path=d, limit=100), timeout=5, metadata=_md(ENGINE_A))
            codes.append(e.value.code())
        assert codes == [grpc.StatusCode.NOT_FOUND] * 4  # B's names answer as a name nobody wrote
        page = m.List(pb.ListRequest(path=KV, limit=1), timeout=5, metadata=_md(ENGINE_A))
        assert _names(page.entries) == ["ep-a"] and page.next_after == ""
        # the admin's view of the same path: B's block with a read capability (what A no longer gets)
        st = m.Stat(pb.PathRequest(path=B_CHUNKS[0]), timeout=5, metadata=_md(ADMIN))
        assert st.exists and st.locations[0].capability

    with cl.client(token=ENGINE_B, timeout=DEADLINE) as b:
        assert [b.get(p) for p in B_CHUNKS] == [payload(i, 8192, "b") for i in range(4)]
        assert b.prefix_lookup(B_CHUNKS) == 4 and _names(b.ls(B_DIR)) == [f"k{i}.data" for i in range(4)]
        assert _names(b.ls(KV)) == ["ep-b"] and b.prefix_lookup(A_CHUNKS) == 0 and b.get(A_CHUNKS[0]) is None
    assert _misses(cl, "engine-ep-a") > 0 and _misses(cl, "engine-ep-b") > 0
    _router_sees_every_endpoint(cl)


def _misses(cl: Any, credential: str) -> float:
    """l2fs_master_read_scope_misses_total{credential} from the master's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{cl.master_metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "l2fs_master_read_scope_misses_total" and s.labels.get("credential") == credential)


def _router_sees_every_endpoint(scoped: Any) -> None:
    """The router's token looks up, stats and lists every endpoint's chunks (it scores them all)."""
    with scoped.client(token=ROUTER, timeout=DEADLINE) as r:
        assert r.prefix_lookup(B_CHUNKS) == 4 and r.prefix_lookup(A_CHUNKS) == 4
        assert all(r.stat_many([*A_CHUNKS, *B_CHUNKS]))
        assert _names(r.ls(KV)) == ["ep-a", "ep-b"] and len(r.ls(B_DIR)) == 4
        assert r.get(B_CHUNKS[1]) == payload(1, 8192, "b")


def test_engine_reads_the_shared_key_compat_records(scoped: Any, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """What an engine legitimately reads outside its prefix: every replica's key-compat record of its model
    under /kvtier/meta (connector.fingerprint's load_records, what each connector compares against, and
    `kvtier lmcache-config check` with the engine's token file). An entry whose read_prefixes are explicit
    reads those and its own prefix only (C: SHARED, not the records)."""
    from connector.config import main as lmcache_config
    from connector.fingerprint import load_records

    with scoped.client(token=ENGINE_A, timeout=DEADLINE) as a:
        assert sorted(r["replica"] for r in load_records(a, MODEL)) == ["replica-a", "replica-b"]
        assert a.get(f"{SHARED}/tokenizer.json") is None
    token_file = tmp_path / "engine-a.token"
    token_file.write_text(ENGINE_A)
    assert lmcache_config(["check", "--l2fs-master", scoped.master, "--model", MODEL,
                           "--l2fs-token-file", str(token_file)]) == 0
    assert capsys.readouterr().out.count('"replica"') == 2
    with scoped.client(token=ENGINE_C, timeout=DEADLINE) as c:
        assert c.get(f"{SHARED}/tokenizer.json") == b"{}"
        assert c.stat(f"{META_DIR}/replica-a.json") is None and c.get(B_CHUNKS[0]) is None
        assert _names(c.ls("/")) == ["kvtier", "shared"] and _names(c.ls("/kvtier")) == ["kv"]
        assert c.put(f"{C}/rev1/k0.data", b"c") is True and c.get(f"{C}/rev1/k0.data") == b"c"


def test_mount_credential_cannot_see_remove_or_rename_another_endpoints_files(scoped: Any) -> None:
    """A per-endpoint mount credential (mount-ep-a) has A's read scope, and its Delete and Rename of B's paths
    answer as for paths that are not there, whether B's file exists or not (before: PERMISSION_DENIED for B's
    chunk, "nothing removed" for a missing one, which told them apart). Its own files it still writes, reads
    and renames."""
    with scoped.client(token=MOUNT_A, timeout=DEADLINE) as mnt, scoped.client(token=ENGINE_B) as b:
        assert _names(mnt.ls(KV)) == ["ep-a"] and mnt.stat(B_CHUNKS[0]) is None
        missing = f"{B_DIR}/never-written.data"
        assert [mnt.rm(B_CHUNKS[0]), mnt.rm(missing), mnt.rm(B_DIR), mnt.rm(B)] == [False] * 4
        errors = []
        for src in (B_CHUNKS[0], missing, B_DIR):
            with pytest.raises(L2fsError) as e:
                mnt.rename(src, f"{A}/moved.data")
            errors.append(type(e.value))
        assert errors == [NotFound] * 3
        assert b.get(B_CHUNKS[0]) == payload(0, 8192, "b")
        assert mnt.put(f"{A}/mnt/own.data", b"mine") is True
        mnt.rename(f"{A}/mnt/own.data", f"{A}/mnt/renamed.data")
        assert mnt.get(f"{A}/mnt/renamed.data") == b"mine" and mnt.get(A_CHUNKS[0]) == payload(0, 8192, "a")


def test_sharded_masters_answer_another_endpoints_directory_as_missing(cluster_factory: Any,
                                                                       tmp_path_factory: pytest.TempPathFactory
                                                                       ) -> None:
    """Two path-hash shards: directories live on every shard holding something under them, and a shard refuses
    another shard's file paths unless they are its directories, so that refusal told A on which shards B's
    directories exist. Now each master answers B's paths to A as missing before any shard check; the admin's
    view shows they are there."""
    f = tmp_path_factory.mktemp("readscope-shards") / "tokens.json"
    f.write_text(json.dumps(TOKENS))
    cl = cluster_factory(1, name="readscope-shards", capacity="256M", shards=2, **_security(f))
    chunks = [f"{B_DIR}/s{i}.data" for i in range(8)]
    with cl.client(token=ENGINE_B, timeout=DEADLINE) as b:
        assert all(b.put_many([(p, b"x" * 100) for p in chunks]))
    stubs = [pbg.MasterStub(make_channel(addr, None)) for addr in cl.master.split(";")]
    for path in (B, B_DIR, *chunks):
        for m in stubs:
            st = m.Stat(pb.PathRequest(path=path), timeout=5, metadata=_md(ENGINE_A))
            assert not st.exists, (path, st)
    assert any(m.Stat(pb.PathRequest(path=B_DIR), timeout=5, metadata=_md(ADMIN)).is_dir for m in stubs)
    with cl.client(token=ENGINE_A, timeout=DEADLINE) as a:
        assert a.stat(B_DIR) is None and a.prefix_lookup(chunks) == 0 and a.stat_many(chunks) == [None] * 8
        with pytest.raises(NotFound):
            a.ls(B_DIR)


@pytest.mark.unit
def test_read_prefixes_in_the_tokens_file(tmp_path: Path) -> None:
    """read_prefixes: optional on engine and mount entries (default: their prefixes and /kvtier/meta), refused
    elsewhere or when not a list of paths; "/" reads everything; router and admin read everything."""
    f = tmp_path / "t.json"
    f.write_text(json.dumps([*TOKENS, {"name": "wide", "token": "wide-engine-token-0123456789", "role": "engine",
                                       "prefixes": [f"{KV}/w"], "read_prefixes": ["/"]}]))
    creds = {c.name: c for _, c in load_tokens_file(str(f))}
    assert creds["engine-ep-a"].reads == (A, contract.META_PREFIX)
    assert creds["mount-ep-a"].reads == (A, contract.META_PREFIX)
    assert creds["engine-ep-c"].reads == (C, SHARED)
    assert creds["wide"].reads is None and creds["router-team"].reads is None and creds["ops"].reads is None
    a = creds["engine-ep-a"]
    assert a.may_read(f"{A}/x") and a.may_read(A) and not a.may_read(f"{A}x") and not a.may_read(B_CHUNKS[0])
    assert a.visible_names(KV) == {"ep-a"} and a.visible_names("/") == {"kvtier"} and a.visible_names(A) is None
    for bad, what in (({"role": "router", "read_prefixes": ["/x"]}, "engine or mount"),
                      ({"role": "engine", "prefixes": ["/p"], "read_prefixes": "/x"}, "list of paths"),
                      ({"role": "engine", "prefixes": ["/p"], "read_prefixes": ["x/../y"]}, "entry 0")):
        f.write_text(json.dumps([{"name": "x", "token": "x-token-0123456789abc", **bad}]))
        with pytest.raises(TokensFileError, match=what):
            load_tokens_file(str(f))


def test_engine_writes_and_rewrites_only_its_own_record(scoped: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployed (scoped) engine token publishes its replica's record under /kvtier/meta with the connector's own
    code (connector.fingerprint.publish: mkdir, then an overwrite) and rewrites it while it runs (the key check's
    known answer, which routers read); before, every such put was EACCES, so deployed engines published nothing.
    It may not overwrite another replica's record, nor overwrite anything under its own KV prefix (put-if-absent
    there), nor write outside both."""
    from types import SimpleNamespace

    from connector.fingerprint import load_records, publish
    from l2fs.client import PermissionDenied

    cfg = SimpleNamespace(pre_caching_hash_algorithm="builtin", chunk_size=256)
    meta = SimpleNamespace(model_name=MODEL, kv_dtype="torch.float32", chunk_size=256, world_size=1)
    monkeypatch.setenv("KVTIER_REPLICA_ID", "replica-a2")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with scoped.client(token=ENGINE_A, timeout=DEADLINE) as a, scoped.client(token=ENGINE_B, timeout=DEADLINE) as b:
        publish(a, cfg, meta, node_id="node-1", extra={"n": 1})
        publish(a, cfg, meta, node_id="node-1", extra={"n": 2})  # the periodic rewrite of its own record
        mine = [r for r in load_records(a, MODEL) if r["replica"] == "replica-a2"]
        assert [r["n"] for r in mine] == [2], mine
        with pytest.raises(PermissionDenied):  # B may not replace A's record
            publish(b, cfg, meta, node_id="node-2", extra={"n": 3})
        with pytest.raises(PermissionDenied):  # nor the admin-written records of other replicas
            b.put(f"{META_DIR}/replica-a.json", b"{}", if_absent=False)
        assert [r["n"] for r in load_records(a, MODEL) if r["replica"] == "replica-a2"] == [2]
        with pytest.raises(PermissionDenied):  # its own chunks stay put-if-absent
            a.put(A_CHUNKS[0], b"other bytes", if_absent=False)
        with pytest.raises(PermissionDenied):
            a.put(f"{SHARED}/x", b"x")
    with scoped.client(token=ROUTER, timeout=DEADLINE) as r:
        assert [x["n"] for x in load_records(r, MODEL) if x["replica"] == "replica-a2"] == [2]
