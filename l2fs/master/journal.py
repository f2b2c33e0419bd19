"""The master's pending namespace operations: deletes and renames it acknowledged that a worker has not
confirmed yet.

Why: the namespace is rebuilt from the workers' manifests (a worker re-reports every sealed block when it
re-registers), so an `rm` or `rename` the worker missed (paused past the heartbeat timeout, unreachable, or
the master restarted before it could tell it) would come back with that report: the removed file
reappears, the renamed temp file is published under its old name, an overwritten destination serves the
superseded bytes. Each change is recorded here per block before the client gets its answer, applied to
every report of that block at (re)registration, and pushed to the worker until it acknowledges (it
persists the change in its manifest before answering); only then is it forgotten.

With a journal file (`l2fs master --journal PATH`, on a volume) the record is a SQLite row written with
`synchronous=FULL` before the acknowledgement, so it survives a master crash or restart; without one it
lives in memory (it survives worker pauses and restarts, not a master restart).
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from pathlib import Path

from l2fs.common.protocol import JOURNAL_VERSION

DELETED_MEMORY = 1 << 16  # confirmed deletes remembered (PendingOps._deleted)

# worker id -> block id -> new path of the block, or None when the block is deleted
Ops = dict[str, dict[str, str | None]]


class JournalError(Exception):
    """The journal could not be written (the operation must not be acknowledged)."""


class PendingOps:
    """Per block, the latest intended state (a later rename or delete of the same block replaces an
    earlier one, so replaying only the latest is correct). Thread-safe; never calls out under its lock."""

    def __init__(self, path: str | None = None) -> None:
        self._lock = threading.Lock()
        self.ops: Ops = {}
        # Deletes a worker confirmed, kept a while: a re-registration report that worker built before it ran
        # the delete may reach us after the confirmation, and must not publish the block again (block ids are
        # never reused, so remembering an id as deleted is always right). Bounded, oldest forgotten.
        self._deleted: OrderedDict[str, None] = OrderedDict()
        self._db: sqlite3.Connection | None = None
        if path:
            self._open(Path(path))

    def _open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > JOURNAL_VERSION:
            db.close()
            raise JournalError(f"{path}: journal format {version} is newer than this master reads "
                               f"({JOURNAL_VERSION}): upgrade the master")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # acknowledged means on disk
        db.execute("""CREATE TABLE IF NOT EXISTS pending (
            worker_id TEXT NOT NULL, block_id TEXT NOT NULL, path TEXT,
            PRIMARY KEY (worker_id, block_id))""")
        db.execute(f"PRAGMA user_version={JOURNAL_VERSION}")
        for wid, bid, p in db.execute("SELECT worker_id, block_id, path FROM pending"):
            self.ops.setdefault(wid, {})[bid] = p
        self._db = db

    @property
    def durable(self) -> bool:
        return self._db is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.ops.values())

    def record(self, changes: list[tuple[str, str, str | None]]) -> None:
        """Record (worker id, block id, new path or None for delete) changes, on disk first when journaled;
        JournalError when that write failed (nothing recorded then)."""
        if not changes:
            return
        with self._lock:
            if self._db is not None:
                try:
                    self._db.execute("BEGIN")
                    self._db.executemany("INSERT OR REPLACE INTO pending VALUES (?,?,?)", changes)
                    self._db.execute("COMMIT")
                except sqlite3.Error as e:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise JournalError(f"journal write failed: {e}") from e
            for wid, bid, p in changes:
                self.ops.setdefault(wid, {})[bid] = p

    def lookup(self, wid: str, bid: str) -> tuple[bool, str | None]:
        """(True, new path or None = deleted) when a change of this block is pending, else (False, None)."""
        with self._lock:
            mine = self.ops.get(wid)
            if mine is None or bid not in mine:
                return bid in self._deleted, None
            return True, mine[bid]

    def workers(self) -> list[str]:
        with self._lock:
            return [w for w, v in self.ops.items() if v]

    def batch(self, wid: str, limit: int) -> dict[str, str | None]:
        """Up to `limit` pending changes of one worker, to send it."""
        with self._lock:
            mine = self.ops.get(wid, {})
            return {bid: mine[bid] for bid in list(mine)[:limit]}

    def acked(self, wid: str, sent: dict[str, str | None]) -> None:
        """Forget the changes the worker confirmed, unless a newer change of the same block came meanwhile."""
        with self._lock:
            mine = self.ops.get(wid, {})
            done = [bid for bid, p in sent.items() if bid in mine and mine[bid] == p]
            if self._db is not None and done:
                try:
                    self._db.execute("BEGIN")
                    self._db.executemany("DELETE FROM pending WHERE worker_id=? AND block_id=?",
                                         [(wid, bid) for bid in done])
                    self._db.execute("COMMIT")
                except sqlite3.Error:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    return  # kept: sent again later, which is harmless (the worker's calls are idempotent)
            for bid in done:
                if mine[bid] is None:
                    self._deleted[bid] = None
                del mine[bid]
            while len(self._deleted) > DELETED_MEMORY:
                self._deleted.popitem(last=False)
            if not mine:
                self.ops.pop(wid, None)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
