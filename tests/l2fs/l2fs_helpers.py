"""Helpers shared by the l2fs tests (a uniquely named module: `conftest` names clash across areas)."""

from __future__ import annotations

import pytest

from l2fs.local import LocalCluster


def wait_until(cond, timeout: float = 10.0, interval: float = 0.05):  # noqa: ANN001, ANN201
    """Poll cond() until truthy; returns its value or fails the test after timeout."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(interval)


def block_files(cluster: LocalCluster, i: int) -> list:
    """Block files on worker i's disk (what it really stores)."""
    return sorted(p for p in (cluster.workers[i].data_dir / "blocks").glob("*/*") if p.is_file())
