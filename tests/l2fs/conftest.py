"""l2fs fixtures: real master/worker processes on loopback under pytest's tmp_path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from l2fs.local import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two workers (node-1, node-2), 1 GiB each, shared by a test module."""
    with LocalCluster(tmp_path_factory.mktemp("l2fs"), workers=2, capacity="1G") as c:
        yield c


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
