"""The write path: allocate, write blocks (same-node short circuit, data plane, gRPC), commit."""

from __future__ import annotations

import functools
import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from l2fs.client.core import ClientCore, _check, log
from l2fs.client.errors import (
    InvalidArgument,
    InvalidPath,
    L2fsError,
    Unavailable,
    Unimplemented,
    _error,
    _item_error,
)
from l2fs.client.types import _Put
from l2fs.common import (
    FRAME,
    SHARED_POPULATED,
    crc32c_fast,
    pwrite_all,
)
from l2fs.common.capability import NOT_READY
from l2fs.common.fdpass import WRITE as FD_WRITE
from l2fs.common.fdpass import FdPassError, request_fd
from l2fs.common.protocol import PROTOCOL_VERSION
from l2fs.dataplane import DataPlaneError
from l2fs.dataplane.wire import BAD
from l2fs.proto import l2fs_pb2 as pb

PUT_BATCH = 256  # items per AllocateMany/CommitMany (master CPU per put is flat from ~256 on, see docs/l2fs.md)


# The reserved temp name must be new: never written through a symlink planted there (it could point
# anywhere this process may write), never over a file someone else put there first.
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_file(tmp_path: str, mv: memoryview) -> bool:
    """Write a short-circuit temp file; False when this process cannot (no such dir here, permissions,
    disk full, something already at the name): the caller releases the reservation and writes over the
    network instead, with a fresh block id."""
    try:
        fd = os.open(tmp_path, _TMP_FLAGS, 0o644)
    except OSError:
        return False
    return _write_fd(fd, mv)


def _write_fd(fd: int, mv: memoryview) -> bool:
    """Write all of `mv` to a fresh temp file's fd and close it; False on any error."""
    try:
        pwrite_all(fd, mv)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# Where same-node writes go through sealed memfds at all (Client's local_writes: by default only without a data
# plane, since the data plane was faster at every size, `kvtier bench local-put`), blocks larger than this still
# go over the data plane (loopback), not through a sealed memfd:
# the worker copies a memfd at adoption, one block after another, and at 32 MiB (kv8b chunks) a batch of 8 took
# 2.6-3.4 s that way against 1.0-1.3 s over the data plane (parallel streams) with both cores busy (2026-12-03).
LOCAL_WRITE_MAX = 8 << 20


