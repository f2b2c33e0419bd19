"""The workstation install of the `kvtier` CLI: a fresh venv with `pip install <kvtier>` and no FUSE.

A platform engineer's laptop (macOS, or Linux without libfuse3) needs `kvtier tokens generate`,
`kvtier operator-patch verify` and `kvtier lmcache-config`, not the l2fs mount: pyfuse3/trio are the
`mount` extra. The venv gets kvtier's default dependencies from the package index (about a minute and a
half here), and nothing else; the commands run from it against an emulated API server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from operator_helpers import Cluster
from test_operator_cli import setup

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["l2fs", "connector", "router", "operator_patch", "kvtier"]


def _installer(venv: Path) -> list[str]:
    """The install command into venv: uv where the suite's venv has it (.ci/install puts it there; it resolves
    the same package metadata as pip, from the same index, in seconds instead of the minute and a half pip
    takes here), with the machine's pip settings uv does not read (CA bundle, constraints file); else the
    venv's own pip, as a user would run it."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        return [str(venv / "bin" / "pip"), "install", "-q"]
    cmd = [str(uv), "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--native-tls"]
    if Path("/etc/xdg/pip/constraints.txt").exists():
        cmd += ["--constraint", "/etc/xdg/pip/constraints.txt"]
    return cmd


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new venv (the system python3, no site packages) with kvtier installed as a user would, from a copy
    of the source tree (so no build output lands in the repository)."""
    base = tmp_path_factory.mktemp("workstation")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = base / "venv"
    python = shutil.which("python3") or sys.executable
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run(_installer(venv) + [str(src)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    yield venv / "bin"


def test_cli_without_fuse(fresh_venv: Path, tmp_path: Path, cluster: Cluster) -> None:
    """No pyfuse3/trio get installed; tokens, lmcache-config and operator-patch verify work; `l2fs mount`
    fails with a message naming the extra."""
    py = str(fresh_venv / "python")
    probe = subprocess.run([py, "-c", "import importlib.util as u, json; "
                            "print(json.dumps([u.find_spec(m) is not None for m in ('pyfuse3', 'trio', 'kvtier')]))"],
                           capture_output=True, text=True, timeout=60)
    assert json.loads(probe.stdout) == [False, False, True], "the default install must not pull in FUSE"
    kvtier = str(fresh_venv / "kvtier")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kvtier, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)

    tok = run("tokens", "generate", "--engine", "qwen2-7b@team-a", "--router", "team-a", "-o", "tokens.json",
              "--secret-yaml", "-")
    assert tok.returncode == 0, tok.stderr
    assert "kind: Secret" in tok.stdout
    # what the workstation wrote, read by its consumers: the master's own tokens-file loader, LMCache's from_file
    from l2fs.common.auth import load_token_entries

    roles = set().union(*(cred.roles for _name, _token, cred in load_token_entries(str(tmp_path / "tokens.json"))))
    assert {"engine", "router"} <= roles, roles
    cfg = run("lmcache-config", "--model", "org/model", "--l2fs-master", "m:8995", "--format", "json")
    assert cfg.returncode == 0, cfg.stderr
    import yaml
    from lmcache.v1.config import LMCacheEngineConfig

    (tmp_path / "lmcache.yaml").write_text(yaml.safe_dump(json.loads(cfg.stdout)["lmcache"]))
    lmc = LMCacheEngineConfig.from_file(str(tmp_path / "lmcache.yaml"))
    assert lmc.remote_storage_plugins == ["l2fs"], lmc.remote_storage_plugins
    assert lmc.extra_config["remote_storage_plugin.l2fs.master"] == "m:8995", lmc.extra_config
    setup(cluster)
    verify = run("operator-patch", "verify", "--namespace", "team-a", "--endpoint", "qwen2-7b",
                 "--kubeconfig", str(cluster.kubeconfig), "--timeout", "5")
    assert verify.returncode == 1 and "FAIL env LMCACHE_REMOTE_URL" in verify.stdout, verify.stdout + verify.stderr
    mount = subprocess.run([str(fresh_venv / "l2fs"), "mount", str(tmp_path / "mnt"), "--master", "m:1"],
                           capture_output=True, text=True, timeout=60)
    assert mount.returncode != 0
    assert "kvtier[mount]" in mount.stderr, mount.stderr[-2000:]
