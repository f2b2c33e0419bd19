"""Fixtures for the reliability suite: real l2fs clusters (master + workers as processes on loopback)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory for LocalCluster instances; every cluster it made is stopped at teardown."""
    from l2fs.testing.cluster import LocalCluster

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
