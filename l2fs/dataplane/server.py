"""Data-plane server: the worker's raw-TCP listener for bulk block reads (sendfile) and writes (recv_into).

Reads open blocks with `Store.open_block` and writes go through `Store.receive`, the same paths as gRPC;
this module only speaks the wire format (l2fs.dataplane.wire).
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import Counter

from l2fs.common import PathError, RpcError, check_block_id, norm_path
from l2fs.dataplane.wire import (
    BAD,
    BUF,
    BUSY,
    BUSY_MSG,
    DATA_IDLE_TIMEOUT,
    DATA_MAX_CONNS,
    DENIED,
    HDR,
    MAGIC,
    NOT_FOUND,
    OK,
    READ_OK,
    WRITE_HDR,
    recv_exact,
    send_err,
)
from l2fs.store import BYTES_READ, READ_HITS, READ_MISSES, Store

log = logging.getLogger("l2fs.dataplane")
REFUSED = Counter("l2fs_worker_data_refused_total", "Data-plane connections refused over the connection limit")

_STATUS = {grpc.StatusCode.RESOURCE_EXHAUSTED: BUSY}  # anything else the store refuses is BAD


class DataServer:
    """Accept loop + one thread per connection; each serves requests until the client closes or idles.

    Why bounded: a thread per connection is cheap until a flood; past `max_conns` a connection gets an
    error answer at once and is closed (the client falls back to gRPC or misses), and idle ones close
    after `idle_timeout` (clients check pooled sockets before reuse)."""

    def __init__(self, store: Store, host: str, port: int, token: str | None, report_now: Callable[[], None], *,
                 max_conns: int = DATA_MAX_CONNS, idle_timeout: float = DATA_IDLE_TIMEOUT) -> None:
        self.store = store
        self.max_conns = max_conns
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_conns)
        self.token = (token or "").encode()
        self._report_now = report_now  # wakes the registration loop: removals/moves reach the master now
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
            send_err(conn, BUSY, BUSY_MSG.format(self.max_conns))
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
        conn.settimeout(self.idle_timeout)  # idle connections close, freeing their slot
        with conn:
            while True:
                try:
                    if not self._serve_one(conn):
                        return
                except (OSError, ConnectionError, struct.error, UnicodeDecodeError) as e:
                    log.debug("data connection ended: %s", e)
                    return

    def _serve_one(self, conn: socket.socket) -> bool:
        """One request; False when the connection is to be closed (client done, or an error answered)."""
        head = conn.recv(HDR.size, socket.MSG_WAITALL)
        if not head:
            return False
        if len(head) < HDR.size:
            head += recv_exact(conn, HDR.size - len(head))
        magic, op, tlen = HDR.unpack(head)
        if magic != MAGIC:
            send_err(conn, BAD, "bad magic: not an l2fs data-plane client")
            return False
        token = recv_exact(conn, tlen) if tlen else b""
        bid = recv_exact(conn, 32).decode("ascii", "replace")
        if self.token and not hmac.compare_digest(token, self.token):
            send_err(conn, DENIED, "missing or bad l2fs bearer token")
            return False
        try:
            check_block_id(bid)
        except RpcError as e:
            send_err(conn, BAD, str(e))
            return False
        if op == b"R":
            self._read(conn, bid)
            return True
        if op == b"W":
            (plen,) = struct.unpack("<H", recv_exact(conn, 2))
            raw_path = recv_exact(conn, plen).decode("utf-8", "replace")
            size, hint = WRITE_HDR.unpack(recv_exact(conn, WRITE_HDR.size))
            try:
                path = norm_path(raw_path)
            except PathError as e:
                send_err(conn, BAD, str(e))
                return False
            return self._write(conn, bid, path, size, hint)
        send_err(conn, BAD, f"unknown op {op!r}")
        return False

    def _read(self, conn: socket.socket, bid: str) -> None:
        opened = self.store.open_block(bid)
        if opened is None:
            READ_MISSES.inc()
            self._report_now()  # it may have been dropped as damaged
            send_err(conn, NOT_FOUND, f"block {bid} not found (missing or damaged on disk)")
            return
        b, _, f = opened
        with f:
            conn.sendall(bytes([OK]) + READ_OK.pack(b.size, b.crc32c))
            sent = conn.sendfile(f, 0, b.size) if b.size else 0
        if sent != b.size:  # truncated while sending: drop the connection so the reader sees a miss
            raise ConnectionError(f"block {bid}: sent {sent} of {b.size} bytes")
        self.store.touch(bid)
        READ_HITS.inc()
        BYTES_READ.inc(b.size)

    def _write(self, conn: socket.socket, bid: str, path: str, size: int, hint: int) -> bool:
        try:
            b = self.store.receive(bid, path, size, hint, _incoming(conn, size))
        except RpcError as e:  # refused before the data (reserve) or after it (seal): both are answers
            send_err(conn, _STATUS.get(e.code, BAD), str(e))
            return False
        finally:
            self._report_now()  # reserving or sealing may have evicted: tell the master now
        lp = self.store.local_path(b).encode()
        conn.sendall(bytes([OK]) + struct.pack("<IH", b.crc32c, len(lp)) + lp)
        return True


def _incoming(conn: socket.socket, size: int) -> Iterator[memoryview]:
    """The bytes of a write as they arrive, in one reused buffer. Started only once `Store.receive` has
    reserved the space, so the go-ahead (OK) is sent here, first."""
    conn.sendall(bytes([OK]))
    buf = bytearray(min(BUF, max(size, 1)))
    mv = memoryview(buf)
    left = size
    while left:
        n = conn.recv_into(mv[:min(left, len(buf))])
        if not n:
            raise ConnectionError("client closed mid-write")
        yield mv[:n]
        left -= n