class WriteOps(ClientCore):
    """put and put_many."""



    def put(self, path: str, data: bytes | bytearray | memoryview, *, if_absent: bool = True,
            order_hint: int | None = None) -> bool:
        """Store and atomically publish. Returns True if this call published it, False if it already
        existed (if_absent) . order_hint = position of this object in a prefix chain (0 = first chunk);
        eviction prefers dropping the deepest chunks first."""
        r = self.put_many([(_check(path), data)], if_absent=if_absent,
                          order_hints=None if order_hint is None else [order_hint], return_exceptions=True)[0]
        if isinstance(r, BaseException):
            raise r
        return r


    def put_file(self, path: str, fd: int, *, if_absent: bool = True, order_hint: int | None = None) -> bool:
        """put() of a regular file's current bytes, sent from a mapping of the file (no copy into a buffer). The
        file must not change until this returns (nor be truncated: that would fault the mapping).

        Why MAP_POPULATE: a lazily faulted mapping takes a fault per 4 KiB page; a client's 32 MiB put from it ran
        32.8 ms against 20.2 ms populated and 20.5 ms for put() of the same bytes in memory (2026-12-04; in the
        passthrough mount's publish no difference was resolved). Why not `with mmap(...)`: a raised error's
        traceback holds the frames that hold views of the mapping, and closing it would fail over the error."""
        size = os.fstat(fd).st_size
        if not size:
            return self.put(path, b"", if_absent=if_absent, order_hint=order_hint)
        m = mmap.mmap(fd, size, flags=SHARED_POPULATED, prot=mmap.PROT_READ)
        view = memoryview(m)
        try:
            r = self.put_many([(_check(path), view)], if_absent=if_absent,
                              order_hints=None if order_hint is None else [order_hint], return_exceptions=True)[0]
        finally:
            view.release()
            try:
                m.close()
            except BufferError:  # a failed item's traceback still holds a view of it: unmapped when collected
                pass
        if isinstance(r, BaseException):
            raise r.with_traceback(None)
        return bool(r)

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]], *, if_absent: bool = True,
                 order_hints: Sequence[int] | None = None, return_exceptions: bool = False
                 ) -> list[Any]:
        """Put a batch: one AllocateMany and one CommitMany on the master, one ReserveLocalMany/AdoptLocalMany
        per same-node worker (short-circuit), parallel data-plane writes for the rest. Each item is its own
        put-if-absent, atomically published put: a failed item never fails its neighbours. Returns one bool
        per item (published / already existed); an item's error is raised after all finished (the first one),
        or left in its slot with return_exceptions=True."""
        if order_hints is not None and len(order_hints) != len(items):
            raise ValueError("order_hints must match items in length")
        hints = list(order_hints) if order_hints is not None else [0] * len(items)
        puts = []
        for (path, data), hint in zip(items, hints, strict=True):
            put = _Put(path, memoryview(data).cast("B"), hint or 0)
            try:
                put.path = _check(path)
            except InvalidPath as e:
                put.result = e
            puts.append(put)
        todo = [p for p in puts if p.result is None]
        self._forget(*(p.path for p in todo))  # a location looked up before this put may be out of date
        parts = self._split([p.path for p in todo])
        for r in self._fan([functools.partial(self._put_shard, s, [todo[i] for i in idx], if_absent)
                            for s, idx in parts.items()]):
            if isinstance(r, Exception) and not isinstance(r, L2fsError):
                raise r  # a bug, not a fault: as loud as before the split
        for p in todo:  # only a bug can leave one unset (the shard's call raised): fail that item, not others
            p.result = L2fsError(f"put {p.path}: not finished") if p.result is None else p.result
        results = [p.result for p in puts]
        if not return_exceptions:
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        return results


    def _put_shard(self, shard: int, todo: list[_Put], if_absent: bool) -> None:
        """One shard's slice of a put batch (the shards' slices run in parallel; a failed shard fails only
        its items). At most PUT_BATCH items per round trip, each slice with its own deadline: a batch of
        thousands gets the time its items would have had, and the master holds its lock for a bounded batch."""
        for i in range(0, len(todo), PUT_BATCH):
            pending = todo[i:i + PUT_BATCH]
            # the round trips' timeout plus the bytes at a floor rate (200 MB/s): the deadline is for stalls,
            # not for size (8 x 32 MiB chunks at kv8b geometry take ~1.3 s same-node on a busy 2-core box)
            deadline = time.monotonic() + self.timeout + sum(p.mv.nbytes for p in pending) / 200e6
            while pending:
                pending = self._put_round(pending, if_absent, deadline, shard)


    def _put_round(self, pending: list[_Put], if_absent: bool, deadline: float, shard: int = 0) -> list[_Put]:
        """Allocate, write and commit every pending item once; returns the items to try again (their worker
        was unreachable, or its temp files were not writable from here) with a fresh block id."""
        for p in pending:
            p.tries += 1
        reqs = [pb.AllocateRequest(path=p.path, size=p.mv.nbytes, node_id=self.node_id, if_absent=if_absent,
                                   exclude_workers=p.exclude) for p in pending]
        try:
            allocs = self._many(f"master{shard}", lambda m, r: self._master(m, r, deadline, shard), "AllocateMany",
                                pb.AllocateManyRequest(items=reqs, protocol_version=PROTOCOL_VERSION),
                                "Allocate", reqs)
        except L2fsError as e:
            for p in pending:
                p.result = e
            return []
        to_write = []
        for p, a in zip(pending, allocs, strict=True):
            if isinstance(a, L2fsError):
                p.result = a
            elif a.exists:
                p.result = False
            else:
                p.bid, p.loc, p.written = a.block_id, a.worker, None
                to_write.append(p)
        for p in to_write:  # the writer's own checksum of the bytes it sends (once per put, kept for retries)
            if p.crc is None:
                p.crc = crc32c_fast(p.mv)
        retry = self._write_many(to_write, deadline)
        for p in retry:
            if p.tries >= 3 or time.monotonic() >= deadline:
                p.result = p.error or Unavailable(f"put {p.path}: no worker took it")
        retry = [p for p in retry if p.result is None]
        done = [(p, p.written) for p in to_write if p.written is not None and self._worker_agrees(p, p.written)]
        if done:
            creqs = [pb.CommitRequest(path=p.path, block_id=p.bid, worker_id=p.loc.worker_id, size=p.mv.nbytes,
                                      crc32c=p.crc, if_absent=if_absent, order_hint=p.hint,
                                      local_path=w.local_path) for p, w in done]
            try:
                commits = self._many(f"master{shard}", lambda m, r: self._master(m, r, deadline, shard),
                                     "CommitMany",
                                     pb.CommitManyRequest(items=creqs, protocol_version=PROTOCOL_VERSION),
                                     "Commit", creqs)
            except L2fsError as e:
                commits = [e] * len(done)
            for (p, _), c in zip(done, commits, strict=True):
                p.result = c if isinstance(c, L2fsError) else c.published
        return retry


    @staticmethod
    def _worker_agrees(p: _Put, w: pb.WriteResult) -> bool:
        """Whether the worker's answer is the CRC32C of the bytes we sent; else the put fails (not committed).

        Why: the commit publishes and seals the CRC it carries, and it used to carry the worker's: a worker that
        altered the bytes and answered with their CRC had them published, sealed and served to every reader.
        Now the commit carries our CRC, so altered bytes can only ever fail a reader's check (a miss), and a
        worker whose answer disagrees fails the put here, before anything is published."""
        if w.crc32c == p.crc:
            return True
        p.result = L2fsError(f"put {p.path}: worker {p.loc.worker_id!r} answered CRC32C {w.crc32c:#010x} for bytes "
                             f"sent with CRC32C {p.crc:#010x}: not published (damaged in transit or by the worker)")
        return False

    def _many(self, peer: str, call: Callable[[str, Any], Any], many: str, many_request: Any, one: str,
              requests: list[Any]) -> list[Any]:
        """A batched call (one reply per item, an item's error as an exception in its slot), or one unary call
        per item against a peer older than protocol 2 (it answers UNIMPLEMENTED; remembered per peer)."""
        if peer not in self._unbatched:
            try:
                return [_item_error(r.error) if r.HasField("error") else r for r in call(many, many_request).items]
            except Unimplemented:
                self._unbatched.add(peer)
        out: list[Any] = []
        for r in requests:
            try:
                out.append(call(one, r))
            except L2fsError as e:
                out.append(e)
        return out


    def _write_many(self, puts: list[_Put], deadline: float) -> list[_Put]:
        """Write every allocated block (same-node workers in one reserve/adopt pair each, the rest one by one,
        in parallel); sets .written or .result; returns the items to retry."""
        local: dict[str, list[_Put]] = {}
        jobs: list[Callable[[], list[_Put]]] = []
        for p in puts:
            if p.mv.nbytes <= LOCAL_WRITE_MAX and self._writes_local(p.loc):
                local.setdefault(p.loc.address, []).append(p)
            else:
                jobs.append(functools.partial(self._write_one, p, deadline))
        jobs += [functools.partial(self._write_local, group, deadline) for group in local.values()]
        if len(jobs) == 1:
            return jobs[0]()
        futs = [self._executor().submit(job) for job in jobs]
        return [p for f in futs for p in f.result()]


    def _writes_local(self, loc: pb.Location) -> bool:
        if not (self.short_circuit and self.local_writes and self.node_id and loc.node_id == self.node_id):
            return False
        with self._lock:
            return self._no_local.get(loc.address, 0.0) < time.monotonic()


    def _unreachable(self, p: _Put, e: L2fsError, deadline: float) -> list[_Put]:
        """The worker died and the master does not know yet: try another one, once."""
        if p.exclude or time.monotonic() >= deadline:
            p.result = e
            return []
        p.exclude.append(p.loc.worker_id)
        p.error = e
        return [p]


    def _write_one(self, p: _Put, deadline: float) -> list[_Put]:
        try:
            p.written = self._write_block(p.loc, p.bid, p.path, p.mv, p.hint, deadline)
        except Unavailable as e:
            return self._unreachable(p, e, deadline)
        except L2fsError as e:
            p.result = e
        return []


    def _write_block(self, loc: pb.Location, bid: str, path: str, mv: memoryview, hint: int,
                     deadline: float) -> pb.WriteResult:
        """One write, tried again within the deadline while the worker has just (re)started and has not had
        its master's answer yet (capability.NOT_READY: it refuses everything until it knows its mode)."""
        delay = 0.02
        while True:
            try:
                return self._write_block_once(loc, bid, path, mv, hint, deadline)
            except L2fsError as e:
                if NOT_READY not in str(e) or time.monotonic() + delay >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


    def _write_block_once(self, loc: pb.Location, bid: str, path: str, mv: memoryview, hint: int,
                          deadline: float) -> pb.WriteResult:
        """TCP data plane, else gRPC stream (same-node short-circuit writes go through _write_local)."""
        try:
            if self.data_plane and loc.data_address:
                crc, local_path = self._data.write(loc.data_address, bid, path, mv, hint, deadline, loc.capability)
                return pb.WriteResult(block_id=bid, size=mv.nbytes, crc32c=crc, local_path=local_path)
            frames = self._frames(bid, path, mv, hint, loc.capability)
            return self._worker(loc.address).WriteBlock(frames, metadata=self._md,
                                                        timeout=max(0.001, deadline - time.monotonic()))
        except grpc.RpcError as e:
            raise _error(e) from None
        except DataPlaneError as e:
            raise InvalidArgument(str(e)) if e.status == BAD else L2fsError(str(e)) from None
        except BlockingIOError:  # the socket's kernel timeout (SO_SNDTIMEO/SO_RCVTIMEO): the deadline passed
            raise Unavailable(f"worker {loc.address}: the write's deadline passed (client timeout "
                              f"{self.timeout:g} s plus the bytes at 200 MB/s)") from None
        except OSError as e:
            raise Unavailable(f"worker {loc.address}: {e}") from None


    def _write_local(self, group: list[_Put], deadline: float) -> list[_Put]:
        """Short-circuit writes to one same-node worker: it reserves space for the whole group, we write its
        temp files, it adopts them (two RPCs per group). If a temp file cannot be opened from here (a pod
        without the worker's hostPath, another uid), the reservations are released at once and those items
        go again over the data plane with fresh block ids (this worker is not tried locally for a minute)."""
        address = group[0].loc.address
        stub = self._worker(address)

        def call(method: str, request: Any) -> Any:
            try:
                return getattr(stub, method)(request, metadata=self._md,
                                             timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as e:
                raise _error(e) from None

        rreqs = [pb.ReserveRequest(block_id=p.bid, size=p.mv.nbytes, capability=p.loc.capability, path=p.path)
                 for p in group]
        try:
            reserved = self._many(address, call, "ReserveLocalMany", pb.ReserveManyRequest(items=rreqs),
                                  "ReserveLocal", rreqs)
        except Unavailable as e:
            return [q for p in group for q in self._unreachable(p, e, deadline)]
        except L2fsError as e:
            for p in group:
                p.result = e
            return []
        wrote: list[_Put] = []
        unusable: list[_Put] = []
        sock = self._fd_socket(group[0].loc)
        for p, r in zip(group, reserved, strict=True):
            if isinstance(r, L2fsError):
                p.result = r
            elif self._write_via_fd(sock, p, deadline) if sock else _write_file(r.tmp_path, p.mv):
                wrote.append(p)
            else:
                unusable.append(p)
        if unusable:
            log.info("worker %s: its temp files are not writable from here; writing over the network", address)
            with self._lock:
                self._no_local[address] = time.monotonic() + 60.0
            try:
                call("ReleaseLocal", pb.BlockIds(block_ids=[p.bid for p in unusable],
                                                 capabilities=[p.loc.capability for p in unusable],
                                                 paths=[p.path for p in unusable]))
            except L2fsError:
                pass  # an older worker (or a gone one): the reservations expire on their own
        if wrote:
            areqs = [pb.AdoptRequest(block_id=p.bid, path=p.path, size=p.mv.nbytes,
                                     crc32c=p.crc if p.crc is not None else crc32c_fast(p.mv),
                                     order_hint=p.hint, capability=p.loc.capability) for p in wrote]
            try:
                adopted = self._many(address, call, "AdoptLocalMany", pb.AdoptManyRequest(items=areqs),
                                     "AdoptLocal", areqs)
            except Unavailable as e:  # the worker went away after the reservation: another one, once
                return unusable + [q for p in wrote for q in self._unreachable(p, e, deadline)]
            except L2fsError as e:
                adopted = [e] * len(wrote)
            for p, a in zip(wrote, adopted, strict=True):
                if isinstance(a, L2fsError):
                    p.result = a
                else:
                    p.written = a
        return unusable


    def _write_via_fd(self, sock: str, p: _Put, deadline: float) -> bool:
        """Write a reserved block through the temp file fd the worker creates and passes us; False when it
        cannot (refused, worker gone): the caller releases the reservation and uses the network."""
        try:
            fd, _, _ = request_fd(sock, FD_WRITE, p.loc.capability or self.token, p.bid, p.path,
                                  timeout=max(0.001, deadline - time.monotonic()))
        except (OSError, FdPassError) as e:
            log.debug("fd write of %s via %s refused: %s", p.path, sock, e)
            return False
        return _write_fd(fd, p.mv)


    @staticmethod
    def _frames(bid: str, path: str, mv: memoryview, hint: int, cap: str = "") -> Any:
        yield pb.WriteChunk(block_id=bid, path=path, size=mv.nbytes, order_hint=hint, data=bytes(mv[:FRAME]),
                            capability=cap)
        for off in range(FRAME, mv.nbytes, FRAME):
            yield pb.WriteChunk(data=bytes(mv[off:off + FRAME]))
