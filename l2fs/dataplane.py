"""Raw-TCP data plane beside gRPC: bulk block reads (sendfile) and writes (recv_into) on loopback/LAN.

Why: Python gRPC streaming measured ~0.1x of a raw loopback TCP stream for 14.7 MB objects (see
docs/l2fs.md), far below the 1.84 GB/s cross-node target. Control stays on gRPC; only bytes move here.

Wire format (little-endian), several requests per connection:
  request   b"L2D1" op:1 token_len:u16 token block_id:32
  op R  ->  status:u8 then (status 0) size:u64 crc32c:u32 + size bytes via sendfile, or msg_len:u16 msg
  op W      + path_len:u16 path size:u64 order_hint:i64
        ->  status:u8 (0 = send the data; else msg_len:u16 msg)  then the client sends size bytes
        ->  status:u8 then (0) crc32c:u32 path_len:u16 local_path, or msg_len:u16 msg
The checksum is verified end to end by the reader (a mismatch is a miss and is reported to the worker,
which re-verifies and drops the block). TLS clusters do not start this plane; clients then use gRPC.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import crc32c
from prometheus_client import Counter

if TYPE_CHECKING:
    from l2fs.worker import Store

log = logging.getLogger("l2fs.dataplane")
REFUSED = Counter("l2fs_worker_data_refused_total", "Data-plane connections refused over the connection limit")

MAGIC = b"L2D1"
OK, NOT_FOUND, DENIED, BAD, BUSY = 0, 1, 2, 3, 4
_HDR = struct.Struct("<4scH")
_READ_OK = struct.Struct("<QI")
_WRITE_HDR = struct.Struct("<Qq")
BUF = 4 << 20
DATA_MAX_CONNS = 256  # concurrent connections a worker serves (one thread each)
DATA_IDLE_TIMEOUT = 30.0  # seconds an idle connection is kept open
BUSY_MSG = "worker data plane busy: too many connections (limit {}); use gRPC or retry"


class DataPlaneError(Exception):
    """Server answered with an error status (message kept)."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


