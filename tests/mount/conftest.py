"""Fixtures for the mount tests: a real LocalCluster (master + 2 workers) and real FUSE mounts of it,
each mount a separate `l2fs mount` process with its own --node-id (so two mounts act as two nodes)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mount_helpers import Mount, start_mount

from l2fs.testing.cluster import LocalCluster

FUSE_OK = os.path.exists("/dev/fuse") and os.geteuid() == 0 and bool(
    subprocess.run(["sh", "-c", "command -v fusermount3"], capture_output=True).stdout)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that mount FUSE get the `fuse` marker, and a skip with a reason where FUSE is unavailable."""
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent != here:
            continue
        uses = {"two_mounts", "mount_factory"} & set(getattr(item, "fixturenames", ()))
        # fsspec alone needs no FUSE, nor do in-process unit tests
        if uses or (item.module.__name__ != "test_mount_fsspec" and item.get_closest_marker("unit") is None):
            item.add_marker(pytest.mark.fuse)
            if not FUSE_OK:
                item.add_marker(pytest.mark.skip(reason="needs /dev/fuse, root and fusermount3"))


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    """The mount tests' `cluster` (tests/conftest.py): two workers (node-1, node-2), 2 GiB each, per module."""
    return {"capacity": "2G"}


@pytest.fixture
def mount_factory(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """mount_factory(master, "--node-id", "node-1", ...) -> Mount; all are unmounted at teardown."""
    mounts: list[Mount] = []

    def make(master: str, *args: str, name: str | None = None) -> Mount:
        m = start_mount(tmp_path / (name or f"mnt{len(mounts) + 1}"), master, *args)
        mounts.append(m)
        return m

    yield make
    for m in mounts:
        m.stop()


@pytest.fixture
def two_mounts(cluster: LocalCluster, mount_factory: Callable[..., Mount]) -> tuple[Mount, Mount]:
    """Mount 1 as node-1 and mount 2 as node-2 of the same cluster."""
    return (mount_factory(cluster.master, "--node-id", "node-1"),
            mount_factory(cluster.master, "--node-id", "node-2"))
