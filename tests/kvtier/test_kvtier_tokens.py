"""`kvtier tokens`: the generated file is one l2fs loads (its own parser), one entry per node with unique
tokens, `--keep` rotates nothing it keeps, and `exec` hands a command its own entry or refuses clearly.
The generated file against real master/worker processes: tests/operator/test_operator_deploy_run.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtier import credentials as tokens  # the `kvtier tokens` command
from l2fs.common import Credentials, load_tokens_file, token_digest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "tokens", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=env)


def test_generate_is_what_l2fs_loads(tmp_path: Path) -> None:
    out = tmp_path / "tokens.json"
    r = kvtier("generate", "--workers", "node/ip-10-0-0-1.ec2.internal", "node-b", "--engine", "ep-a@team-a",
               "--engine", "ep-b:/kvtier/kv/custom", "--router", "team-a", "--mount", "--admin", "-o", str(out),
               "--secret-yaml", str(tmp_path / "s.yaml"))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o077 == 0 and (tmp_path / "s.yaml").stat().st_mode & 0o077 == 0
    loaded = {c.name: (t, c) for t, c in load_tokens_file(str(out))}
    assert list(loaded) == ["master", "worker-ip-10-0-0-1.ec2.internal", "worker-node-b", "engine-ep-a",
                            "engine-ep-b", "mount-ep-a", "mount-ep-b", "router-team-a", "mount", "admin"]
    roles = {n: set(c.roles) for n, (_, c) in loaded.items()}
    assert roles["master"] == roles["worker-node-b"] == {"worker"}  # master first: its outbound token
    assert roles["admin"] == {"admin"} and roles["router-team-a"] == {"router"}
    # the FUSE mount: its own role, writing under kvtier's prefixes only (its own files: may_replace)
    assert roles["mount"] == {"mount"} and loaded["mount"][1].prefixes == ("/kvtier/kv", "/kvtier/mp", "/kvtier/meta")
    assert loaded["engine-ep-a"][1].prefixes == ("/kvtier/kv/ep-a",)
    assert loaded["engine-ep-b"][1].prefixes == ("/kvtier/kv/custom",)
    # each endpoint's own mount credential: mount role, that endpoint's prefix only
    assert roles["mount-ep-a"] == roles["mount-ep-b"] == {"mount"}
    assert loaded["mount-ep-a"][1].prefixes == ("/kvtier/kv/ep-a",)
    assert loaded["mount-ep-b"][1].prefixes == ("/kvtier/kv/custom",)
    assert len({t for t, _ in loaded.values()}) == len(loaded)
    # each node's worker credential is bound to that node; the master's own and other roles are not
    assert loaded["worker-ip-10-0-0-1.ec2.internal"][1].node == "ip-10-0-0-1.ec2.internal"
    assert loaded["worker-node-b"][1].node == "node-b" and loaded["master"][1].node == ""
    docs = {(d["metadata"]["namespace"], d["metadata"]["name"]): d.get("stringData") or d["data"]
            for d in yaml.safe_load_all((tmp_path / "s.yaml").read_text())}
    assert set(docs) == {("kvtier", "l2fs-tokens"), ("kvtier", "l2fs-mount-token"), ("team-a", "ep-a-l2fs-token"),
                         ("default", "ep-b-l2fs-token"), ("team-a", "kvtier-router-l2fs-token"),
                         ("kvtier", "l2fs-block-key"), ("kvtier", "l2fs-token-verifiers"),
                         ("kvtier", "l2fs-endpoint-mounts")}
    # the master's block key: next to the tokens file (0600, >= 32 bytes), the Secret holds exactly its bytes,
    # and a second run keeps it (a new key would unpublish the whole cache)
    key = (tmp_path / "block-key").read_bytes()
    assert len(key) >= 32 and (tmp_path / "block-key").stat().st_mode & 0o077 == 0
    assert base64.b64decode(docs[("kvtier", "l2fs-block-key")]["block-key"]) == key
    assert kvtier("generate", "--workers", "node-b", "-o", str(tmp_path / "again.json")).returncode == 0
    assert (tmp_path / "block-key").read_bytes() == key
    assert json.loads(docs[("kvtier", "l2fs-tokens")]["tokens.json"]) == json.loads(out.read_text())
    assert docs[("team-a", "ep-a-l2fs-token")] == {"token": loaded["engine-ep-a"][0]}
    assert docs[("team-a", "kvtier-router-l2fs-token")] == {"token": loaded["router-team-a"][0]}
    assert docs[("kvtier", "l2fs-mount-token")] == {"token": loaded["mount"][0]}
    # the mount DaemonSet's Secret, as its volume (a file per key) is read by `l2fs mount --endpoints`
    from l2fs.fuse.endpoints import read_endpoints

    vol = tmp_path / "endpoint-mounts"
    vol.mkdir()
    for k, v in docs[("kvtier", "l2fs-endpoint-mounts")].items():
        (vol / k).write_text(v)
    (vol / "..data").mkdir()  # the kubelet's bookkeeping in a Secret volume
    assert read_endpoints(str(vol)) == ({"ep-a": ("/kvtier/kv/ep-a", loaded["mount-ep-a"][0]),
                                         "ep-b": ("/kvtier/kv/custom", loaded["mount-ep-b"][0])}, [])


def test_generate_writes_read_scopes(tmp_path: Path) -> None:
    """Each engine entry names what it reads (`read_prefixes`: its prefix and the key-compat records), each
    endpoint's mount its prefix only; router and admin entries none (they read everything). l2fs's default
    for an entry without read_prefixes (an older file) is the engine's scope here: SHARED_READ_PREFIXES is
    kvtier.contract's META_PREFIX (l2fs imports nothing of kvtier, so this test ties the two)."""
    from kvtier import contract
    from l2fs.common.auth import SHARED_READ_PREFIXES

    assert SHARED_READ_PREFIXES == (contract.META_PREFIX,)
    out = tmp_path / "tokens.json"
    r = kvtier("generate", "--engine", "ep-a@team-a", "--router", "team-a", "--mount", "--admin", "-o", str(out))
    assert r.returncode == 0, r.stderr
    raw = {e["name"]: e for e in json.loads(out.read_text())}
    assert raw["engine-ep-a"]["read_prefixes"] == ["/kvtier/kv/ep-a", "/kvtier/meta"]
    assert raw["mount-ep-a"]["read_prefixes"] == ["/kvtier/kv/ep-a"]
    assert raw["mount"]["read_prefixes"] == ["/kvtier/kv", "/kvtier/mp", "/kvtier/meta"]
    assert "read_prefixes" not in raw["router-team-a"] and "read_prefixes" not in raw["admin"]
    loaded = {c.name: c for _, c in load_tokens_file(str(out))}
    assert loaded["engine-ep-a"].reads == ("/kvtier/kv/ep-a", "/kvtier/meta")
    assert loaded["mount-ep-a"].reads == ("/kvtier/kv/ep-a",)
    assert loaded["router-team-a"].reads is None and loaded["admin"].reads is None
    # the workers' verifier file carries the same scopes (they load it with the same parser)
    ver = {c.name: c for _, c in load_tokens_file(str(tmp_path / "token-verifiers.json"))}
    assert ver["engine-ep-a"].reads == loaded["engine-ep-a"].reads
    # an older file without read_prefixes: the same engine scope by default
    old = [{k: v for k, v in e.items() if k != "read_prefixes"} for e in raw.values()]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert {c.name: c for _, c in load_tokens_file(str(tmp_path / "old.json"))}["engine-ep-a"].reads == \
        loaded["engine-ep-a"].reads


