"""`kvtier --help` names every benchmark, and every name it lists runs through the CLI's own dispatcher.

Every module under kvtier/bench with a main() is a benchmark, except a mode of another one (its docstring opens
with that bench's command and a flag: `kvtier bench l2 --metadata`): each must be reachable by a name that
`kvtier --help` prints, so that a bench registered in `kvtier bench` but missing from the top-level help, or
written but never registered, fails here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import BENCHES

ROOT = Path(__file__).resolve().parents[2]


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _listed() -> list[str]:
    r = _kvtier("--help")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("bench "))
    m = re.search(r"benchmarks: (.*?) \(", line)
    assert m, line
    return [n.strip() for n in m.group(1).split("|")]


def _bench_modules(listed: list[str]) -> set[str]:
    out = set()
    for f in (ROOT / "kvtier" / "bench").glob("*.py"):
        tree = ast.parse(f.read_text())
        if f.stem == "__init__" or not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        mode = re.match(r"`kvtier bench (\S+) --", ast.get_docstring(tree) or "")
        if mode:  # a mode of another bench, reached through its flag
            assert mode.group(1) in listed, (f.name, mode.group(1))
            continue
        out.add(f"kvtier.bench.{f.stem}")
    return out


def test_top_level_help_lists_every_benchmark_module() -> None:
    names = _listed()
    assert sorted(names) == sorted(BENCHES), names  # the listed names are the ones `kvtier bench` dispatches
    assert {BENCHES[n][0] for n in names} == _bench_modules(names), names
    r = _kvtier("bench", "--help")
    assert r.returncode == 0 and all(re.search(rf"^\s+{re.escape(n)}\s", r.stdout, re.M) for n in names), r.stdout


@pytest.mark.parametrize("name", list(BENCHES))  # the names listed, by the test above
def test_every_listed_benchmark_answers_its_help(name: str) -> None:
    r = _kvtier("bench", name, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"usage: kvtier bench {name}" in r.stdout, r.stdout[:500]
