"""Fixtures for tests/netns: clusters of network namespaces built by l2fs.testing.netns (the same code as
`l2fs netns up`). They need root and ip/tc/nsenter; without them the tests skip with the reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netns_helpers import require_host

from l2fs.testing.netns import NetnsCluster


@pytest.fixture
def netns_cluster(request: pytest.FixtureRequest) -> Iterator[NetnsCluster]:
    """A 3-node cluster, unshaped unless the test says `@pytest.mark.parametrize("netns_cluster",
    [{"nodes": 2, "link": "200mbit"}], indirect=True)`. Removed after the test."""
    require_host()
    kwargs = dict(getattr(request, "param", None) or {"nodes": 3})
    with NetnsCluster(**kwargs) as c:
        yield c


@pytest.fixture
def netns_host() -> None:
    """Skip unless this machine can build namespace clusters (for tests that build their own)."""
    require_host()