def test_keep_reuses_tokens_and_drops_the_rest() -> None:
    first = tokens.generate(["a", "b"], [("ep", "/kvtier/kv/ep", "ns")], [], mount=True, admin=False)
    second = tokens.generate(["a", "c"], [("ep", "/kvtier/kv/ep", "ns")], [], mount=True, admin=False, keep=first)
    old, new = ({e["name"]: e["token"] for e in x} for x in (first, second))
    assert set(new) == {"master", "worker-a", "worker-c", "engine-ep", "mount-ep", "mount"}  # worker-b revoked
    for name in ("master", "worker-a", "engine-ep", "mount-ep", "mount"):
        assert new[name] == old[name]
    assert new["worker-c"] not in old.values()
    rotated = tokens.generate(["a"], [], [], mount=False, admin=False)
    assert rotated[1]["token"] != old["worker-a"]
    with pytest.raises(ValueError, match="twice"):
        tokens.generate(["a", "node/a"], [], [], mount=False, admin=False)
    for bad in (":/x", "a/b", ".hidden", "a b"):  # the endpoint is also a Secret key and a directory name
        with pytest.raises(ValueError, match="ENDPOINT"):
            tokens.parse_engine(bad, "ns")
    with pytest.raises(ValueError, match="other than /"):
        tokens.parse_engine("ep:/", "ns")


