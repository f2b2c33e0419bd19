"""l2fs fixtures: real master/worker processes on loopback under pytest's tmp_path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from l2fs.testing.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two workers (node-1, node-2), 1 GiB each, shared by a test module."""
    with LocalCluster(tmp_path_factory.mktemp("l2fs"), workers=2, capacity="1G") as c:
        yield c

