"""Shared test fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Built artefacts reused across test runs (tiny model); ignored by git.
CACHE = Path(os.environ.get("KVTIER_TEST_CACHE", ROOT / ".kvtier" / "test-cache"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the locally built tiny Llama (built once, cached under .kvtier/test-cache)."""
    from kvtier.devstack.tiny_model import build

    out = CACHE / "tiny-llama"
    if not (out / "config.json").exists():
        build(out)
    return out


class _Clusters:
    """Starts LocalClusters (master + workers node-1..N on loopback, data under a fresh dir) and stops them all."""

    def __init__(self, new_dir: Callable[[str], Path], tolerate_stop_errors: bool) -> None:
        self.new_dir, self.tolerate = new_dir, tolerate_stop_errors
        self.started: list[Any] = []

    def start(self, workers: int = 2, *, name: str = "l2fs", **options: Any) -> Any:
        from l2fs.testing.cluster import LocalCluster

        cluster = LocalCluster(self.new_dir(name), workers=workers, **options)
        self.started.append(cluster)
        cluster.__enter__()
        return cluster

    def stop_all(self) -> None:
        for cluster in reversed(self.started):
            if self.tolerate:
                with contextlib.suppress(Exception):
                    cluster.__exit__(None, None, None)
            else:
                cluster.__exit__(None, None, None)


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """The suite's l2fs cluster factory, per module: start(workers=2, name="l2fs", **LocalCluster options) returns
    a running LocalCluster; every cluster it started is stopped when the module is done."""
    clusters = _Clusters(tmp_path_factory.mktemp, tolerate_stop_errors=False)
    try:
        yield clusters.start
    finally:
        clusters.stop_all()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """The same factory per test (a cluster a test damages or restarts): data under the test's tmp_path."""
    n = itertools.count()
    clusters = _Clusters(lambda name: tmp_path / f"cluster{next(n)}", tolerate_stop_errors=True)
    try:
        yield clusters.start
    finally:
        clusters.stop_all()


@pytest.fixture(scope="module")
def cluster_options() -> dict[str, Any]:
    """LocalCluster options of `cluster`: a directory's conftest or a test module overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def cluster(cluster_factory: Callable[..., Any], cluster_options: dict[str, Any]) -> Any:
    """The module's shared l2fs cluster: 2 workers (node-1, node-2) unless `cluster_options` says otherwise.
    tests/router and tests/operator have a `cluster` of their own kind (test replicas, a Kubernetes API)."""
    return cluster_factory(**cluster_options)


_PROM_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR")


@pytest.fixture(autouse=True)
def _no_inherited_prometheus_dir() -> object:
    """LMCache, once imported by a test in this process, exports PROMETHEUS_MULTIPROC_DIR (one shared, root-owned
    /tmp dir that is never wiped). Every server, engine and client a later test spawns would inherit it: vLLM
    replicas would then merge each other's (and dead processes') counters, a reused pid would continue a dead
    process's counts, and a non-root child's prometheus_client cannot open it. Processes start as they would in
    a pod: with the environment the suite was started with."""
    yield
    if _PROM_DIR is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _PROM_DIR
