"""The read path: same-node fd or file, data plane or gRPC stream, CRC-verified, fail-as-miss."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

import crc32c
import grpc

from l2fs.client.core import _check, log
from l2fs.client.locate import LocateOps, _CapDenied
from l2fs.common import (
    CrcPipeline,
    Scatter,
    crc32c_fast,
    crc_pieces,
)
from l2fs.common.fdpass import DENIED as FD_DENIED
from l2fs.common.fdpass import NOT_FOUND as FD_NOT_FOUND
from l2fs.common.fdpass import READ as FD_READ
from l2fs.common.fdpass import FdPassError, request_fd
from l2fs.dataplane import DataPlaneError
from l2fs.dataplane.wire import DENIED
from l2fs.proto import l2fs_pb2 as pb


def _chain(first: Any, rest: Any) -> Any:
    yield first
    yield from rest


class ReadOps(LocateOps):
    """get, get_into and get_many."""


    def _read(self, path: str, into: Scatter | None, deadline: float | None = None) -> bytes | int | None:
        """Shared get/get_into: short-circuit or gRPC stream; any fault is a miss (None).
        `deadline` (monotonic) is set by AsyncClient when the call was made, so a call that waited for a
        pool thread past it misses at once and never writes into `into` after the caller gave up."""
        path = _check(path)
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        elif time.monotonic() >= deadline:
            return None
        for _ in range(2):
            st = self._locate(path, deadline)
            if st is None:
                return None
            try:
                return self._read_located(path, st, into, deadline)
            except _CapDenied as e:
                # the worker refused the location's capability (expired: a location kept past its TTL; or the
                # worker's key changed): locate once more for a fresh one; refused again is a miss
                log.debug("read %s: capability refused (%s)", path, e)
                self._forget(path)
        return None


    def _read_located(self, path: str, st: pb.FileStat, into: Scatter | None, deadline: float
                      ) -> bytes | int | None:
        """Read a located file: fd passing, path short-circuit, data plane or gRPC; None for a miss,
        _CapDenied when the worker refused the capability."""
        loc = st.locations[0]
        if into is not None and into.nbytes < st.size:
            raise ValueError(f"buffer of {into.nbytes} bytes is smaller than {path} ({st.size} bytes)")
        stub = self._worker(loc.address)
        sock = self._fd_socket(loc)
        if sock:
            asked, got = self._read_fd(sock, loc, st, into, deadline)
            if asked:
                return got
        if self._is_local(loc):
            got = self._read_local(loc, st, into)
            if got is not None:
                return got
            if got is None and os.path.exists(loc.local_path):
                return None  # local file present but bad: reported; do not stream a corrupt block
        if self.data_plane and loc.data_address:
            return self._read_tcp(loc, st, into, deadline)
        try:
            stream = stub.ReadBlock(pb.ReadRequest(block_id=loc.block_id, capability=loc.capability), metadata=self._md,
                                    timeout=max(0.001, deadline - time.monotonic()))
            first = next(stream)
            size, crc = first.size, first.crc32c
            if size != st.size:
                stream.cancel()
                return None
            if into is not None:
                off = 0
                c = 0
                for m in _chain(first, stream):
                    n = len(m.data)
                    if off + n > size:
                        return None
                    piece, at = memoryview(m.data), 0
                    for v in into.views(off, off + n):
                        v[:] = piece[at:at + v.nbytes]
                        at += v.nbytes
                    c = crc32c.crc32c(m.data, value=c)
                    off += n
                return off if off == size and c == crc else None
            parts = [m.data for m in _chain(first, stream)]
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            if len(data) != size or crc32c.crc32c(data) != crc:
                return None
            return data
        except (grpc.RpcError, StopIteration) as e:
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.PERMISSION_DENIED and loc.capability:
                raise _CapDenied(e.details() or "") from None
            if isinstance(e, grpc.RpcError) and e.code() not in (grpc.StatusCode.NOT_FOUND,):
                log.debug("read %s from %s failed: %s", path, loc.address, e.code())
            return None


    def _read_tcp(self, loc: pb.Location, st: pb.FileStat, into: Scatter | None, deadline: float
                  ) -> bytes | int | None:
        try:
            got, crc, computed = self._data.read(loc.data_address, loc.block_id, deadline, into, loc.capability)
        except (OSError, DataPlaneError, ValueError) as e:
            if isinstance(e, DataPlaneError) and e.status == DENIED and loc.capability:
                raise _CapDenied(str(e)) from None
            log.debug("data-plane read of %s from %s failed: %s", st.path, loc.data_address, e)
            return None
        n = got if isinstance(got, int) else len(got)
        if computed is None:
            assert not isinstance(got, int)  # the client computes the checksum only when it got the bytes
            computed = crc32c_fast(got)
        if n != st.size or crc != st.crc32c or computed != crc:
            self._report_corrupt(loc)
            return None
        return got


    def _report_corrupt(self, loc: pb.Location) -> None:
        """Ask the worker to re-verify (and drop) a block that failed our checksum."""
        self._fire(self._worker(loc.address).ReportCorrupt,
                   pb.BlockIds(block_ids=[loc.block_id], capabilities=[loc.capability]))


    def _touch(self, loc: pb.Location) -> None:
        """Queue a short-circuit read for the worker's LRU; a background thread sends them in batches
        (a gRPC future per read costs a thread start, more than the read's checksum)."""
        with self._lock:
            self._touches.setdefault(loc.address, {})[loc.block_id] = loc.capability
            if self._toucher is None:
                self._toucher = threading.Thread(target=self._touch_loop, name="l2fs-touch", daemon=True)
                self._toucher.start()


    def _touch_loop(self) -> None:
        while not self._closed:
            time.sleep(0.2)
            with self._lock:
                batch, self._touches = self._touches, {}
            for address, caps in batch.items():
                ids = sorted(caps)
                try:
                    self._worker(address).Touch(pb.BlockIds(block_ids=ids, capabilities=[caps[i] for i in ids]),
                                                metadata=self._md, timeout=1.0)
                except (grpc.RpcError, ValueError):  # worker gone or channel closed: LRU hint only
                    pass


    def _fire(self, method: Any, request: Any) -> None:
        """Fire-and-forget RPC. The future is kept until done: gRPC cancels a call whose future is
        garbage collected."""
        try:
            fut = method.future(request, metadata=self._md, timeout=2)
        except Exception:  # noqa: BLE001 - best effort
            return
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._inflight_done)


    def _inflight_done(self, fut: Any) -> None:
        with self._lock:
            self._inflight.discard(fut)


    def _read_fd(self, sock: str, loc: pb.Location, st: pb.FileStat, into: Scatter | None, deadline: float
                 ) -> tuple[bool, bytes | int | None]:
        """(asked, result): read through the block fd the worker passes; asked False when the socket could
        not be used (the caller goes on to the path or the network)."""
        try:
            fd, size, crc = request_fd(sock, FD_READ, loc.capability or self.token, loc.block_id,
                                       timeout=max(0.001, deadline - time.monotonic()))
        except FdPassError as e:
            if e.status == FD_DENIED and loc.capability:
                raise _CapDenied(str(e)) from None
            return e.status == FD_NOT_FOUND, None  # a block the worker lost is a miss everywhere
        except OSError:
            return False, None
        if size != st.size or crc != st.crc32c:  # not the version the master named
            os.close(fd)
            return True, None
        return True, self._read_open(fd, loc, st, into)


    def _read_local(self, loc: pb.Location, st: pb.FileStat, into: Scatter | None) -> bytes | int | None:
        try:
            # O_NOFOLLOW: a link planted at a block's name is not read through (O_NONBLOCK: nor a FIFO hung on)
            fd = os.open(loc.local_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        got = self._read_open(fd, loc, st, into)
        if got is not None:
            self._touch(loc)  # LRU: this was a read (an fd read is counted by the worker itself)
        return got


    def _read_open(self, fd: int, loc: pb.Location, st: pb.FileStat, into: Scatter | None
                   ) -> bytes | int | None:
        """Read and verify an open block file (closed here); a bad one is reported to its worker."""
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                result: bytes | int | None = None
                fst = os.fstat(f.fileno())
                if not stat.S_ISREG(fst.st_mode) or fst.st_size != st.size:
                    ok = False  # not a plain file, or truncated or extended behind the worker's back
                elif into is not None:
                    ok, result = self._readinto_verified(f, into, st), st.size
                else:
                    data = f.read(st.size + 1)
                    ok = len(data) == st.size and crc32c_fast(data) == st.crc32c
                    result = data
        except OSError:
            return None
        if ok:
            return result
        self._report_corrupt(loc)  # let the worker re-verify and drop it
        return None


    @staticmethod
    def _readinto_verified(f: Any, into: Scatter, st: pb.FileStat) -> bool:
        """Read piece by piece, checksumming each piece while the next one is read."""
        pieces = crc_pieces(st.size)
        pipe = CrcPipeline(len(pieces))
        for start, end in pieces:
            views = into.views(start, end)
            for view in views:
                got = 0
                while got < view.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        return False
                    got += n
            pipe.add(views)
        return pipe.result() == st.crc32c


    def get(self, path: str, *, _deadline: float | None = None) -> bytes | None:
        """Whole file or None (miss)."""
        r = self._read(path, None, _deadline)
        if not isinstance(r, bytes):
            self._forget(path)
            return None
        return r


    def get_into(self, path: str, buf: Any, *, _deadline: float | None = None) -> int | None:
        """Read the file into buf (must be large enough); returns bytes read or None (miss). buf may be a list
        of buffers: the file's bytes fill them in order (a scatter read: a header and a body in two places)."""
        dest = Scatter(list(buf) if isinstance(buf, list | tuple) else [buf])
        r = self._read(path, dest, _deadline)
        if not isinstance(r, int):
            self._forget(path)
            return None
        return r


    def get_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """Parallel fetches; one None per miss. Located in one master round trip (locate_many)."""
        for p in paths:
            _check(p)
        if len(paths) > 1:
            self.locate_many(paths)
        return list(self._executor().map(self.get, paths))
