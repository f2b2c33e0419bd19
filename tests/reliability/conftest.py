"""Fixtures for the reliability suite: real l2fs clusters (master + workers as processes on loopback)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Client deadline used throughout the suite; the issue asks for <= 2 s by default.
DEADLINE = 2.0
# Scheduling slack on a shared 2-core CI box: a call may overrun its deadline by at most this much.
SLACK = 0.75


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory for LocalCluster instances; every cluster it made is stopped at teardown."""
    from l2fs.local import LocalCluster

    made: list[Any] = []

    def make(workers: int = 2, **opts: Any) -> Any:
        base = tmp_path / f"cluster{len(made)}"
        cluster = LocalCluster(base, workers=workers, **opts)
        made.append(cluster)
        cluster.__enter__()
        return cluster

    yield make
    for cluster in reversed(made):
        with contextlib.suppress(Exception):
            cluster.__exit__(None, None, None)