class DataPlaneBusy(ConnectionError):
    """Worker refused for load (connection limit, too many pending writes): an OSError, so callers treat
    it like an unreachable worker (reads miss, writes try another worker) rather than as bad input."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = sock.recv(n - got)
        if not b:
            raise ConnectionError("peer closed the connection")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _send_err(sock: socket.socket, status: int, msg: str) -> None:
    m = msg.encode()[:1000]
    sock.sendall(struct.pack("<BH", status, len(m)) + m)


def _alive(s: socket.socket) -> bool:
    """A pooled socket is reusable when the peer has not closed it and sent nothing unasked."""
    try:
        s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": closed; bytes: out of step
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- server


class DataServer:
    """Accept loop + one thread per connection; each serves requests until the client closes or idles.

    Why bounded: a thread per connection is cheap until a flood; past `max_conns` a connection gets an
    error answer at once and is closed (the client falls back to gRPC or misses), and idle ones close
    after `idle_timeout` (clients check pooled sockets before reuse)."""

    def __init__(self, store: Store, host: str, port: int, token: str | None, on_change: Callable[[], None], *,
                 max_conns: int = DATA_MAX_CONNS, idle_timeout: float = DATA_IDLE_TIMEOUT) -> None:
        self.store = store
        self.max_conns = max_conns
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_conns)
        self.token = (token or "").encode()
        self._on_change = on_change
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.port = self.sock.getsockname()[1]
        self._stop = False

    def start(self) -> None:
        threading.Thread(target=self._accept, name="l2fs-data-accept", daemon=True).start()

    def stop(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn)
                continue
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn,), name="l2fs-data-conn", daemon=True).start()
            except BaseException:
                self._slots.release()
                conn.close()
                raise

    def _refuse(self, conn: socket.socket) -> None:
        """Over the connection limit: answer the first request with BUSY, without a thread."""
        REFUSED.inc()
        try:
            conn.setblocking(False)
            _send_err(conn, BUSY, BUSY_MSG.format(self.max_conns))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_conn(conn)
        finally:
            self._slots.release()

    def _serve_conn(self, conn: socket.socket) -> None:
        from l2fs.common import PathError, RpcError, norm_path
        from l2fs.worker import _check_block_id

        conn.settimeout(self.idle_timeout)  # idle connections close, freeing their slot
        with conn:
            while True:
                try:
                    head = conn.recv(_HDR.size, socket.MSG_WAITALL)
                    if not head:
                        return
                    if len(head) < _HDR.size:
                        head += _recv_exact(conn, _HDR.size - len(head))
                    magic, op, tlen = _HDR.unpack(head)
                    if magic != MAGIC:
                        _send_err(conn, BAD, "bad magic: not an l2fs data-plane client")
                        return
                    token = _recv_exact(conn, tlen) if tlen else b""
                    bid = _recv_exact(conn, 32).decode("ascii", "replace")
                    if self.token and not hmac.compare_digest(token, self.token):
                        _send_err(conn, DENIED, "missing or bad l2fs bearer token")
                        return
                    try:
                        _check_block_id(bid)
                    except RpcError as e:
                        _send_err(conn, BAD, str(e))
                        return
                    if op == b"R":
                        self._read(conn, bid)
                    elif op == b"W":
                        (plen,) = struct.unpack("<H", _recv_exact(conn, 2))
                        raw_path = _recv_exact(conn, plen).decode("utf-8", "replace")
                        size, hint = _WRITE_HDR.unpack(_recv_exact(conn, _WRITE_HDR.size))
                        try:
                            path = norm_path(raw_path)
                        except PathError as e:
                            _send_err(conn, BAD, str(e))
                            return
                        if not self._write(conn, bid, path, size, hint):
                            return
                    else:
                        _send_err(conn, BAD, f"unknown op {op!r}")
                        return
                except (OSError, ConnectionError, struct.error, UnicodeDecodeError) as e:
                    log.debug("data connection ended: %s", e)
                    return

    def _read(self, conn: socket.socket, bid: str) -> None:
        from l2fs.worker import BYTES_READ, READ_HITS, READ_MISSES

        while True:
            found = self.store.file_of(bid)
            if found is None:
                READ_MISSES.inc()
                _send_err(conn, NOT_FOUND, f"block {bid} not found")
                return
            b, path = found
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed below
                on_disk = os.fstat(f.fileno()).st_size
            except OSError:
                f, on_disk = None, -1
            if on_disk == b.size:
                break
            if f is not None:
                f.close()
            if self.store.drop_damaged(bid, path):  # deleted, truncated or extended behind our back
                READ_MISSES.inc()
                self._on_change()
                _send_err(conn, NOT_FOUND, f"block {bid} damaged on disk (dropped)")
                return
            # it moved to another tier meanwhile: look again
        with f:
            conn.sendall(bytes([OK]) + _READ_OK.pack(b.size, b.crc32c))
            sent = conn.sendfile(f, 0, b.size) if b.size else 0
        if sent != b.size:  # truncated while sending: drop the connection so the reader sees a miss
            raise ConnectionError(f"block {bid}: sent {sent} of {b.size} bytes")
        self.store.touch(bid)
        READ_HITS.inc()
        BYTES_READ.inc(b.size)

    def _write(self, conn: socket.socket, bid: str, path: str, size: int, hint: int) -> bool:
        import grpc

        from l2fs.common import RpcError

        try:
            i = self.store.reserve(bid, size)
        except RpcError as e:
            _send_err(conn, BUSY if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else BAD, str(e))
            return False
        finally:
            self._on_change()
        tmp = self.store.dirs[i].tmp_file(bid)
        ok = False
        try:
            conn.sendall(bytes([OK]))
            buf = bytearray(min(BUF, max(size, 1)))
            mv = memoryview(buf)
            crc, left = 0, size
            with open(tmp, "wb", buffering=0) as f:
                while left:
                    n = conn.recv_into(mv[:min(left, len(buf))])
                    if not n:
                        raise ConnectionError("client closed mid-write")
                    f.write(mv[:n])
                    crc = crc32c.crc32c(mv[:n], value=crc)
                    left -= n
            b = self.store.seal(bid, path, size, crc, hint, tmp)
            ok = True
        finally:
            if not ok:
                self.store.release(bid)
            self._on_change()  # sealing may have evicted: tell the master now
        lp = self.store.local_path(b).encode()
        conn.sendall(bytes([OK]) + struct.pack("<IH", crc, len(lp)) + lp)
        return True


# ---------------------------------------------------------------- client


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

    def _header(self, op: bytes, bid: str) -> bytes:
        return _HDR.pack(MAGIC, op, len(self.token)) + self.token + bid.encode("ascii")

    @staticmethod
    def _error(s: socket.socket, status: int) -> DataPlaneError | DataPlaneBusy:
        (n,) = struct.unpack("<H", _recv_exact(s, 2))
        msg = _recv_exact(s, n).decode(errors="replace")
        return DataPlaneBusy(msg) if status == BUSY else DataPlaneError(status, msg)

    def read(self, address: str, bid: str, deadline: float, into: memoryview | None = None
             ) -> tuple[bytes | int, int, int | None]:
        """(data or byte count, crc32c the worker recorded, crc32c of what arrived when `into` was given:
        computed piece by piece while the next piece is received). Raises on any fault (callers: miss)."""
        from l2fs.common import CrcPipeline, crc_pieces

        s = self._get(address, deadline)
        computed: int | None = None
        try:
            self._arm(s, deadline)
            s.sendall(self._header(b"R", bid))
            status = _recv_exact(s, 1)[0]
            if status != OK:
                err = self._error(s, status)
                s.close()
                raise err
            size, crc = _READ_OK.unpack(_recv_exact(s, _READ_OK.size))
            if into is not None:
                if into.nbytes < size:
                    raise ValueError(f"buffer of {into.nbytes} bytes < block of {size}")
                pieces = crc_pieces(size)
                pipe = CrcPipeline(len(pieces))
                for start, end in pieces:
                    self._fill(s, into[start:end], deadline)
                    pipe.add(into[start:end])
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

    def write(self, address: str, bid: str, path: str, mv: memoryview, hint: int, deadline: float
              ) -> tuple[int, str]:
        """Stream a block to the worker; returns (crc32c, local_path). Raises on any fault."""
        s = self._get(address, deadline)
        try:
            self._arm(s, deadline)
            p = path.encode()
            s.sendall(self._header(b"W", bid) + struct.pack("<H", len(p)) + p
                      + _WRITE_HDR.pack(mv.nbytes, hint))
            status = _recv_exact(s, 1)[0]
            if status != OK:
                err = self._error(s, status)
                s.close()
                raise err
            if mv.nbytes:
                s.sendall(mv)
            status = _recv_exact(s, 1)[0]
            if status != OK:
                err = self._error(s, status)
                s.close()
                raise err
            crc, n = struct.unpack("<IH", _recv_exact(s, 6))
            local_path = _recv_exact(s, n).decode()
        except BaseException:
            s.close()
            raise
        self._put_back(address, s)
        return crc, local_path


def enabled_by_default() -> bool:
    """$L2FS_DATA_PLANE=grpc forces gRPC streaming (for comparisons)."""
    return os.environ.get("L2FS_DATA_PLANE", "tcp") != "grpc"
