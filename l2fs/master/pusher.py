"""What the master pushes to workers: pending deletes/renames until acked, and seal MACs of committed blocks."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import grpc

from l2fs.common import (
    RpcError,
    auth_metadata,
    capability,
    make_channel,
)
from l2fs.master.journal import JournalError
from l2fs.master.namespace import NamespaceOps
from l2fs.master.state import PENDING, log
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg


class PusherOps(NamespaceOps):
    """Calls to workers, pending namespace changes and seal delivery (the pusher thread)."""


    def _worker_stub(self, address: str) -> pbg.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = pbg.WorkerStub(make_channel(address, self._tls_ca))
            self._stubs[address] = stub
        return stub


    def _worker_md(self, worker_id: str, method: str, request: Any) -> tuple[tuple[str, str], ...] | None:
        """Metadata of a maintenance call to a worker: our token and, with a block key, the call's MAC under
        that worker's data key (capability.master_call_mac: another worker's token does not make one)."""
        md = tuple(auth_metadata(self._token) or ())
        if self.minter is not None:
            md += self.minter.call_metadata(worker_id, method, request)
        return md or None


    def _tell_worker(self, worker_id: str, call: str, request: Any) -> None:
        """Master -> worker RPC in the background, best effort: a dead worker re-reports later."""
        with self.lock:
            w = self.workers.get(worker_id)
            address = w.address if w is not None else None
        if address is None:
            return

        def send() -> None:
            # in the background, retry with growing deadlines: a loaded worker that misses one 1 s
            # deadline would otherwise keep a losing writer's orphan block until it restarts
            attempts = 3
            md = self._worker_md(worker_id, call, request)
            for i in range(attempts):
                try:
                    getattr(self._worker_stub(address), call)(request, timeout=1.0 * (2 ** i), metadata=md)
                    return
                except grpc.RpcError as e:
                    if i + 1 == attempts or e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                             grpc.StatusCode.UNAVAILABLE):
                        log.warning("worker %s %s failed: %s", worker_id, call, e.code())
                        return
                    if self._stop.wait(0.2 * (2 ** i)):
                        return

        self._bg.submit(send)



    PUSH_BATCH = 10_000  # changes per DeleteBlocks/SetPaths call

    def _record(self, changes: list[tuple[str, str, str | None]]) -> None:
        """Make (worker, block, new path | None = delete) changes durable before they are acknowledged."""
        try:
            self.pending.record(changes)
        except JournalError as e:
            log.error("%s", e)
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{e}: the operation was not applied") from e
        PENDING.set(len(self.pending))


    def _push(self, wid: str, timeout: float = 1.0, lock_wait: float = 0.25) -> bool:
        """Send one worker its pending changes (deletes, then new paths) and forget what it acknowledged.
        False when it is not live, is unreachable, or another push to it is under way (that one, or the
        pusher's next round, carries our change: a client call never waits for more than one attempt)."""
        with self.lock:
            w = self.workers.get(wid)
            if w is None or not w.alive:
                return False
            address = w.address
            send_lock = self._send_locks.setdefault(wid, threading.Lock())
        if not send_lock.acquire(timeout=lock_wait):
            return False
        try:
            ops = self.pending.batch(wid, self.PUSH_BATCH)  # read under the send lock: the newest state
            if not ops:
                return True
            deletes = [b for b, p in ops.items() if p is None]
            moves = [(b, p) for b, p in ops.items() if p is not None]
            stub = self._worker_stub(address)
            try:
                if deletes:
                    req = pb.BlockIds(block_ids=deletes)
                    stub.DeleteBlocks(req, timeout=timeout, metadata=self._worker_md(wid, "DeleteBlocks", req))
                if moves:
                    mreq = pb.SetPathsRequest(block_ids=[b for b, _ in moves], paths=[p for _, p in moves],
                                              seals=self._reseal(wid, moves))
                    stub.SetPaths(mreq, timeout=timeout, metadata=self._worker_md(wid, "SetPaths", mreq))
            except grpc.RpcError as e:
                log.warning("worker %s: %d pending namespace change(s) not confirmed yet (%s)", wid, len(ops),
                            e.code())
                return False
            with self.lock:
                same = self.workers.get(wid) is w and w.alive
            if not same:
                # declared dead (or re-registered) while this push was in flight: its re-registration report
                # may have been read before the worker applied these changes, and only the pending changes
                # keep that report from publishing a removed or renamed-away path again. Keep them; the next
                # push sends them again (deletes and SetPaths are idempotent on the worker).
                log.info("worker %s: %d change(s) applied across its re-registration; kept pending", wid, len(ops))
                return False
            self.pending.acked(wid, ops)
            PENDING.set(len(self.pending))
            return True
        finally:
            send_lock.release()


    # ---------- seal MACs ----------

    SEAL_MEMORY = 1 << 16  # undelivered seals remembered per worker (oldest forgotten: that block is unsealed)
    SEAL_WAIT = 1.0  # seconds a commit waits for its seals to reach the worker before the pusher takes over

    @property
    def sealing(self) -> bool:
        """Whether this master seals commits and publishes only sealed reports (a block key, protocol >= 4)."""
        return self.block_key is not None and self.protocol_version >= 4


    def _seal(self, wid: str, bid: str, size: int, crc: int, path: str, sealed: list[tuple[str, str]]) -> None:
        """Queue the seal of a block just published (lock held); `sealed` collects what to deliver now."""
        if self.block_key is None or not self.sealing:
            return
        sealed.append((wid, bid))
        q = self.seals.setdefault(wid, OrderedDict())
        q[bid] = (crc, capability.seal_mac(self.block_key.key, wid, bid, size, crc, path))
        if len(q) > self.SEAL_MEMORY:
            q.popitem(last=False)


    def _reseal(self, wid: str, moves: list[tuple[str, str]]) -> list[str]:
        """Seals for renamed blocks at their new paths (sent with SetPaths, so the worker's manifest keeps a seal
        that verifies over the path it reports); "" where this master does not seal or the path no longer
        holds that block (a newer change of it follows)."""
        if self.block_key is None or not self.sealing:
            return []
        out = []
        with self.lock:
            for bid, path in moves:
                e = self.files.get(path)
                out.append(capability.seal_mac(self.block_key.key, wid, bid, e.size, e.crc32c, path)
                           if e is not None and e.block_id == bid and e.worker_id == wid else "")
        return out


    def _seal_of(self, wid: str, b: pb.BlockReport) -> str:
        """The seal to check a report against: the worker's own, else one still on its way to it (lock held)."""
        if b.seal:
            return b.seal
        q = self.seals.get(wid)
        got = q.get(b.block_id) if q is not None else None
        return got[1] if got is not None else ""


    def _deliver_now(self, sealed: list[tuple[str, str]]) -> None:
        """Deliver the seals a Commit/CommitMany just minted before it answers (one call per worker), so an
        acknowledged put survives a master restart that follows at once; a worker that does not answer within
        SEAL_WAIT gets them from the pusher (the put is acknowledged anyway: only a master restart before that
        delivery costs the block, as a miss). A worker that missed that deadline gets its seals only from the
        pusher for the next 10 s: a hung (or hostile) worker must not hold the master's handler threads."""
        by_worker: dict[str, list[str]] = {}
        for wid, bid in sealed:
            by_worker.setdefault(wid, []).append(bid)
        for wid, bids in by_worker.items():
            now = time.monotonic()
            with self.lock:
                w = self.workers.get(wid)
                q = self.seals.get(wid)
                batch = [(b, q[b]) for b in bids if q is not None and b in q]
                leave = w is not None and w.seal_sync_after > now  # it missed a deadline lately
            if not batch:
                continue
            if w is None or leave:
                self._push_wake.set()  # the pusher delivers them
                continue
            if not self._send_seals(wid, batch, self.SEAL_WAIT):
                with self.lock:
                    w.seal_sync_after = time.monotonic() + 10.0
                self._push_wake.set()


    def _push_seals(self, wid: str, timeout: float = 2.0) -> bool:
        """Deliver one batch of `wid`'s undelivered seals; True when something was delivered (the caller goes on)."""
        with self.lock:
            q = self.seals.get(wid)
            if not q:
                self.seals.pop(wid, None)
                return False
            batch = list(q.items())[:self.PUSH_BATCH]
        return self._send_seals(wid, batch, timeout)


    def _send_seals(self, wid: str, batch: list[tuple[str, tuple[int, str]]], timeout: float) -> bool:
        """One SealBlocks call; the seals it delivered are forgotten. False when `wid` is not live, takes no
        seals or did not answer."""
        with self.lock:
            w = self.workers.get(wid)
            if w is None or not w.alive or not w.seals:
                return False
            address = w.address
        try:
            sreq = pb.SealRequest(block_ids=[b for b, _ in batch], crc32cs=[v[0] for _, v in batch],
                                  seals=[v[1] for _, v in batch])
            self._worker_stub(address).SealBlocks(sreq, timeout=timeout,
                                                  metadata=self._worker_md(wid, "SealBlocks", sreq))
        except grpc.RpcError as e:
            log.warning("worker %s: %d seal(s) not delivered yet (%s)", wid, len(batch), e.code())
            return False
        with self.lock:
            q = self.seals.get(wid, OrderedDict())
            for bid, v in batch:
                if q.get(bid) == v:
                    del q[bid]
            if not q:
                self.seals.pop(wid, None)
        return True


    def _pusher(self) -> None:
        """Retries every pending change until its worker confirms it, and delivers seals (woken by
        registrations and commits)."""
        while not self._stop.is_set():
            self._push_wake.wait(1.0)
            self._push_wake.clear()
            for wid in list(self.seals):
                for _ in range(100):
                    if self._stop.is_set() or not self._push_seals(wid):
                        break
            for wid in self.pending.workers():
                if self._stop.is_set():
                    return
                for _ in range(100):  # more than one batch; bounded, a failing journal must not spin
                    if not self._push(wid, timeout=2.0, lock_wait=2.0) or wid not in self.pending.workers():
                        break
