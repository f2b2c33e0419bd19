"""Data-plane server: the worker's raw-TCP listener for bulk block reads (sendfile) and writes (recv_into).

Reads open blocks with `Store.open_block` and writes go through `Store.receive`, the same paths as gRPC;
this module only speaks the wire format (l2fs.dataplane.wire).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter

from l2fs.common import PathError, RpcError, check_block_id, norm_path
from l2fs.common.capability import holder_of
from l2fs.dataplane.wire import (
    BAD,
    BUF,
    BUSY,
    BUSY_MSG,
    DATA_IDLE_TIMEOUT,
    DATA_MAX_CONNS,
    DENIED,
    HANDSHAKE_TIMEOUT,
    HDR,
    MAGIC,
    MAX_TOKEN_LEN,
    NOT_FOUND,
    OK,
    PER_IP_MSG,
    PREAUTH_MAX,
    PREAUTH_PER_IP,
    READ_OK,
    WRITE_HDR,
    send_err,
)
from l2fs.worker.store import BYTES_READ, READ_HITS, READ_MISSES, Store

log = logging.getLogger("l2fs.dataplane")
REFUSED = Counter("l2fs_worker_data_refused_total", "Data-plane connections refused over the connection limit")
HEADER_TIMEOUTS = Counter("l2fs_worker_data_header_timeouts_total",
                          "Authenticated data-plane connections closed: a request header not complete in time")
PREAUTH_DROPPED = Counter("l2fs_worker_data_preauth_dropped_total",
                          "Data-plane connections closed before authenticating", ["reason"])

ACCEPT_BATCH = 16
_STATUS = {grpc.StatusCode.RESOURCE_EXHAUSTED: BUSY}  # anything else the store refuses is BAD


# (presented token or capability, op "r"/"w", block id, a write's normalised path, a write's declared size)
# -> None, or why refused
Checker = Callable[[bytes, str, str, str, int], "str | None"]
_OPS = {b"R": "r", b"W": "w"}


@dataclass(slots=True)
class _Pending:
    """A connection still sending its first request header (magic, op, token, block id; for a write also
    its path, size and order hint: a write capability is bound to the path, so it is checked with it)."""

    conn: socket.socket
    ip: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)

    def need(self) -> int:
        return _header_need(self.buf)


def _header_need(buf: bytes | bytearray) -> int:
    """Bytes of a request header still missing from `buf` (each length is known once its field is in): the
    header's layout, for the first request (non-blocking) and the later ones of a connection alike."""
    n = HDR.size
    if len(buf) < n:
        return n - len(buf)
    n += HDR.unpack_from(buf)[2] + 32
    if len(buf) < n or buf[4:5] != b"W":
        return max(0, n - len(buf))
    n += 2
    if len(buf) < n:
        return n - len(buf)
    n += struct.unpack_from("<H", buf, n - 2)[0] + WRITE_HDR.size
    return max(0, n - len(buf))


@dataclass(slots=True)
class _Request:
    """One parsed request header."""

    op: bytes
    token: bytes
    bid: str
    raw_path: str = ""
    size: int = 0
    hint: int = 0


def _parse(buf: bytes | bytearray) -> _Request:
    """A complete request header (as _header_need counted it)."""
    _, op, tlen = HDR.unpack_from(buf)
    n = HDR.size + tlen
    req = _Request(op, bytes(buf[HDR.size:n]), bytes(buf[n:n + 32]).decode("ascii", "replace"))
    if op == b"W":
        (plen,) = struct.unpack_from("<H", buf, n + 32)
        start = n + 34
        req.raw_path = bytes(buf[start:start + plen]).decode("utf-8", "replace")
        req.size, req.hint = WRITE_HDR.unpack_from(buf, start + plen)
    return req


def _norm_or_raw(raw: str) -> str:
    """The normalised path a write capability was minted for; an invalid one as sent (it then fails the
    capability check, or the write is refused as BAD)."""
    try:
        return norm_path(raw)
    except PathError:
        return raw