def test_exec_picks_its_own_entry_or_refuses(tmp_path: Path) -> None:
    f = tmp_path / "tokens.json"
    assert kvtier("generate", "--workers", "node-a", "--engine", "ep", "-o", str(f)).returncode == 0
    want = {e["name"]: e["token"] for e in json.loads(f.read_text())}
    env = {"PATH": "/usr/bin:/bin", "L2FS_TOKENS_FILE": str(f)}
    ok = kvtier("exec", "--entry", "worker-node-a", "--role", "worker", "--", "sh", "-c", "echo $L2FS_TOKEN", env=env)
    assert ok.returncode == 0 and ok.stdout.strip() == want["worker-node-a"]
    missing = kvtier("exec", "--entry", "worker-node-z", "--", "true", env=env)
    assert missing.returncode == 2 and "no entry 'worker-node-z'" in missing.stderr
    assert want["worker-node-a"] not in missing.stderr  # names only, never tokens
    wrong = kvtier("exec", "--entry", "engine-ep", "--role", "worker", "--", "true", env=env)
    assert wrong.returncode == 2 and "has role engine, not worker" in wrong.stderr
    nofile = kvtier("exec", "--entry", "worker-node-a", "--", "true", env={"PATH": "/usr/bin:/bin"})
    assert nofile.returncode == 2 and "no tokens file" in nofile.stderr
    f.write_text("[]")
    bad = kvtier("exec", "--entry", "worker-node-a", "--", "true", env=env)
    assert bad.returncode == 2 and "non-empty JSON list" in bad.stderr
    assert kvtier("generate", "--workers", "a").returncode == 2  # nowhere to write


def test_verifiers_check_tokens_they_do_not_hold(tmp_path: Path) -> None:
    """The verifier file (what workers mount) holds no token, only each one's SHA-256, yet the same tokens pass
    with the same roles, prefixes and nodes; a verifier holder has nothing to present (no outbound token)."""
    out = tmp_path / "tokens.json"
    r = kvtier("generate", "--workers", "node-a", "--engine", "ep-a@team-a", "--router", "team-a", "--admin",
               "-o", str(out), "--secret-yaml", str(tmp_path / "s.yaml"))
    assert r.returncode == 0, r.stderr
    ver = tmp_path / "token-verifiers.json"
    assert ver.stat().st_mode & 0o077 == 0
    full = {c.name: (t, c) for t, c in load_tokens_file(str(out))}
    text = ver.read_text()
    assert all(t not in text for t, _ in full.values())  # not one token
    docs = {d["metadata"]["name"]: d.get("stringData") or d["data"]
            for d in yaml.safe_load_all((tmp_path / "s.yaml").read_text())}
    assert json.loads(docs["l2fs-token-verifiers"]["verifiers.json"]) == json.loads(text)
    checker = Credentials(tokens_file=str(ver))
    for name, (token, cred) in full.items():
        got = checker.from_metadata([("authorization", f"Bearer {token}")])
        assert got == cred, name
        assert checker.data_token_ok(token.encode())
        assert json.loads(text)[list(full).index(name)]["sha256"] == token_digest(token)
    assert checker.from_metadata([("authorization", "Bearer " + "0" * 64)]) is None
    assert checker.from_metadata([("authorization", full["admin"][0])]) is None  # no "Bearer "
    assert not checker.data_token_ok(b"x" * 64)
    assert checker.outbound_token(None) is None and Credentials(tokens_file=str(out)).outbound_token(None)
    for bad in ({"sha256": "ab"}, {"sha256": "A" * 64}, {"sha256": "a" * 64, "token": "t" * 20}, {}):
        (tmp_path / "bad.json").write_text(json.dumps([{"name": "x", "role": "admin", **bad}]))
        with pytest.raises(ValueError, match="sha256|token"):
            Credentials(tokens_file=str(tmp_path / "bad.json"))
