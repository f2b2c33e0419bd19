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