class DataServer:
    """One event-loop thread accepts connections and reads their first request header; only an
    authenticated one gets a serving slot and a thread, which then serves requests until the client
    closes or idles.

    Why: a slot taken at accept let 256 idle strangers (1 byte every 20 s kept them alive) lock every
    client out. Now a stranger costs a socket in the pre-auth pool for at most `handshake_timeout` seconds
    in all; each peer address may hold `preauth_per_ip` of them (more are answered BUSY), and past
    `preauth_max` in all the oldest is closed, so a client that sends its header at once (milliseconds)
    gets through a flood. Authenticated connections over `max_conns` get BUSY (the client falls back to
    gRPC or misses); idle ones close after `idle_timeout` (clients check pooled sockets before reuse)."""

    def __init__(self, store: Store, host: str, port: int, token: str | None | Checker,
                 report_now: Callable[[], None], *,
                 max_conns: int = DATA_MAX_CONNS, idle_timeout: float = DATA_IDLE_TIMEOUT,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, preauth_max: int = PREAUTH_MAX,
                 preauth_per_ip: int = PREAUTH_PER_IP) -> None:
        self.store = store
        self.max_conns = max_conns
        self.idle_timeout = idle_timeout
        self.handshake_timeout = min(handshake_timeout, idle_timeout)
        self.preauth_max = preauth_max
        self.preauth_per_ip = min(preauth_per_ip, max_conns)
        self._slots = threading.BoundedSemaphore(max_conns)
        # a checker (the worker's l2fs.common.capability.DataGate.check: a block capability, or in token mode any
        # known token of its tokens file) or one token
        self._check = token if callable(token) else self._one_token((token or "").encode())
        self._report_now = report_now  # wakes the registration loop: removals/moves reach the master now
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        self._sel = selectors.DefaultSelector()
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        self._per_ip: dict[str, int] = {}
        # authenticated connections per peer address and per holder (the credential a c2 capability names,
        # l2fs.common.capability): at most half the slots each, so neither one source (a pod) nor one credential
        # from any number of addresses can hold every slot with valid but idle or slow connections. A c1
        # capability (older master, no authentication) names no holder: per address only, as before.
        self.auth_per_ip = max(1, max_conns // 2)
        self.auth_per_holder = max(1, max_conns // 2)
        self._auth_ip: dict[str, int] = {}
        self._auth_holder: dict[str, int] = {}
        self._auth_lock = threading.Lock()

    @staticmethod
    def _one_token(want: bytes) -> Checker:
        def check(got: bytes, op: str, bid: str, path: str, size: int = 0) -> str | None:
            return None if not want or hmac.compare_digest(got, want) else "missing or bad l2fs bearer token"
        return check

    def _denied(self, req: _Request) -> str | None:
        return self._check(req.token, _OPS.get(req.op, "?"), req.bid, _norm_or_raw(req.raw_path), req.size)

    def start(self) -> None:
        threading.Thread(target=self._loop, name="l2fs-data-accept", daemon=True).start()

    def stop(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass

    # ---------- pre-auth event loop ----------

    def _loop(self) -> None:
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        while not self._stop:
            soonest = min((p.deadline for p in self._pending.values()), default=time.monotonic() + 0.5)
            try:
                events = self._sel.select(max(0.0, min(0.5, soonest - time.monotonic())))
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.data is None:
                    if not self._accept_ready():
                        return
                else:
                    self._handshake(key.data)
            now = time.monotonic()
            for p in [p for p in self._pending.values() if p.deadline <= now]:
                self._drop(p, "timeout")

    def _accept_ready(self) -> bool:
        """Accept waiting connections into the pre-auth pool, at most ACCEPT_BATCH per loop turn so headers
        that have arrived are read between batches (a burst of strangers must not push a client's ready
        connection out of the pool before it is read); False once the listener is closed."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self.sock.accept()
            except BlockingIOError:
                return True
            except OSError:
                return False
            ip = str(addr[0])
            if self._per_ip.get(ip, 0) >= self.preauth_per_ip:
                self._answer(conn, BUSY, PER_IP_MSG.format(self.preauth_per_ip, ip), counted=True)
                continue
            if len(self._pending) >= self.preauth_max:
                self._drop(next(iter(self._pending.values())), "pool_full")
            p = _Pending(conn, ip, time.monotonic() + self.handshake_timeout)
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sel.register(conn, selectors.EVENT_READ, p)
            except (OSError, ValueError):
                conn.close()
                continue
            self._pending[conn] = p
            self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        return True

    def _handshake(self, p: _Pending) -> None:
        """Read what has arrived of the first request header; when complete, check it and hand the
        connection to a serving thread."""
        if p.conn not in self._pending:  # pushed out earlier in this loop turn
            return
        try:
            chunk = p.conn.recv(p.need())
        except BlockingIOError:
            return
        except OSError:
            self._drop(p, "error")
            return
        if not chunk:
            self._drop(p, "closed")
            return
        p.buf += chunk
        if len(p.buf) < HDR.size:
            return
        magic, op, tlen = HDR.unpack_from(p.buf)
        if magic != MAGIC or tlen > MAX_TOKEN_LEN:
            self._drop(p, "bad", BAD, "bad magic or token length: not an l2fs data-plane client")
            return
        if p.need():
            return
        req = _parse(p.buf)
        why = self._denied(req)
        if why:
            self._drop(p, "denied", DENIED, why)
            return
        holder = holder_of(req.token)  # verified above (None: a c1 capability or a token)
        with self._auth_lock:
            held = self._auth_ip.get(p.ip, 0)
            if held >= self.auth_per_ip:
                REFUSED.inc()
                self._drop(p, "busy", BUSY, BUSY_MSG.format(f"{self.auth_per_ip} from {p.ip}"))
                return
            by = self._auth_holder.get(holder, 0) if holder else 0
            if by >= self.auth_per_holder:
                REFUSED.inc()
                self._drop(p, "busy", BUSY, BUSY_MSG.format(f"{self.auth_per_holder} for one credential"))
                return
            if not self._slots.acquire(blocking=False):
                REFUSED.inc()
                self._drop(p, "busy", BUSY, BUSY_MSG.format(self.max_conns))
                return
            self._auth_ip[p.ip] = held + 1
            if holder:
                self._auth_holder[holder] = by + 1
        self._forget(p)
        try:
            p.conn.setblocking(True)
            threading.Thread(target=self._serve, args=(p.conn, req, p.ip, holder), name="l2fs-data-conn",
                             daemon=True).start()
        except BaseException:
            self._release(p.ip, holder)
            p.conn.close()
            raise

    def _release(self, ip: str, holder: str | None = None) -> None:
        """Give back an authenticated connection's slot and its address's and holder's shares."""
        with self._auth_lock:
            for table, key in ((self._auth_ip, ip), (self._auth_holder, holder)):
                if key is None:
                    continue
                n = table.get(key, 1) - 1
                if n > 0:
                    table[key] = n
                else:
                    table.pop(key, None)
        self._slots.release()

    def _forget(self, p: _Pending) -> None:
        """Take p out of the pre-auth pool (its socket stays open); a no-op when it is already out."""
        if self._pending.pop(p.conn, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(p.conn)
        n = self._per_ip.get(p.ip, 0) - 1
        if n > 0:
            self._per_ip[p.ip] = n
        else:
            self._per_ip.pop(p.ip, None)

    def _drop(self, p: _Pending, reason: str, status: int | None = None, msg: str = "") -> None:
        """Close a pre-auth connection, answering `status` first when given."""
        if p.conn not in self._pending:
            return
        self._forget(p)
        PREAUTH_DROPPED.labels(reason).inc()
        if status is None:
            p.conn.close()
        else:
            self._answer(p.conn, status, msg)

    @staticmethod
    def _answer(conn: socket.socket, status: int, msg: str, *, counted: bool = False) -> None:
        """Send an error answer without blocking (it fits the socket buffer) and close, without a thread."""
        if counted:
            REFUSED.inc()
        try:
            conn.setblocking(False)
            send_err(conn, status, msg)
        except OSError:
            pass
        finally:
            conn.close()

    # ---------- authenticated connections ----------

    def _serve(self, conn: socket.socket, req: _Request, ip: str, holder: str | None = None) -> None:
        """Serve an authenticated connection, counted for `ip` and `holder` (the credential of its first
        request's capability: a connection keeps that count whatever capabilities follow on it)."""
        try:
            conn.settimeout(self.idle_timeout)  # idle connections close, freeing their slot
            with conn:
                try:
                    keep = self._dispatch(conn, req)
                    while keep:
                        keep = self._serve_one(conn)
                except (OSError, ConnectionError, struct.error, UnicodeDecodeError) as e:
                    log.debug("data connection ended: %s", e)
        finally:
            self._release(ip, holder)

    def _serve_one(self, conn: socket.socket) -> bool:
        """One further request on an authenticated connection; False when the connection is to be closed
        (client done, or an error answered).

        Between requests the connection may idle for idle_timeout; once a request's first byte is in, the
        whole header must follow within handshake_timeout (one deadline, not restarted by each byte): a
        client trickling a header a byte at a time held its slot for ever, and 256 of them every slot."""
        first = conn.recv(1)
        if not first:
            return False
        buf = bytearray(first)
        deadline = time.monotonic() + self.handshake_timeout
        checked = False
        try:
            while n := _header_need(buf):
                if not checked and len(buf) >= HDR.size:
                    magic, _, tlen = HDR.unpack_from(buf)
                    if magic != MAGIC or tlen > MAX_TOKEN_LEN:
                        send_err(conn, BAD, "bad magic or token length: not an l2fs data-plane client")
                        return False
                    checked = True
                left = deadline - time.monotonic()
                if left <= 0:
                    HEADER_TIMEOUTS.inc()
                    return False
                conn.settimeout(left)
                chunk = conn.recv(n)
                if not chunk:
                    return False
                buf += chunk
        except TimeoutError:
            HEADER_TIMEOUTS.inc()
            return False
        finally:
            conn.settimeout(self.idle_timeout)
        req = _parse(buf)
        why = self._denied(req)
        if why:
            send_err(conn, DENIED, why)
            return False
        return self._dispatch(conn, req)

    def _dispatch(self, conn: socket.socket, req: _Request) -> bool:
        """Serve one authenticated request whose header has been read."""
        try:
            check_block_id(req.bid)
        except RpcError as e:
            send_err(conn, BAD, str(e))
            return False
        if req.op == b"R":
            self._read(conn, req.bid)
            return True
        if req.op == b"W":
            try:
                path = norm_path(req.raw_path)
            except PathError as e:
                send_err(conn, BAD, str(e))
                return False
            return self._write(conn, req.bid, path, req.size, req.hint)
        send_err(conn, BAD, f"unknown op {req.op!r}")
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
