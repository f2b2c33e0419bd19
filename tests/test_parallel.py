"""The suite's parallel schedule (tests/conftest.py): pytest-xdist's controller groups tests by node id without
collecting, so the engine modules are found in the source; this checks that set against the markers pytest
itself collects, and that engine tests share one unit of work while every other module is its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from schedule import ENGINE_GROUP, engine_modules, unit_of_work

ROOT = Path(__file__).resolve().parents[1]


def test_engine_modules_are_the_modules_pytest_marks_vllm() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "vllm", "-p", "no:cacheprovider"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "KVTIER_ROTATE": "all", "KVTIER_ONEBOX": "all"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    marked = {line.split("::", 1)[0] for line in r.stdout.splitlines() if "::" in line}
    assert marked, r.stdout[-2000:]
    assert marked == engine_modules(), (marked ^ engine_modules())


@pytest.mark.unit
def test_engine_tests_share_one_unit_and_other_modules_are_their_own(tmp_path: Path) -> None:
    (tmp_path / "tests" / "a").mkdir(parents=True)
    marker = "pytest.mark." + "vllm"  # spelled apart, or this module would count as an engine module itself
    (tmp_path / "tests" / "a" / "test_eng.py").write_text(f"import pytest\npytestmark = {marker}\n")
    (tmp_path / "tests" / "a" / "test_plain.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "tests" / "test_other.py").write_text("# mentions vllm but carries no marker\n")
    engines = engine_modules(tmp_path)
    assert engines == {"tests/a/test_eng.py"}
    assert unit_of_work("tests/a/test_eng.py::test_one[x]", engines) == ENGINE_GROUP
    assert unit_of_work("tests/a/test_plain.py::test_x", engines) == "tests/a/test_plain.py"
    assert unit_of_work("tests/a/test_plain.py::C::test_y", engines) == "tests/a/test_plain.py"
