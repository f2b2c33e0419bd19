"""Short-circuit I/O through file descriptors passed over a Unix socket (HDFS short-circuit style).

Why: path-based short-circuit needs the worker's data dir in the client's pod, and a read-write mount lets
any pod overwrite any block or the manifest. Here the worker opens the files itself and hands the client
only an fd: a sealed block O_RDONLY for a read, a fresh temp file (O_CREAT|O_EXCL|O_NOFOLLOW, 0600) for a
write it reserved. A pod needs only the socket (a hostPath dir holding nothing else), never the data dir.

Wire (one request per connection, big-endian):

  request  b"L2FD" op:u8 token_len:u16 bid_len:u16 path_len:u16 token block_id path
  reply    status:u8 size:u64 crc32c:u32 msg_len:u16 msg, with one fd (SCM_RIGHTS) when status is OK

op READ (1): the block's fd, size and CRC32C (the client still verifies what it reads). op WRITE (2): the
reserved temp file's write fd (block id of a ReserveLocal reservation, path the put is for); the client
writes it and calls AdoptLocal, which re-checks the file and recomputes the CRC as before.
Auth as on the data plane: any known token reads; a write needs a writer token allowed to put-if-absent
`path` (an engine token only under its prefixes). Bounded: `max_conns` connections (more are answered
BUSY), one deadline over the whole request, and the worker closes its copy of the fd right after sending.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Counter

from l2fs.common import (
    READERS,
    WRITERS,
    Credential,
    Credentials,
    PathError,
    RpcError,
    check_block_id,
    norm_path,
)

if TYPE_CHECKING:
    from l2fs.store import Store

log = logging.getLogger("l2fs.fdpass")

MAGIC = b"L2FD"
READ, WRITE = 1, 2
OK, NOT_FOUND, DENIED, BAD, BUSY = 0, 1, 2, 3, 4
REQ = struct.Struct("!4sBHHH")
REPLY = struct.Struct("!BQIH")
MAX_TOKEN, MAX_FIELD = 4096, 4096
FD_MAX_CONNS = 64
FD_HANDSHAKE_TIMEOUT = 2.0  # seconds from accept to a complete request
SUN_PATH_MAX = 107

_METRICS: tuple[Counter, Counter] | None = None


def _server_metrics() -> tuple[Counter, Counter]:
    """(fds sent, requests refused), made on first use in the worker: a client process imports this module
    for request_fd only and must not register worker metrics (under an inherited PROMETHEUS_MULTIPROC_DIR,
    e.g. LMCache's in a vLLM pod, that would open files there, which a non-root client cannot)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = (Counter("l2fs_worker_fdpass_fds_total", "File descriptors passed to same-node clients", ["op"]),
                    Counter("l2fs_worker_fdpass_refused_total", "fd-passing requests refused", ["reason"]))
    return _METRICS


def _store():  # noqa: ANN202
    """l2fs.store, imported by the server only (see _server_metrics)."""
    from l2fs import store

    return store


class FdPassError(Exception):
    """The worker refused the request (status says why: DENIED, NOT_FOUND, BAD, BUSY)."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


def default_socket_path(first_data_dir: Path, worker_id: str) -> str:
    """Next to (not inside) the first data dir: a pod can mount the socket's dir without the blocks."""
    return str(first_data_dir.parent / f"l2fs-{worker_id}.sock")


