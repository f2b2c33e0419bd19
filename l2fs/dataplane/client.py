"""Data-plane client: pooled raw-TCP connections per worker data address; every call bounded by a deadline."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import threading
import time

from l2fs.common import CrcPipeline, Scatter, crc_pieces
from l2fs.dataplane.wire import (
    BUSY,
    HDR,
    MAGIC,
    OK,
    READ_OK,
    WRITE_HDR,
    DataPlaneBusy,
    DataPlaneError,
    recv_exact,
)

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_BYTES = 1 << 20  # pipe buffer asked for by splice_in (the kernel may give less: pipe-max-size)


class SpliceUnsupported(OSError):
    """The file (or socket) cannot take part in splice(2) (EINVAL, EOPNOTSUPP, ENOSYS): not a fault of the peer;
    the caller reads another way."""


_NO_SPLICE = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS)


def splice_in(s: socket.socket, fd: int, size: int, deadline: float) -> None:
    """Move `size` bytes from the (blocking, SO_RCVTIMEO-armed) socket into fd at offsets 0..size through a pipe,
    in the kernel. A stalled peer ends in the socket's timeout (OSError), a closed one in ConnectionError, a file
    system without splice support in SpliceUnsupported (the bytes left on the socket: the caller closes it)."""
    try:
        _splice_in(s, fd, size, deadline)
    except OSError as e:
        if e.errno in _NO_SPLICE:
            raise SpliceUnsupported(e.errno, f"splice into this file is not supported: {e.strerror}") from None
        raise


def _splice_in(s: socket.socket, fd: int, size: int, deadline: float) -> None:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB pipe works, in more calls
        off = 0
        while off < size:
            if time.monotonic() > deadline:
                raise TimeoutError("data-plane read deadline")
            k = os.splice(s.fileno(), w, min(PIPE_BYTES, size - off))
            if not k:
                raise ConnectionError("worker closed mid-read")
            while k:
                n = os.splice(r, fd, k, offset_dst=off)
                off += n
                k -= n
    finally:
        os.close(r)
        os.close(w)


def _alive(s: socket.socket) -> bool:
    """A pooled socket is reusable when the peer has not closed it and sent nothing unasked."""
    try:
        s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": closed; bytes: out of step
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


class DataClient:
    """Pooled connections per worker data address; every call bounded by a deadline."""

    def __init__(self, token: str | None) -> None:
        self.token = (token or "").encode()
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            socks = [s for lst in self._idle.values() for s in lst]
            self._idle.clear()
        for s in socks:
            s.close()

    def _get(self, address: str, deadline: float) -> socket.socket:
        while True:
            with self._lock:
                lst = self._idle.get(address)
                s = lst.pop() if lst else None
            if s is None:
                break
            if _alive(s):
                return s
            s.close()  # the worker closed it (idle timeout, restart): not worth a miss
        host, _, port = address.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=max(0.001, deadline - time.monotonic()))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def _put_back(self, address: str, s: socket.socket) -> None:
        with self._lock:
            lst = self._idle.setdefault(address, [])
            if len(lst) < 8:
                lst.append(s)
                return
        s.close()

    @staticmethod
    def _arm(s: socket.socket, deadline: float) -> None:
        """Blocking socket with kernel timeouts, so recv(MSG_WAITALL) fills whole buffers."""
        left = max(0.001, deadline - time.monotonic())
        s.settimeout(None)
        tv = struct.pack("ll", int(left), int((left % 1) * 1e6))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def _header(self, op: bytes, bid: str, cap: str) -> bytes:
        """A request header carrying the block's capability (from the master's Location) when there is one,
        else this client's token (a worker in token mode)."""
        cred = cap.encode("ascii") if cap else self.token
        return HDR.pack(MAGIC, op, len(cred)) + cred + bid.encode("ascii")

    @staticmethod
    def _error(s: socket.socket, status: int) -> DataPlaneError | DataPlaneBusy:
        (n,) = struct.unpack("<H", recv_exact(s, 2))
        msg = recv_exact(s, n).decode(errors="replace")
        return DataPlaneBusy(msg) if status == BUSY else DataPlaneError(status, msg)

    def _ask_read(self, s: socket.socket, bid: str, deadline: float, cap: str) -> tuple[int, int]:
        """Send a read request on s and take the answer's head: (size, crc32c the worker recorded); the bytes
        follow on s. A refusal raises its typed error (the socket is closed)."""
        self._arm(s, deadline)
        s.sendall(self._header(b"R", bid, cap))
        status = recv_exact(s, 1)[0]
        if status != OK:
            err = self._error(s, status)
            s.close()
            raise err
        size, crc = READ_OK.unpack(recv_exact(s, READ_OK.size))
        return size, crc

    def read(self, address: str, bid: str, deadline: float, into: memoryview | Scatter | None = None,
             cap: str = "") -> tuple[bytes | int, int, int | None]:
        """(data or byte count, crc32c the worker recorded, crc32c of what arrived when `into` was given:
        computed piece by piece while the next piece is received). Raises on any fault (callers: miss)."""
        s = self._get(address, deadline)
        computed: int | None = None
        try:
            size, crc = self._ask_read(s, bid, deadline, cap)
            if into is not None:
                dest = into if isinstance(into, Scatter) else Scatter([into])
                if dest.nbytes < size:
                    raise ValueError(f"buffer of {dest.nbytes} bytes < block of {size}")
                pieces = crc_pieces(size)
                pipe = CrcPipeline(len(pieces))
                for start, end in pieces:
                    views = dest.views(start, end)
                    for v in views:
                        self._fill(s, v, deadline)
                    pipe.add(views)
                computed = pipe.result()
                result: bytes | int = size
            else:
                data = s.recv(size, socket.MSG_WAITALL) if size else b""
                if len(data) < size:
                    if not data:
                        raise ConnectionError("worker closed mid-read")
                    rest = bytearray(size - len(data))
                    self._fill(s, memoryview(rest), deadline)
                    data += rest
                result = data
        except BaseException:
            s.close()
            raise
        self._put_back(address, s)
        return result, crc, computed

    def read_to_file(self, address: str, bid: str, deadline: float, fd: int, cap: str = "") -> tuple[int, int]:
        """Read a block straight into the file `fd` (bytes 0..size, by splice: socket -> pipe -> file inside the
        kernel, never through user space): (size, crc32c the worker recorded). The caller checks the CRC over the
        file. Raises on any fault (callers: miss).

        Why: the passthrough mount's cross-node copies are files; received into a buffer and then written, a
        32 MiB block crossed user space twice (0.17x of the native read, 2026-12-04)."""
        s = self._get(address, deadline)
        try:
            size, crc = self._ask_read(s, bid, deadline, cap)
            splice_in(s, fd, size, deadline)
        except BaseException:
            s.close()
            raise
        self._put_back(address, s)
        return size, crc

    @staticmethod
    def _fill(s: socket.socket, mv: memoryview, deadline: float) -> None:
        got = 0
        while got < mv.nbytes:
            if time.monotonic() > deadline:
                raise TimeoutError("data-plane read deadline")
            n = s.recv_into(mv[got:], mv.nbytes - got, socket.MSG_WAITALL)
            if not n:
                raise ConnectionError("worker closed mid-read")
            got += n

    def write(self, address: str, bid: str, path: str, mv: memoryview, hint: int, deadline: float, cap: str = ""
              ) -> tuple[int, str]:
        """Stream a block to the worker; returns (crc32c, local_path). Raises on any fault."""
        s = self._get(address, deadline)
        try:
            self._arm(s, deadline)
            p = path.encode()
            s.sendall(self._header(b"W", bid, cap) + struct.pack("<H", len(p)) + p
                      + WRITE_HDR.pack(mv.nbytes, hint))
            status = recv_exact(s, 1)[0]
            if status != OK:
                err = self._error(s, status)
                s.close()
                raise err
            if mv.nbytes:
                s.sendall(mv)
            status = recv_exact(s, 1)[0]
            if status != OK:
                err = self._error(s, status)
                s.close()
                raise err
            crc, n = struct.unpack("<IH", recv_exact(s, 6))
            local_path = recv_exact(s, n).decode()
        except BaseException:
            s.close()
            raise
        self._put_back(address, s)
        return crc, local_path
