"""Deletes and renames cannot come back: a worker that missed them (SIGSTOPped past the heartbeat
timeout, the master restarted meanwhile) re-reports its manifest at re-registration, and the master's
pending changes (`l2fs/master/journal.py`; on disk with `--journal`) decide what that report may publish.

Before: the removed file came back, the renamed file reappeared under its old name, and the destination of
an overwriting rename served the bytes it had before the rename.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reliability_faults import DEADLINE, find_block_files, payload, proc_pid, wait_until

SIZE = 64 * 1024
HB_TIMEOUT = 3.0


def _cluster(make_cluster: Any, tmp_path: Path, journal: bool) -> Any:
    args = ["--journal", str(tmp_path / "state" / "master-journal.sqlite3")] if journal else []
    return make_cluster(workers=1, heartbeat_timeout=HB_TIMEOUT, master_args=args, journal=journal)


def _write(c: Any) -> dict[str, bytes]:
    """The renamed-in object is written BEFORE the object it replaces, so the newest-copy-wins rule
    of re-registration cannot be what keeps the rename."""
    data = {k: payload(i, SIZE, k) for i, k in enumerate(["/ns/tmp", "/ns/gone", "/ns/a", "/ns/dst"])}
    for k, v in data.items():
        assert c.put(k, v) is True
    return data


def _change(c: Any) -> None:
    """rm + rename + overwriting rename while the worker does not answer: each is acknowledged."""
    assert c.rm("/ns/gone") is True
    c.rename("/ns/a", "/ns/b")
    c.rename("/ns/tmp", "/ns/dst", overwrite=True)
    assert not c.exists("/ns/gone") and c.exists("/ns/b") and c.exists("/ns/dst")


def _check(c: Any, cluster: Any, data: dict[str, bytes]) -> None:
    """Once the worker is back: the namespace is the one the client was told, and the worker's disk holds
    no copy of what was removed or replaced (the pending changes were pushed and confirmed)."""
    def back() -> bool:  # re-registered: its whole report is applied in one call
        rep = c.report()
        return bool(rep.workers) and all(w.alive for w in rep.workers) and rep.files > 0

    wait_until(back, 20)
    assert not c.exists("/ns/gone"), "a removed file came back with the worker's re-registration"
    assert not c.exists("/ns/a"), "a renamed file reappeared under its old name"
    assert not c.exists("/ns/tmp"), "a renamed temp file reappeared"
    assert c.get("/ns/b") == data["/ns/a"]
    assert c.get("/ns/dst") == data["/ns/tmp"], "the rename destination serves the bytes it replaced"
    assert sorted(e.path for e in c.ls("/ns")) == ["/ns/b", "/ns/dst"]
    root = cluster.workers[0].data_dir
    for gone in ("/ns/gone", "/ns/dst"):  # the removed object and the one the rename replaced
        wait_until(lambda gone=gone: not find_block_files([root], data[gone][:4096]), 10)


def _while_paused(cluster: Any, c: Any, then: Callable[[], None]) -> None:
    """SIGSTOP the worker, make the changes, run `then`, SIGCONT."""
    pid = proc_pid(cluster.workers[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        _change(c)
        then()
    finally:
        os.kill(pid, signal.SIGCONT)


def test_ns_ops_survive_a_worker_paused_past_the_heartbeat_timeout(make_cluster: Any, tmp_path: Path) -> None:
    cluster = _cluster(make_cluster, tmp_path, journal=False)
    c = cluster.client(timeout=DEADLINE)
    data = _write(c)
    # the master gives up on the worker: its next contact is a full re-registration
    _while_paused(cluster, c, lambda: wait_until(lambda: not any(w.alive for w in c.report().workers),
                                                 HB_TIMEOUT + 10))
    _check(c, cluster, data)


def test_ns_ops_survive_a_paused_worker_and_a_master_kill9(make_cluster: Any, tmp_path: Path) -> None:
    cluster = _cluster(make_cluster, tmp_path, journal=True)
    c = cluster.client(timeout=DEADLINE)
    data = _write(c)

    def restart_master() -> None:  # same --journal: it still knows what the worker has not confirmed
        cluster.kill_master(signal.SIGKILL)
        cluster.start_master()

    _while_paused(cluster, c, restart_master)
    _check(cluster.client(timeout=DEADLINE), cluster, data)


def test_rm_acknowledged_while_worker_unreachable_is_durable(make_cluster: Any, tmp_path: Path) -> None:
    """The design says durable: an rm acknowledged while the worker could not be told survives the master
    AND the worker being killed (-9) before any of them learnt more, and a fresh worker process on the
    same data dir never publishes it again."""
    cluster = _cluster(make_cluster, tmp_path, journal=True)
    c = cluster.client(timeout=DEADLINE)
    data = _write(c)
    os.kill(proc_pid(cluster.workers[0]), signal.SIGSTOP)
    _change(c)
    cluster.kill_worker(0, signal.SIGKILL)
    cluster.kill_master(signal.SIGKILL)
    cluster.start_master()
    cluster.start_worker(0)
    _check(cluster.client(timeout=DEADLINE), cluster, data)
