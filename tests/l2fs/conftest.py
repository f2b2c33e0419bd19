"""l2fs fixtures: real master/worker processes on loopback under pytest's tmp_path."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    """The l2fs tests' `cluster` (tests/conftest.py): two workers (node-1, node-2), 1 GiB each, per module."""
    return {"capacity": "1G"}

