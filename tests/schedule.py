"""How the suite runs in parallel (pytest-xdist, the README's `-n 3`; tests/conftest.py installs it): a module
is a unit of work, and every module that starts vLLM engines is one unit together. A module of its own name
(like rotation.py) so that tests/conftest.py and tests/test_parallel.py import it alike."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_GROUP = "engines"
_VLLM_MARK = re.compile(r"\bpytest\.mark\.vllm\b")


def engine_modules(root: Path = ROOT) -> set[str]:
    """Test modules (paths relative to the repository, as in node ids) that start vLLM engines: those whose
    source carries the `vllm` marker. Read from the source because pytest-xdist's controller schedules by node
    id without collecting; tests/test_parallel.py checks this set against the markers pytest collects."""
    return {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")
            if _VLLM_MARK.search(p.read_text(errors="replace"))}


def unit_of_work(nodeid: str, engines: set[str]) -> str:
    """The scheduling unit of a test under pytest-xdist: the one engine group, or its module."""
    path = nodeid.split("::", 1)[0]
    return ENGINE_GROUP if path in engines else path
