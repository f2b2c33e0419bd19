"""The worker's side of fd passing (l2fs/common/fdpass.py has the wire and the client's `request_fd`).

Why a module of its own: a client process (a vLLM pod) imports l2fs.common.fdpass for `request_fd` only and must
neither import the worker's store nor register worker metrics (under an inherited PROMETHEUS_MULTIPROC_DIR,
LMCache's in a vLLM pod, registering opens files there, which a non-root client cannot). Only l2fs.worker
imports this module.
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
from l2fs.common.capability import DataGate
from l2fs.common.fdpass import (
    BAD,
    BUSY,
    DENIED,
    FD_HANDSHAKE_TIMEOUT,
    FD_MAX_CONNS,
    MAGIC,
    MAX_FIELD,
    MAX_TOKEN,
    NOT_FOUND,
    OK,
    READ,
    REPLY,
    REQ,
    SUN_PATH_MAX,
    WRITE,
)
from l2fs.worker import store as store_mod
from l2fs.worker.store import Store

log = logging.getLogger("l2fs.common.fdpass")

FDS_PASSED = Counter("l2fs_worker_fdpass_fds_total", "File descriptors passed to same-node clients", ["op"])
FD_REFUSED = Counter("l2fs_worker_fdpass_refused_total", "fd-passing requests refused", ["reason"])
for _op in ("read", "write"):
    FDS_PASSED.labels(_op)  # at 0 before the first request


class FdServer:
    """Accept thread + a pool of `max_conns` threads, one per connection being served."""

    def __init__(self, store: Store, path: str, creds: Credentials, wake: threading.Event | None = None, *,
                 max_conns: int = FD_MAX_CONNS, handshake_timeout: float = FD_HANDSHAKE_TIMEOUT,
                 gate: DataGate | None = None) -> None:
        """`gate`: the worker's capability gate; in capability mode a request needs a block capability for
        its op and block (a write's bound to its path) and a plain token, even admin, is DENIED."""
        if len(path.encode()) > SUN_PATH_MAX:
            raise ValueError(f"domain socket path {path!r} is longer than {SUN_PATH_MAX} bytes")
        self.store, self.path, self.creds = store, path, creds
        self._wake = wake
        self.gate = gate
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
                FD_REFUSED.labels("busy").inc()
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
                FD_REFUSED.labels("handshake").inc()
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
                FD_REFUSED.labels({DENIED: "denied", NOT_FOUND: "not_found"}.get(status, "bad")).inc()
                self._reply_close(conn, status, msg)
                return
            try:
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                socket.send_fds(conn, [REPLY.pack(OK, size, crc, 0)], [fd])
                FDS_PASSED.labels("read" if op == READ else "write").inc()
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
        if self.gate is not None and (self.gate.cap_mode or not self.gate.ready):
            return self._handle_cap(op, token, bid, path)
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

    def _handle_cap(self, op: int, cap: bytes, bid: str, path: str) -> tuple[int, str, int | None, int, int]:
        """Capability mode: the capability alone says what may be done (the master checked the caller's scope
        when it minted it)."""
        assert self.gate is not None
        try:
            bid = check_block_id(bid)
            path = norm_path(path) if op == WRITE else ""
        except (RpcError, PathError) as e:
            return BAD, str(e), None, 0, 0
        size = None
        if op == WRITE:  # a write capability binds the allocated size: the reservation's
            size = self.store.reserved_size(bid)
            if size is None:
                return BAD, f"block {bid} has no short-circuit reservation", None, 0, 0
        why = self.gate.check(cap, "r" if op == READ else "w", bid, path, size)
        if why:
            return DENIED, why, None, 0, 0
        return self._open_read(bid) if op == READ else self._open_write(bid)

    def _open_read(self, bid: str) -> tuple[int, str, int | None, int, int]:
        opened = self.store.open_block(bid)  # O_RDONLY|O_NOFOLLOW, a regular file of the manifest's size
        if opened is None:
            store_mod.READ_MISSES.inc()
            if self._wake is not None:
                self._wake.set()
            return NOT_FOUND, f"block {bid} not found", None, 0, 0
        b, _, f = opened
        fd = os.dup(f.fileno())
        f.close()
        self.store.touch(bid)  # LRU: the client reads it now (it sends no Touch for an fd read)
        store_mod.READ_HITS.inc()
        return OK, "", fd, b.size, b.crc32c

    def _open_write(self, bid: str) -> tuple[int, str, int | None, int, int]:
        """A sealed memfd of exactly the reserved size (Store.open_write_fd): the client writes no more."""
        try:
            got = self.store.open_write_fd(bid)
        except OSError as e:
            return BAD, f"block {bid}: no write fd: {e}", None, 0, 0
        if isinstance(got, str):
            return BAD, got, None, 0, 0
        fd, size = got
        return OK, "", fd, size, 0


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
