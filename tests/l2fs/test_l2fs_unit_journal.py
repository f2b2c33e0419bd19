"""The master's pending-change journal (l2fs/master/journal.py): what a reopened journal still knows, and when a
change may be forgotten."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from l2fs.common.protocol import JOURNAL_VERSION
from l2fs.master.journal import JournalError, PendingOps

pytestmark = pytest.mark.unit


def test_journal_survives_reopen_and_keeps_the_latest_change(tmp_path: Path) -> None:
    path = str(tmp_path / "j.sqlite3")
    ops = PendingOps(path)
    ops.record([("w1", "b1", "/a"), ("w1", "b2", None), ("w2", "b3", "/c")])
    ops.record([("w1", "b1", None)])  # b1 renamed, then deleted: only the delete matters
    ops.close()
    again = PendingOps(path)
    assert again.lookup("w1", "b1") == (True, None)
    assert again.lookup("w1", "b2") == (True, None)
    assert again.lookup("w2", "b3") == (True, "/c")
    assert again.lookup("w2", "b1") == (False, None)
    assert len(again) == 3 and sorted(again.workers()) == ["w1", "w2"]


def test_ack_of_a_superseded_change_keeps_the_newer_one(tmp_path: Path) -> None:
    path = str(tmp_path / "j.sqlite3")
    ops = PendingOps(path)
    ops.record([("w1", "b1", "/a")])
    sent = ops.batch("w1", 10)
    ops.record([("w1", "b1", "/b")])  # renamed again while the first push was under way
    ops.acked("w1", sent)
    assert ops.lookup("w1", "b1") == (True, "/b")
    ops.acked("w1", ops.batch("w1", 10))
    assert len(ops) == 0 and ops.workers() == []
    ops.close()
    assert len(PendingOps(path)) == 0  # forgotten on disk too


def test_newer_journal_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={JOURNAL_VERSION + 1}")
    db.close()
    with pytest.raises(JournalError, match="newer"):
        PendingOps(str(path))


def test_memory_only_without_a_path() -> None:
    ops = PendingOps()
    ops.record([("w", "b", None)])
    assert not ops.durable and ops.lookup("w", "b") == (True, None)


def test_a_confirmed_delete_still_rejects_a_report_built_before_it() -> None:
    """The worker ran the pushed delete and confirmed it while its re-registration report, built just before,
    was on its way (CI: a removed file came back, test_ns_ops_survive_a_worker_paused_past_the_heartbeat_timeout):
    the block still counts as deleted; a confirmed rename is forgotten as before (its report carries the new path)."""
    ops = PendingOps()
    ops.record([("w1", "a" * 32, None), ("w1", "b" * 32, "/new")])
    ops.acked("w1", {"a" * 32: None, "b" * 32: "/new"})
    assert ops.workers() == []
    assert ops.lookup("w1", "a" * 32) == (True, None)
    assert ops.lookup("w1", "b" * 32) == (False, None)
