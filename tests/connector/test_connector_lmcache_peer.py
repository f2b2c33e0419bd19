"""Peer suite: LMCache 0.5.6's own storage-backend tests, adapted at test time to our in-process plugin.

The sdist's tests/ are fetched with pip (not vendored; cached under .kvtier/test-cache) by the mount peer
suite's helper, copied to tmp_path, and two files are rewritten by exact, counted string substitutions (an
upstream change fails here loudly instead of silently testing LMCache's `fs` connector):
- tests/v1/storage_backend/test_fs_connector.py: every `fs` config becomes the `l2fs` plugin
  (remote_storage_plugins / plugin names `fs` -> `l2fs`, `base_path` -> our `prefix`, `fs://` -> `l2fs://`),
  so RemoteBackend + LocalCPUBackend (LMCache's code) drive connector.lmcache_l2fs against a real
  LocalCluster. Each fs directory maps to its own l2fs prefix.
- tests/v1/storage_backend/test_remote_storage_plugin.py: the mock adapter module/classes become ours
  (module connector.lmcache_l2fs, L2fsConnectorAdapter -> L2fsConnector, the non-adapter class is our
  `Breaker`); the mock's `mockplugin://` URL becomes `l2fs://`; `local_cpu_backend=None` becomes a real
  LocalCPUBackend (every real connector, LMCache's `fs` one too, reads config/metadata from it; the mock
  skipped RemoteConnector.__init__).
The subprocess gets the master through $L2FS_MASTER (a documented config source of the plugin).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from l2fs.testing.cluster import LocalCluster

pytest.importorskip("lmcache")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "mount"))
from test_mount_lmcache_peer import fetch_lmcache_tests, run_peer  # noqa: E402 - shared sdist helpers

SB = "tests/v1/storage_backend"
FS_TEST, PLUGIN_TEST = f"{SB}/test_fs_connector.py", f"{SB}/test_remote_storage_plugin.py"
FS_OUT, PLUGIN_OUT = f"{SB}/test_kvtier_l2fs_fs_connector.py", f"{SB}/test_kvtier_l2fs_remote_storage_plugin.py"

# (old, new, exact count in 0.5.6)
FS_RULES = [
    ('remote_url=f"fs://host:0/{fs_path}",',
     'remote_url=f"l2fs://host:0/{fs_path}",\n        remote_storage_plugins=["l2fs"],\n'
     '        extra_config=_l2fs_extra("l2fs", fs_path),', 1),
    ('assert backend.remote_url == f"fs://host:0/{temp_fs_path}"',
     'assert backend.remote_url == f"l2fs://host:0/{temp_fs_path}"', 1),
    ('remote_storage_plugins=["fs"],', 'remote_storage_plugins=["l2fs"],', 1),
    ('"remote_storage_plugin.fs.base_path": fs_path,', '**_l2fs_extra("l2fs", fs_path),', 1),
    ('remote_storage_plugins=["fs.primary", "fs.backup"],',
     'remote_storage_plugins=["l2fs.primary", "l2fs.backup"],', 1),
    ('"remote_storage_plugin.fs.primary.base_path": fs_path1,', '**_l2fs_extra("l2fs.primary", fs_path1),', 1),
    ('"remote_storage_plugin.fs.backup.base_path": fs_path2,', '**_l2fs_extra("l2fs.backup", fs_path2),', 1),
    ('plugin_name="fs"', 'plugin_name="l2fs"', 1),
    ('backend.plugin_name == "fs"', 'backend.plugin_name == "l2fs"', 1),
    ('plugin_name="fs.primary"', 'plugin_name="l2fs.primary"', 1),
    ('plugin_name="fs.backup"', 'plugin_name="l2fs.backup"', 1),
]
FS_HELPER = '''

def _l2fs_extra(name, fs_path):
    """kvtier: the l2fs plugin config for one fs directory (several comma-separated dirs: the first)."""
    p = "remote_storage_plugin." + name
    return {p + ".module_path": "connector.lmcache_l2fs", p + ".class_name": "L2fsConnectorAdapter",
            p + ".prefix": "/peer" + fs_path.split(",")[0]}
'''
PLUGIN_RULES = [
    ('"tests.v1.storage_backend.test_remote_storage_plugin"', '"connector.lmcache_l2fs"', 6),
    ('"MockTestConnectorAdapter"', '"L2fsConnectorAdapter"', 5),
    ('"MockTestRemoteConnector"', '"L2fsConnector"', 2),
    ('"NotAConnectorAdapter"', '"Breaker"', 2),
    ('mock_connector_', 'l2fs.', 6),
    ('mock_connector', 'l2fs', 5),
    ('"mockplugin://localhost:1234"', '"l2fs://localhost:1234"', 6),
    ('local_cpu_backend=None,', 'local_cpu_backend=_l2fs_cpu_backend(),', 13),
]
PLUGIN_HELPER = '''

def _l2fs_cpu_backend():
    """kvtier: a real LocalCPUBackend (RemoteBackend always passes one; real connectors read it)."""
    import torch
    from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    md = LMCacheMetadata(model_name="test_model", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(28, 2, 256, 8, 128))
    return LocalCPUBackend(LMCacheEngineConfig.from_defaults(chunk_size=256), md,
                           memory_allocator=AdHocMemoryAllocator(device="cpu"))
'''

FS_TESTS = ["test_init", "test_init_with_plugin", "test_dual_fs_instances", "test_contains_key_not_exists",
            "test_get_blocking_key_not_exists", "test_put_and_get_roundtrip", "test_batched_put_and_get",
            "test_multiple_paths_config", "test_file_persistence"]
PLUGIN_TESTS = ["adapter_is_loaded", "creates_connector", "via_create_connector_function",
                "without_remote_storage_plugins_config", "with_invalid_module_path", "with_invalid_class_name",
                "with_non_connector_adapter_class", "with_missing_module_path", "with_missing_class_name",
                "with_missing_extra_config", "with_none_config", "multiple_plugins",
                "no_matching_url_raises_error"]
# Every test of both files applies to the l2fs plugin (0.5.6); none is excluded. Where one only checks a path
# or URL string (test_init's `os.path.exists`, test_multiple_paths_config's three dirs, which l2fs maps to one
# prefix: it spreads blocks over workers itself), it still runs put/contains/get through l2fs.
NOT_APPLICABLE: dict[str, str] = {}


def adapt(src: str, rules: list[tuple[str, str, int]], helper: str) -> str:
    """Apply exact substitutions, each expected exactly `count` times in the 0.5.6 text."""
    for old, new, count in rules:
        n = src.count(old)
        assert n == count, f"lmcache test text changed: {old!r} occurs {n} times, expected {count}"
        src = src.replace(old, new)
    return src + helper


def walk(client: object, path: str) -> list[str]:
    out: list[str] = []
    for info in client.ls(path):  # type: ignore[attr-defined]
        out += walk(client, info.path) if info.is_dir else [info.path]
    return out


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    return {"capacity": "2G"}


def test_lmcache_storage_backend_suite_on_l2fs_plugin(cluster: LocalCluster, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cached = fetch_lmcache_tests()
    peer = tmp_path / "peer"
    shutil.copytree(cached, peer)
    for src, out, rules, helper in ((FS_TEST, FS_OUT, FS_RULES, FS_HELPER),
                                    (PLUGIN_TEST, PLUGIN_OUT, PLUGIN_RULES, PLUGIN_HELPER)):
        (peer / out).write_text(adapt((peer / src).read_text(), rules, helper))
    tmpdir = tmp_path / "peer-tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("L2FS_MASTER", cluster.master)
    monkeypatch.setenv("L2FS_NODE_ID", "node-1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    rc, passed, failed, out = run_peer(peer, FS_OUT, tmpdir, PLUGIN_OUT)
    results = {t: "passed" for t in passed} | {t.split(" ")[0]: t for t in failed}
    print("per-test results:\n  " + "\n  ".join(f"{k}: {v}" for k, v in sorted(results.items())))
    expected = [f"{FS_OUT}::TestFSConnector::{t}" for t in FS_TESTS] + [
        f"{PLUGIN_OUT}::TestConnectorPluginLauncher::test_remote_storage_plugin_{t}" for t in PLUGIN_TESTS]
    applicable = [t for t in expected if t.rsplit("::", 1)[1] not in NOT_APPLICABLE]
    assert sorted(passed) == sorted(applicable) and rc == 0, out[-6000:]
    # the chunks really live in l2fs, one prefix per fs directory of the suite:
    # files: dual instances 2 (key 99 in primary and backup), roundtrip 1, batched 3, multiple paths 1,
    # persistence 1; prefixes: dual 2, roundtrip, batched, multiple paths, persistence 1 each
    with cluster.client() as c:
        files = [p for p in walk(c, "/peer") if p.endswith(".data")]
        assert len(files) == 8, files
        assert len({p.rsplit("/", 2)[0] for p in files}) == 6, files
