"""The package layers (pyproject `[tool.importlinter]`, docs/DEVELOPING.md "Layers") hold: `lint-imports`.

Run here so CI checks them; the second test plants one violation per contract in a copy of the tree and
shows `lint-imports` reports each, so a contract that stopped matching anything would be noticed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("l2fs", "connector", "router", "operator_patch", "kvtier")

pytestmark = pytest.mark.unit


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(LINT.parent), "PYTHONPATH": str(cwd)})


def test_the_tree_keeps_its_layers() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " broken" in out.stdout and "0 broken" in out.stdout


# (file to append to, import line, what lint-imports must say)
VIOLATIONS = [
    ("router/discovery.py", "import connector.keys", "router is not allowed to import connector"),
    ("operator_patch/options.py", "import router.policy", "operator_patch is not allowed to import router"),
    ("kvtier/contract.py", "import l2fs.client", "kvtier.contract is not allowed to import l2fs"),
    ("l2fs/cli.py", "import connector.keys", "l2fs is not allowed to import connector"),
    ("connector/revision.py", "import kvtier.devstack.replica", "connector is not allowed to import kvtier.devstack"),
    ("router/app.py", "import kvtier.brand_new", "router is not allowed to import kvtier.brand_new"),
    ("operator_patch/patch.py", "import tests.node_client", "operator_patch is not allowed to import tests"),
    ("connector/keys.py", "import l2fs.testing.cluster", "connector is not allowed to import l2fs.testing"),
]


def test_each_contract_reports_a_planted_violation(tmp_path: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "kvtier" / "brand_new.py").write_text('"""a roof module the contracts do not name."""\n')
    for rel, line, _ in VIOLATIONS:
        with open(tmp_path / rel, "a") as f:
            f.write(f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    missing = [msg for _, _, msg in VIOLATIONS if msg not in out.stdout]
    assert not missing, out.stdout
