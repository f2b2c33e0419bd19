"""Shared test fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from schedule import ENGINE_GROUP, engine_modules, unit_of_work

ROOT = Path(__file__).resolve().parent.parent
# Built artefacts reused across test runs (tiny model); ignored by git.
CACHE = Path(os.environ.get("KVTIER_TEST_CACHE", ROOT / ".kvtier" / "test-cache"))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (a dev dependency); absent, nothing calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (the README's `-n 3`): each module is one unit of work, so its module fixtures
    (clusters, engines) start once, on one worker; every module that starts vLLM engines joins one unit that
    runs first, on one worker, one module after another (engines must not overlap: 2 cores, ~1 min of start-up
    each). The other workers take the remaining modules as they come: those spend most of their time waiting
    on real processes (about a quarter of a core each). pytest-xdist's own `--dist loadgroup` cannot do this
    with pytest >= 9.2 (it renames node ids through an attribute pytest no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    engines = engine_modules()

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid, engines)

    config.option.loadscopereorder = False  # keep the collection order: the engine unit first
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, the engine modules come first (every worker orders alike, as xdist requires):
    the longest unit of work then starts at once instead of last. A plain run keeps the collection order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        engines = engine_modules()
        items.sort(key=lambda i: unit_of_work(i.nodeid, engines) != ENGINE_GROUP)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the locally built tiny Llama (built once, cached under .kvtier/test-cache; parallel workers
    take a file lock so that one builds it and the others wait)."""
    import fcntl

    from kvtier.devstack.tiny_model import build

    out = CACHE / "tiny-llama"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "tiny-llama.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            build(out)
    return out


class _Clusters:
    """Starts LocalClusters (master + workers node-1..N on loopback, data under a fresh dir) and stops them all."""

    def __init__(self, new_dir: Callable[[str | None], Path], tolerate_stop_errors: bool) -> None:
        self.new_dir, self.tolerate = new_dir, tolerate_stop_errors
        self.started: list[Any] = []

    def start(self, workers: int = 2, *, name: str | None = None, tokens: list[dict[str, Any]] | None = None,
              node_ids: Sequence[str] = (), each_worker_args: Sequence[Sequence[str]] = (), started: bool = True,
              **options: Any) -> Any:
        """A LocalCluster of `workers` workers, running (started=False: not yet; the caller starts and stops it
        with `with cluster:`, to stop it before something it needs goes, e.g. a TokenReview API); stopped with
        the factory in any case.

        name: its directory (cluster_factory: a fresh one named after it; make_cluster: tmp_path/<name>, which
            the test may have seeded, default tmp_path/cluster<N>).
        tokens: the entries of a scoped tokens file, written to <dir>/tokens.json and given to the master and
            every worker as `--tokens-file`, ahead of master_args and worker_args.
        node_ids: worker i's node id (default node-<i+1>).
        each_worker_args: worker i's own arguments, after worker_args (its node's token, its socket, ...).
        options: LocalCluster's (capacity, heartbeat_timeout, token, master_args, worker_args, block_key, ...).
        """
        from l2fs.testing.cluster import LocalCluster

        base = self.new_dir(name)
        if tokens is not None:
            base.mkdir(parents=True, exist_ok=True)
            tokens_file = base / "tokens.json"
            tokens_file.write_text(json.dumps(tokens))
            for key in ("master_args", "worker_args"):
                options[key] = ["--tokens-file", str(tokens_file), *(options.get(key) or [])]
        cluster = LocalCluster(base, workers=workers, **options)
        for w, node in zip(cluster.workers, node_ids, strict=False):
            w.node_id = node
        for w, args in zip(cluster.workers, each_worker_args, strict=False):
            w.extra_args += list(args)
        self.started.append(cluster)
        if started:
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
    """The suite's l2fs cluster factory, per module: cluster_factory(workers=2, name="l2fs", **options) returns a
    running LocalCluster (options: `_Clusters.start`); every cluster it made is stopped when the module is done."""
    clusters = _Clusters(lambda name: tmp_path_factory.mktemp(name or "l2fs"), tolerate_stop_errors=False)
    try:
        yield clusters.start
    finally:
        clusters.stop_all()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """The same factory per test (a cluster a test damages or restarts): data under the test's tmp_path."""
    n = itertools.count()
    clusters = _Clusters(lambda name: tmp_path / (name or f"cluster{next(n)}"), tolerate_stop_errors=True)
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
