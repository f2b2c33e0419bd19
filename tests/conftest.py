"""Shared test fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Built artefacts reused across test runs (tiny model); ignored by git.
CACHE = Path(os.environ.get("KVTIER_TEST_CACHE", ROOT / ".kvtier" / "test-cache"))


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the locally built tiny Llama (built once, cached under .kvtier/test-cache)."""
    from connector.tiny_model import build

    out = CACHE / "tiny-llama"
    if not (out / "config.json").exists():
        build(out)
    return out
