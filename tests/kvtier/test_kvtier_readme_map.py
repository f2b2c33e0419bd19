"""The README's module map (the Architecture bullets) matches the tree, both ways.

Each package bullet starts with "- `pkg/` (...)": the backticked names in that first parenthesis are the package's
modules (`name`) and subpackages (`name/`). Every listed name must exist, and every module and subpackage of the
package must be listed, so a newcomer reading the README finds each file and no file is left out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("l2fs", "connector", "router", "operator_patch", "kvtier")
NAME = re.compile(r"^[a-z_][a-z0-9_]*/?$")

pytestmark = pytest.mark.unit


def _first_group(text: str) -> str:
    """The text inside the first balanced (...) of text ('' if none)."""
    start = text.find("(")
    if start < 0:
        return ""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return ""


def readme_map(readme: str) -> dict[str, set[str]]:
    """Package -> the names its README bullet lists ("mod" or "subpkg/")."""
    bullets = re.split(r"(?m)^(?=- )", readme)
    out: dict[str, set[str]] = {}
    for b in bullets:
        m = re.match(r"- `([a-z_0-9]+)/`", b)
        if not m or m.group(1) not in PACKAGES:
            continue
        names = re.findall(r"`([^`]+)`", _first_group(b[m.end():]))
        out[m.group(1)] = {n for n in names if NAME.match(n)}
    return out


def tree_map(pkg: str) -> set[str]:
    """The package's modules ("mod") and subpackages ("sub/"): git's tracked files in a checkout (a file someone
    is still writing is not the tree yet), the files on disk elsewhere."""
    try:
        out = subprocess.run(["git", "ls-files", "--", f"{pkg}/"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(ROOT)) for p in (ROOT / pkg).rglob("*.py")]
    names = set()
    for rel in out:
        parts = Path(rel).parts[1:]
        if len(parts) == 1 and parts[0].endswith(".py") and parts[0] != "__init__.py":
            names.add(parts[0][:-3])
        elif len(parts) == 2 and parts[1] == "__init__.py":
            names.add(f"{parts[0]}/")
    return names


def test_parser_reads_a_bullet() -> None:
    text = "- `pkg/` (`a`, `b/` (nested), `c.d`, `x-y`): words `not_me`\n  more\n- `other/`: none\n"
    assert readme_map(text.replace("pkg", "router").replace("other", "l2fs")) == {"router": {"a", "b/"},
                                                                                   "l2fs": set()}


def test_readme_module_map_matches_the_tree() -> None:
    listed = readme_map((ROOT / "README.md").read_text())
    assert set(listed) == set(PACKAGES), f"README has no module-map bullet for {set(PACKAGES) - set(listed)}"
    problems = []
    for pkg in PACKAGES:
        if missing := sorted(tree_map(pkg) - listed[pkg]):
            problems.append(f"{pkg}/: not in the README's list: {missing}")
        on_disk = {p.stem for p in (ROOT / pkg).glob("*.py")} | {
            f"{p.name}/" for p in (ROOT / pkg).iterdir() if (p / "__init__.py").exists()}
        if stale := sorted(listed[pkg] - on_disk):
            problems.append(f"{pkg}/: the README lists what is not there: {stale}")
    assert not problems, "\n".join(problems)