class FdServer:
    """Accept thread + a pool of `max_conns` threads, one per connection being served."""

    def __init__(self, store: Store, path: str, creds: Credentials, wake: threading.Event | None = None, *,
                 max_conns: int = FD_MAX_CONNS, handshake_timeout: float = FD_HANDSHAKE_TIMEOUT) -> None:
        _server_metrics()  # registered (at 0) before the first request
        if len(path.encode()) > SUN_PATH_MAX:
            raise ValueError(f"domain socket path {path!r} is longer than {SUN_PATH_MAX} bytes")
        self.store, self.path, self.creds = store, path, creds
        self._wake = wake
        self._slots = threading.BoundedSemaphore(max_conns)
        # reused threads: starting one per connection cost more than the request itself
        self._pool = ThreadPoolExecutor(max_conns, thread_name_prefix="l2fs-fdpass-conn")
        self._timeout = handshake_timeout
        self._stop = threading.Event()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        try:  # a stale socket of an earlier run is replaced; anything else at the name is left alone (bind fails)
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                p.unlink()
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o666)  # any local process may connect: the token in the request is the gate
        self.sock.listen(128)

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="l2fs-fdpass", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)
                continue
            if not self._slots.acquire(blocking=False):
                _server_metrics()[1].labels("busy").inc()
                self._reply_close(conn, BUSY, "too many fd-passing connections")
                continue
            if _complete(conn):  # the usual case: served here, without waking another thread
                self._serve(conn)
            else:
                self._pool.submit(self._serve, conn)

    @staticmethod
    def _reply_close(conn: socket.socket, status: int, msg: str) -> None:
        try:
            conn.settimeout(0.5)
            m = msg.encode()[:1000]
            conn.sendall(REPLY.pack(status, 0, 0, len(m)) + m)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + self._timeout
            try:
                op, token, bid, path = _read_request(conn, deadline)
            except (OSError, ValueError) as e:  # timeout, garbage, short read: nothing was handed out
                _server_metrics()[1].labels("handshake").inc()
                self._reply_close(conn, BAD, f"bad request: {e}")
                return
            try:
                peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            except OSError:
                peer = (0, -1, -1)
            status, msg, fd, size, crc = self._handle(op, token, bid, path)
            log.debug("fd request op=%d block=%s from pid=%d uid=%d: status %d %s", op, bid, peer[0], peer[1],
                      status, msg)
            if fd is None:
                _server_metrics()[1].labels({DENIED: "denied", NOT_FOUND: "not_found"}.get(status, "bad")).inc()
                self._reply_close(conn, status, msg)
                return
            try:
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                socket.send_fds(conn, [REPLY.pack(OK, size, crc, 0)], [fd])
                _server_metrics()[0].labels("read" if op == READ else "write").inc()
            except OSError:
                pass
            finally:
                os.close(fd)  # the client holds its own copy now (or nobody does)
            conn.close()
        finally:
            self._slots.release()

    def _credential(self, token: bytes) -> tuple[bool, Credential | None]:
        """(known, credential); authentication off: (True, None), every request allowed."""
        if not self.creds.enabled:
            return True, None
        cred = self.creds.from_metadata([("authorization", b"Bearer " + token)])
        return cred is not None, cred

    def _handle(self, op: int, token: bytes, bid: str, path: str
                ) -> tuple[int, str, int | None, int, int]:
        """(status, message, fd or None, size, crc)."""
        known, cred = self._credential(token)
        if not known:
            return DENIED, "missing or bad l2fs token", None, 0, 0
        try:
            bid = check_block_id(bid)
        except RpcError as e:
            return BAD, str(e), None, 0, 0
        if op == READ:
            if cred is not None and not cred.roles & (READERS | {"worker"}):
                return DENIED, "this token may not read", None, 0, 0
            return self._open_read(bid)
        try:
            path = norm_path(path)
        except PathError as e:
            return BAD, str(e), None, 0, 0
        if cred is not None and not (cred.roles & WRITERS and cred.may_write(path, True)):
            return DENIED, f"token {cred.name!r} may not put {path}", None, 0, 0
        return self._open_write(bid)

    def _open_read(self, bid: str) -> tuple[int, str, int | None, int, int]:
        opened = self.store.open_block(bid)  # O_RDONLY|O_NOFOLLOW, a regular file of the manifest's size
        if opened is None:
            _store().READ_MISSES.inc()
            if self._wake is not None:
                self._wake.set()
            return NOT_FOUND, f"block {bid} not found", None, 0, 0
        b, _, f = opened
        fd = os.dup(f.fileno())
        f.close()
        self.store.touch(bid)  # LRU: the client reads it now (it sends no Touch for an fd read)
        _store().READ_HITS.inc()
        return OK, "", fd, b.size, b.crc32c

    def _open_write(self, bid: str) -> tuple[int, str, int | None, int, int]:
        with self.store.lock:
            r = self.store.reservations.get(bid)
        if r is None or not r[3]:  # only a short-circuit (ReserveLocal) reservation, never a write in flight
            return BAD, f"block {bid} has no short-circuit reservation", None, 0, 0
        tmp = self.store.dirs[r[0]].tmp_file(bid)
        try:
            f = _store().create_exclusive(tmp)  # O_CREAT|O_EXCL|O_NOFOLLOW, 0600: never through a planted link
        except OSError as e:
            return BAD, f"block {bid}: temp file refused: {e}", None, 0, 0
        fd = os.dup(f.fileno())
        f.close()
        return OK, "", fd, r[1], 0


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    """n bytes within the one request deadline (a peer sending one byte at a time does not extend it)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        conn.settimeout(left)
        k = conn.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _complete(conn: socket.socket) -> bool:
    """Whether a whole request is already queued on `conn` (peeked, nothing consumed). Only then may the
    accept thread serve it itself: reading cannot block and the reply is one small message."""
    try:
        head = conn.recv(REQ.size + MAX_TOKEN + 2 * MAX_FIELD, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    if len(head) < REQ.size:
        return False
    _, _, tlen, blen, plen = REQ.unpack_from(head)
    return len(head) >= REQ.size + tlen + blen + plen


def _read_request(conn: socket.socket, deadline: float) -> tuple[int, bytes, str, str]:
    magic, op, tlen, blen, plen = REQ.unpack(_recv_exact(conn, REQ.size, deadline))
    if magic != MAGIC or op not in (READ, WRITE) or tlen > MAX_TOKEN or blen > MAX_FIELD or plen > MAX_FIELD:
        raise ValueError("not an l2fs fd request")
    body = _recv_exact(conn, tlen + blen + plen, deadline)
    return op, body[:tlen], body[tlen:tlen + blen].decode(errors="replace"), body[tlen + blen:].decode(
        errors="replace")


# ---------- client side ----------

def request_fd(sock_path: str, op: int, token: str | None, bid: str, path: str = "", timeout: float = 2.0
               ) -> tuple[int, int, int]:
    """Ask the worker at `sock_path` for a block's fd: (fd, size, crc32c); the caller closes the fd.
    FdPassError when the worker refused, OSError when it could not be asked (no socket, worker gone)."""
    t, b, p = (token or "").encode(), bid.encode(), path.encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(REQ.pack(MAGIC, op, len(t), len(b), len(p)) + t + b + p)
        data, fds, _, _ = socket.recv_fds(s, REPLY.size + 1024, 1, socket.MSG_CMSG_CLOEXEC)
        try:
            while len(data) < REPLY.size:
                more = s.recv(REPLY.size - len(data))
                if not more:
                    raise ConnectionError("worker closed the fd socket mid-reply")
                data += more
            status, size, crc, mlen = REPLY.unpack_from(data)
            if status != OK or not fds:
                msg = data[REPLY.size:REPLY.size + mlen]
                while len(msg) < mlen:
                    more = s.recv(mlen - len(msg))
                    if not more:
                        break
                    msg += more
                raise FdPassError(status if status != OK else BAD, msg.decode(errors="replace") or "no fd passed")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        for fd in fds[1:]:
            os.close(fd)
        return fds[0], size, crc
