"""Shared test fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Built artefacts reused across test runs (tiny model); ignored by git.
CACHE = Path(os.environ.get("KVTIER_TEST_CACHE", ROOT / ".kvtier" / "test-cache"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the locally built tiny Llama (built once, cached under .kvtier/test-cache)."""
    from kvtier.devstack.tiny_model import build

    out = CACHE / "tiny-llama"
    if not (out / "config.json").exists():
        build(out)
    return out


_PROM_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR")


@pytest.fixture(autouse=True)
def _no_inherited_prometheus_dir() -> object:
    """LMCache, once imported by a test in this process, exports PROMETHEUS_MULTIPROC_DIR (one shared, root-owned
    /tmp dir that is never wiped). Every server, engine and client a later test spawns would inherit it: vLLM
    replicas would then merge each other's (and dead processes') counters, a reused pid would continue a dead
    process's counts, and a non-root child's prometheus_client cannot open it. Processes start as they would in
    a pod: with the environment the suite was started with."""
    yield
    if _PROM_DIR is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _PROM_DIR
