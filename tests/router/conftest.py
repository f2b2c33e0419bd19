"""Router fixtures: a Cluster that starts real test replicas and routers and stops them at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from router_helpers import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
