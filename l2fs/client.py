"""l2fs client: the one way every other part of kvtier (connector, mount, fsspec, router, benches) reaches L2.

Conventions:
- Paths are absolute POSIX-style strings inside the l2fs namespace ("/kv/model/abc.data"). Invalid paths
  ("..", NUL, empty components, > limits) raise `InvalidPath` (a ValueError).
- Reads are fail-as-miss: a missing file, a dead/unreachable worker, a checksum mismatch or a deadline
  overrun returns None (never raises, never blocks past `timeout`).
- Metadata calls on an unreachable master raise `Unavailable` after `timeout` (callers on the cache path
  catch `L2fsError` and treat it as a miss).
- `put` is put-if-absent by default: publishing an existing path is a successful no-op that returns False.
  A file becomes visible only when complete (atomic publish).
"""


from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c
import grpc

from l2fs.batch import PROTOCOL_VERSION, status_code
from l2fs.capability import NOT_READY, expiry_of
from l2fs.common import (
    ERROR_KIND_KEY,
    FRAME,
    CrcPipeline,
    PathError,
    auth_metadata,
    crc32c_fast,
    crc_pieces,
    make_channel,
    norm_path,
    parent_of,
    parse_masters,
    shard_of,
)
from l2fs.dataplane import DataClient, DataPlaneError, enabled_by_default
from l2fs.dataplane.wire import BAD, DENIED
from l2fs.fdpass import DENIED as FD_DENIED
from l2fs.fdpass import NOT_FOUND as FD_NOT_FOUND
from l2fs.fdpass import READ as FD_READ
from l2fs.fdpass import WRITE as FD_WRITE
from l2fs.fdpass import FdPassError, request_fd
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

log = logging.getLogger("l2fs.client")


class L2fsError(Exception):
    """Base class of l2fs client errors."""

    errno: int | None  # set when the server named one (annotation only: OSError subclasses have their own)


class InvalidArgument(L2fsError, ValueError):
    """The server refused the request's arguments (e.g. a file over the max file size)."""


class InvalidPath(InvalidArgument):
    """The path is not a valid l2fs path."""


class NotFound(L2fsError, FileNotFoundError):
    """The path does not exist (metadata operations only; reads return None instead)."""


class AlreadyExists(L2fsError, FileExistsError):
    """Target exists and the operation does not overwrite."""


class Unavailable(L2fsError, ConnectionError):
    """Master (or every candidate worker) unreachable within the deadline."""


class Busy(Unavailable):
    """A worker refused for load (RESOURCE_EXHAUSTED: e.g. too many bytes promised to unfinished writes): a
    write miss. An Unavailable, so callers skip or try another worker as before, but the cluster is up:
    circuit breakers that stop calling a dead master must not trip on it."""


class QuotaExceeded(L2fsError):
    """The path's prefix is at its L2 quota (`l2fs master --prefix-quota`): a write miss. Not Unavailable on
    purpose: the cluster is up, and callers that open a circuit breaker on outages must not trip on it."""


class PermissionDenied(L2fsError, PermissionError):
    """Authentication/authorization failed (bad or missing token)."""


class WrongShard(L2fsError):
    """A master refused a path of another shard: this client's master list does not match the cluster's."""


class CrossShard(L2fsError):
    """A rename that would move a file (or a directory's files) to another shard (errno EXDEV: copy and
    delete instead, as `mv` does across file systems)."""

    errno = errno.EXDEV


class Unimplemented(L2fsError):
    """The server does not have this call (a peer older than this client's protocol)."""


@dataclass(slots=True)
class FileInfo:
    path: str
    size: int
    is_dir: bool = False
    mtime: float = 0.0
    crc32c: int = 0
    nodes: list[str] = field(default_factory=list)  # node ids holding the file's blocks


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    node_id: str
    address: str
    alive: bool
    capacity: int
    used: int
    blocks: int


@dataclass(slots=True)
class ClusterReport:
    workers: list[WorkerInfo]
    files: int
    capacity: int
    used: int
    duplicate_files: int = 0  # same bytes under another name: a sign of diverging cache keys


_TRANSIENT = {grpc.StatusCode.UNAVAILABLE}
PUT_BATCH = 256  # items per AllocateMany/CommitMany (master CPU per put is flat from ~256 on, see docs/l2fs.md)


def _trailer(e: grpc.RpcError, name: str) -> str | None:
    """A trailing metadata value the server attached to an error (`l2fs-errno`, `l2fs-error`), if any."""
    try:
        md = e.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not every RpcError carries a call
        return None
    for key, value in md:
        if key == name:
            return str(value)
    return None


def _errno(e: grpc.RpcError) -> int | None:
    """The errno the server named in trailing metadata `l2fs-errno` (e.g. ENOTEMPTY), if any."""
    code = getattr(errno, _trailer(e, "l2fs-errno") or "", None)
    return code if isinstance(code, int) else None


def _error(e: grpc.RpcError) -> L2fsError:
    """Map a gRPC status to the client's exception types (message kept; `.errno` set when the server
    named one, so callers such as the FUSE mount need not parse messages)."""
    return _with_errno(_error_type(e), _errno(e))


def _with_errno(exc: L2fsError, code: int | None) -> L2fsError:
    """`exc` with the errno the server named; a prefix quota refusal (EDQUOT) becomes QuotaExceeded."""
    if code == errno.EDQUOT:
        exc = QuotaExceeded(str(exc))
    elif code == errno.EXDEV:
        exc = CrossShard(str(exc))
    if code is not None:
        exc.errno = code
    return exc


def _error_type(e: grpc.RpcError) -> L2fsError:
    return _exception(e.code(), e.details() or str(e.code()), _trailer(e, ERROR_KIND_KEY))


def _item_error(err: pb.ItemError) -> L2fsError:
    """One failed item of a batched call, as the exception its unary call would have raised."""
    code = getattr(errno, err.errno_name, None) if err.errno_name else None
    return _with_errno(_exception(status_code(err), err.message, err.kind), code if isinstance(code, int) else None)


def _exception(code: grpc.StatusCode, msg: str, kind: str | None) -> L2fsError:
    if kind == "shard":
        return WrongShard(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPath(msg) if kind == "path" else InvalidArgument(msg)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(msg)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(msg)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionDenied(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Busy(msg)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(msg)
    return L2fsError(f"{code.name}: {msg}")


def _info(st: pb.FileStat) -> FileInfo:
    return FileInfo(path=st.path, size=st.size, is_dir=st.is_dir, mtime=st.mtime, crc32c=st.crc32c,
                    nodes=[loc.node_id for loc in st.locations])


@dataclass(slots=True)
class _Shard:
    """One shard of the namespace: its failover masters (one is current) and when lookups may ask it again."""

    addrs: list[str]
    stubs: list[Any]
    current: int = 0
    down_until: float = 0.0  # after a failed lookup, skip this shard's master for a moment (fail fast)


@dataclass(slots=True)
class _Put:
    """One item of a put batch as it goes through allocate, write and commit rounds."""

    path: str
    mv: memoryview
    hint: int
    result: bool | L2fsError | None = None  # set once the item is finished
    bid: str = ""
    loc: pb.Location = field(default_factory=pb.Location)
    written: pb.WriteResult | None = None
    exclude: list[str] = field(default_factory=list)  # workers that were unreachable for this item
    error: L2fsError | None = None  # why the last round has to be retried
    tries: int = 0


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
        n = 0
        while n < mv.nbytes:
            n += os.write(fd, mv[n:])
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class _CapDenied(Exception):
    """A worker refused the block capability a read carried (Client._read locates once more)."""


def _caps_valid(st: pb.FileStat) -> bool:
    """Whether no location's capability has expired by this host's clock (the worker allows some skew)."""
    now = time.time()
    for loc in st.locations:
        exp = expiry_of(loc.capability) if loc.capability else None
        if exp is not None and now > exp:
            return False
    return True


def _check(path: str) -> str:
    try:
        return norm_path(path)
    except PathError as e:
        exc = InvalidPath(str(e))
        exc.errno = getattr(errno, e.errno_name)
        raise exc from None


class Client:
    """Synchronous client. Thread-safe; share one per process.

    master: "host:port", a comma-separated failover list, or shards separated by ';' ("m0a:p,m0b:p;m1:p":
        paths are routed by shard_of(path), batches split per shard and sent in parallel); default
        $L2FS_MASTER.
    node_id: this process's node, for local-first placement and short-circuit I/O; default $L2FS_NODE_ID.
    token: bearer token for clusters started with --token; default $L2FS_TOKEN. A callable returning it (e.g.
        l2fs.common.FileToken) is asked at every call.
    tls_ca: CA bundle path to enable TLS; default $L2FS_TLS_CA.
    timeout: per-call deadline in seconds (reads fail as a miss after it).
    short_circuit: read/write local blocks directly on disk when the worker is on this node.
    fd_passing: for that, ask a same-node worker that advertises a Unix socket (visible here) for file
        descriptors instead of opening paths in its data dir (which this pod then need not mount).
    data_plane: move bulk bytes over the workers' raw-TCP data plane when they offer one (else gRPC
        streaming); default on unless $L2FS_DATA_PLANE=grpc.
    local_writes: write same-node blocks through the worker's ReserveLocal/AdoptLocal calls (short-circuit).
        Off for a caller whose token the workers do not know (a pod ServiceAccount token only the master
        reviews): its writes go over the data plane with capabilities, while same-node reads still take fds
        from the worker's socket, which checks capabilities, not tokens.
    """

    def __init__(
        self,
        master: str | None = None,
        *,
        node_id: str | None = None,
        token: str | Callable[[], str] | None = None,
        tls_ca: str | None = None,
        timeout: float = 2.0,
        short_circuit: bool = True,
        data_plane: bool | None = None,
        fd_passing: bool = True,
        local_writes: bool = True,
    ) -> None:
        master = master or os.environ.get("L2FS_MASTER")
        if not master:
            raise ValueError("no l2fs master: pass master='host:port' or set L2FS_MASTER")
        shards = parse_masters(master)
        self.masters = [m for addrs in shards for m in addrs]
        self.node_id = node_id if node_id is not None else os.environ.get("L2FS_NODE_ID", "")
        tok = token if token is not None else os.environ.get("L2FS_TOKEN") or None
        # a callable (l2fs.common.FileToken: a projected ServiceAccount token the kubelet rotates) is asked at
        # every call; `token` is then None (capabilities, not tokens, carry the data plane and fd requests)
        self._token_fn: Callable[[], str] | None = tok if callable(tok) else None
        self.token: str | None = None if callable(tok) else tok
        self.tls_ca = tls_ca if tls_ca is not None else os.environ.get("L2FS_TLS_CA") or None
        self.timeout = timeout
        self.short_circuit = short_circuit
        self.fd_passing = fd_passing
        self.local_writes = local_writes
        self._static_md = auth_metadata(self.token)
        self._lock = threading.Lock()
        self._channels: list[grpc.Channel] = []
        self._shards: list[_Shard] = []
        for addrs in shards:
            chans = [make_channel(m, self.tls_ca) for m in addrs]
            self._channels += chans
            self._shards.append(_Shard(addrs, [pbg.MasterStub(ch) for ch in chans]))
        self._shard_pool: ThreadPoolExecutor | None = None
        self._workers: dict[str, pbg.WorkerStub] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.data_plane = enabled_by_default() if data_plane is None else data_plane
        self._data = DataClient(self.token)
        self._inflight: set[Any] = set()
        # Last known location of recently read paths, used only while the master is unreachable so reads of
        # already-located blocks keep working through a master restart; any miss forgets it.
        self._located: OrderedDict[str, pb.FileStat] = OrderedDict()
        # Locations from one locate_many (StatMany) for a batch about to be read: used once each, within the
        # timeout, instead of a Stat per read; found and not-found alike (path -> (FileStat, expiry)).
        self._prefetched: dict[str, tuple[pb.FileStat, float]] = {}
        self._touches: dict[str, dict[str, str]] = {}  # worker address -> {block id: its read capability}
        self._toucher: threading.Thread | None = None
        self._unbatched: set[str] = set()  # peers (master, worker address) without the batched calls
        self._no_local: dict[str, float] = {}  # worker address -> until when short-circuit writes are off

    # ---------- plumbing ----------

    @property
    def _md(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata with the bearer token (re-read per call when the token is a callable)."""
        return auth_metadata(self._token_fn()) if self._token_fn is not None else self._static_md

    def _worker(self, address: str) -> pbg.WorkerStub:
        with self._lock:
            stub = self._workers.get(address)
            if stub is None:
                ch = make_channel(address, self.tls_ca)
                self._channels.append(ch)
                stub = self._workers[address] = pbg.WorkerStub(ch)
            return stub

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(8, thread_name_prefix="l2fs-client")
            return self._pool

    def _shard_of(self, path: str) -> int:
        return shard_of(path, len(self._shards))

    def _split(self, paths: Sequence[str]) -> dict[int, list[int]]:
        """shard -> indexes of `paths` (normalised) it owns, in order."""
        parts: dict[int, list[int]] = {}
        for i, p in enumerate(paths):
            parts.setdefault(self._shard_of(p), []).append(i)
        return parts

    def _fan(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run one call per shard in parallel (the first on this thread); each result, or the exception it
        raised, in order. Its own pool: the calls use self._executor() for writes and must not wait on it."""
        pool = None
        if len(calls) > 1:
            with self._lock:
                if self._shard_pool is None:
                    self._shard_pool = ThreadPoolExecutor(4 * len(self._shards), thread_name_prefix="l2fs-shard")
                pool = self._shard_pool
        futs = [pool.submit(c) for c in calls[1:]] if pool is not None else []
        out: list[Any] = []
        for c in calls[:1]:
            try:
                out.append(c())
            except Exception as e:  # noqa: BLE001 - handed back in its slot
                out.append(e)
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def _master(self, method: str, request: Any, deadline: float | None = None, shard: int = 0) -> Any:
        """Call a shard's master with retries on transient errors until the deadline (trying the shard's
        failover masters in turn); map errors."""
        if self._closed:
            raise L2fsError("client is closed")
        sh = self._shards[shard]
        deadline = deadline or time.monotonic() + self.timeout
        delay = 0.02
        last: grpc.RpcError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            i = sh.current
            # wait_for_ready: a call that fails fast never drives the reconnect, and the channel's shared
            # subchannel came back 4.5 s (14.7 s on a loaded box) after a master restart instead of <= 1 s.
            # With several masters, one attempt is capped so a dead one does not hold the whole deadline.
            attempt = remaining if len(sh.stubs) == 1 else min(remaining, self._MASTER_ATTEMPT)
            try:
                return getattr(sh.stubs[i], method)(request, timeout=attempt, metadata=self._md,
                                                    wait_for_ready=True)
            except grpc.RpcError as e:
                last = e
                capped = attempt < remaining and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if e.code() not in _TRANSIENT and not capped:
                    raise _error(e) from None
                if len(sh.stubs) > 1:
                    sh.current = (i + 1) % len(sh.stubs)
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
        if last is None:
            raise Unavailable(f"l2fs master {','.join(sh.addrs)}: deadline exceeded")
        raise Unavailable(f"l2fs master {','.join(sh.addrs)}: {last.details() or last.code()}") from None

    def _is_local(self, loc: pb.Location) -> bool:
        # the file name must be the block id: a bogus registration cannot point us at arbitrary files
        return (self.short_circuit and bool(self.node_id) and loc.node_id == self.node_id
                and os.path.basename(loc.local_path) == loc.block_id and bool(loc.block_id))

    def _fd_socket(self, loc: pb.Location) -> str:
        """The same-node worker's fd-passing socket when it advertises one that exists here, else ""."""
        sock = loc.domain_socket
        if (not sock or not self.fd_passing or not self.short_circuit or not self.node_id
                or loc.node_id != self.node_id):
            return ""
        return sock if os.path.exists(sock) else ""

    # ---------- data ----------

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
            deadline = time.monotonic() + max(self.timeout, sum(p.mv.nbytes for p in pending) / 200e6)  # 200 MB/s
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
        retry = self._write_many(to_write, deadline)
        for p in retry:
            if p.tries >= 3 or time.monotonic() >= deadline:
                p.result = p.error or Unavailable(f"put {p.path}: no worker took it")
        retry = [p for p in retry if p.result is None]
        done = [(p, p.written) for p in to_write if p.written is not None]
        if done:
            creqs = [pb.CommitRequest(path=p.path, block_id=p.bid, worker_id=p.loc.worker_id, size=p.mv.nbytes,
                                      crc32c=w.crc32c, if_absent=if_absent, order_hint=p.hint,
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
            if self._writes_local(p.loc):
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
            areqs = [pb.AdoptRequest(block_id=p.bid, path=p.path, size=p.mv.nbytes, crc32c=crc32c_fast(p.mv),
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

    _LOCATED_MAX = 65536
    _MASTER_PAUSE = 1.0  # seconds lookups skip the master after it was unreachable
    _MASTER_ATTEMPT = 1.0  # seconds one call may wait for one of several masters before the next is tried

    def _pause_master(self, shard: int = 0) -> None:
        """A shard's master just failed a lookup: for a moment, answer its lookups from what we know, without
        waiting."""
        self._shards[shard].down_until = time.monotonic() + self._MASTER_PAUSE

    def _locate(self, path: str, deadline: float) -> pb.FileStat | None:
        now = time.monotonic()
        with self._lock:
            cached = self._located.get(path)
            pre = self._prefetched.pop(path, None)
        if pre is not None and now < pre[1]:
            return self._remember(path, pre[0])
        if cached is not None and not _caps_valid(cached):
            self._forget(path)  # its capabilities expired: useless even while the master is down
            cached = None
        shard = self._shard_of(path)
        if now < self._shards[shard].down_until:
            return cached  # the master just failed: last known location, or a miss without waiting
        # With a fallback, leave most of the deadline for the read itself.
        mdeadline = min(deadline, now + self.timeout / 4) if cached is not None else deadline
        try:
            st = self._master("Stat", pb.PathRequest(path=path), mdeadline, shard)
        except Unavailable:
            self._pause_master(shard)
            return cached
        except L2fsError as e:
            if isinstance(e, InvalidPath):
                raise
            return None
        return self._remember(path, st)

    def _remember(self, path: str, st: pb.FileStat) -> pb.FileStat | None:
        """A fresh Stat answer: keep a readable file's location (fallback cache), forget anything else."""
        if not st.exists or st.is_dir or not st.locations:
            self._forget(path)
            return None
        with self._lock:
            self._located[path] = st
            self._located.move_to_end(path)
            if len(self._located) > self._LOCATED_MAX:
                self._located.popitem(last=False)
        return st

    def locate_many(self, paths: Sequence[str], *, _deadline: float | None = None) -> int:
        """Look up where a batch of files lives in ONE master round trip (StatMany), so the next read of each
        path (get / get_into, once, within `timeout`) skips its own Stat RPC. Returns how many exist.

        A hint: any fault (master unreachable, deadline) returns 0 and the reads locate one by one as
        before; invalid paths raise InvalidPath like the reads would. Measured on 31 chunks of 1 MiB: one
        StatMany ~2 ms vs ~26 ms for 31 Stats (benchmarks/chunk_read_bench.py)."""
        norm = [_check(p) for p in paths]
        now = time.monotonic()
        deadline = _deadline if _deadline is not None else now + self.timeout
        if not norm or now >= deadline:
            return 0
        parts = {s: idx for s, idx in self._split(norm).items() if now >= self._shards[s].down_until}

        def one(shard: int, idx: list[int]) -> list[Any]:
            try:
                resp = self._master("StatMany", pb.PathsRequest(paths=[norm[i] for i in idx]), deadline, shard)
            except Unavailable:
                self._pause_master(shard)
                return []
            return list(resp.stats) if len(resp.stats) == len(idx) else []

        found: list[tuple[str, Any]] = []
        for idx, stats in zip(parts.values(), self._fan([functools.partial(one, s, idx)
                                                         for s, idx in parts.items()]), strict=True):
            if isinstance(stats, list):  # any fault of a shard: its paths locate one by one as before
                found += [(norm[i], st) for i, st in zip(idx, stats, strict=False)]
        expiry = time.monotonic() + self.timeout
        with self._lock:
            if len(self._prefetched) > self._LOCATED_MAX:  # batches that were never read
                self._prefetched = {p: v for p, v in self._prefetched.items() if v[1] > now}
            for p, st in found:
                self._prefetched[p] = (st, expiry)
        return sum(1 for _, st in found if st.exists and not st.is_dir and st.locations)

    def _forget(self, *paths: str) -> None:
        with self._lock:
            for p in paths:
                try:
                    n = norm_path(p)
                    self._located.pop(n, None)
                    self._prefetched.pop(n, None)
                except PathError:
                    pass  # an invalid path was never remembered

    def _read(self, path: str, into: memoryview | None, deadline: float | None = None) -> bytes | int | None:
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

    def _read_located(self, path: str, st: pb.FileStat, into: memoryview | None, deadline: float
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
                    into[off:off + n] = m.data
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

    def _read_tcp(self, loc: pb.Location, st: pb.FileStat, into: memoryview | None, deadline: float
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

    def _read_fd(self, sock: str, loc: pb.Location, st: pb.FileStat, into: memoryview | None, deadline: float
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

    def _read_local(self, loc: pb.Location, st: pb.FileStat, into: memoryview | None) -> bytes | int | None:
        try:
            # O_NOFOLLOW: a link planted at a block's name is not read through (O_NONBLOCK: nor a FIFO hung on)
            fd = os.open(loc.local_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        got = self._read_open(fd, loc, st, into)
        if got is not None:
            self._touch(loc)  # LRU: this was a read (an fd read is counted by the worker itself)
        return got

    def _read_open(self, fd: int, loc: pb.Location, st: pb.FileStat, into: memoryview | None
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
    def _readinto_verified(f: Any, into: memoryview, st: pb.FileStat) -> bool:
        """Read piece by piece, checksumming each piece while the next one is read."""
        pieces = crc_pieces(st.size)
        pipe = CrcPipeline(len(pieces))
        for start, end in pieces:
            view, got = into[start:end], 0
            while got < end - start:
                n = f.readinto(view[got:])
                if not n:
                    return False
                got += n
            pipe.add(view)
        return pipe.result() == st.crc32c

    def get(self, path: str, *, _deadline: float | None = None) -> bytes | None:
        """Whole file or None (miss)."""
        r = self._read(path, None, _deadline)
        if not isinstance(r, bytes):
            self._forget(path)
            return None
        return r

    def get_into(self, path: str, buf: memoryview | bytearray, *, _deadline: float | None = None) -> int | None:
        """Read the file into buf (must be large enough); returns bytes read or None (miss)."""
        r = self._read(path, memoryview(buf).cast("B"), _deadline)
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

    # ---------- metadata ----------

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def stat(self, path: str) -> FileInfo | None:
        path = _check(path)
        st = self._master("Stat", pb.PathRequest(path=path), shard=self._shard_of(path))
        if not st.exists and len(self._shards) > 1:
            st = self._dir_elsewhere(path) or st
        return _info(st) if st.exists else None

    def _dir_elsewhere(self, path: str) -> pb.FileStat | None:
        """A directory that exists only on other shards (directories live where something under them is):
        ask them all at once; their refusals of a non-directory (WrongShard) and faults are 'not there'."""
        own, now = self._shard_of(path), time.monotonic()
        # a shard that just failed is skipped (and one failing now is paused): a miss must not wait for it
        others = [s for s in range(len(self._shards)) if s != own and now >= self._shards[s].down_until]

        def ask(shard: int) -> Any:
            try:
                return self._master("Stat", pb.PathRequest(path=path), None, shard)
            except Unavailable:
                self._pause_master(shard)
                raise

        got = self._fan([functools.partial(ask, s) for s in others])
        return next((st for st in got if isinstance(st, pb.FileStat) and st.exists and st.is_dir), None)

    def stat_many(self, paths: Sequence[str]) -> list[FileInfo | None]:
        """One RPC per shard (in parallel). A directory is found on its own shard only (use stat)."""
        norm = [_check(p) for p in paths]
        out: list[FileInfo | None] = [None] * len(norm)
        parts = self._split(norm)
        got = self._fan([functools.partial(self._master, "StatMany", pb.PathsRequest(paths=[norm[i] for i in idx]),
                                           None, s) for s, idx in parts.items()])
        for idx, resp in zip(parts.values(), got, strict=True):
            if isinstance(resp, Exception):
                raise resp
            for i, st in zip(idx, resp.stats, strict=True):
                out[i] = _info(st) if st.exists else None
        return out

    def prefix_lookup(self, paths: Sequence[str]) -> int:
        """How many leading paths exist (one RPC per shard, in parallel). Does not pin or renew anything.

        Each shard answers how many of ITS paths lead the chain, so the chain's first miss is the earliest of
        the shards' first misses; an unreachable shard's first path counts as a miss (a fault is a miss), and
        only when every shard failed does the call raise."""
        if not paths:
            return 0
        norm = [_check(p) for p in paths]
        parts = self._split(norm)
        got = self._fan([functools.partial(self._master, "PrefixLookup",
                                           pb.PathsRequest(paths=[norm[i] for i in idx]), None, s)
                         for s, idx in parts.items()])
        return combine_prefix(list(parts.values()), [r if isinstance(r, Exception) else r.count for r in got],
                              len(norm))

    def ls(self, path: str = "/") -> list[FileInfo]:
        """Entries of a directory (every shard's, merged), or [the file]. Fails when a shard cannot answer:
        a listing is complete or an error."""
        path = _check(path)
        got = self._fan([functools.partial(self._master, "List", pb.PathRequest(path=path), None, s)
                         for s in range(len(self._shards))])
        merged: dict[str, pb.FileStat] = {}
        found = False
        for r in got:
            if isinstance(r, NotFound):
                continue
            if isinstance(r, Exception):
                raise r
            found = True
            for st in r.entries:
                if st.path == path and not st.is_dir:
                    return [_info(st)]  # a file: listed as itself
                if st.path not in merged or not st.is_dir:  # a file wins over another shard's directory
                    merged[st.path] = st
        if not found:
            raise NotFound(f"{path}: no such file or directory")
        return [_info(merged[p]) for p in sorted(merged)]

    def walk(self, root: str = "/") -> dict[str, FileInfo]:
        """Every file under `root` by absolute path (one `ls` per directory; an absent root has none). For
        tools and benchmarks that account for a prefix's files; a listing fault raises, like `ls`."""
        out: dict[str, FileInfo] = {}
        todo = [_check(root)]
        while todo:
            d = todo.pop()
            try:
                entries = self.ls(d)
            except NotFound:
                continue  # not created yet, or removed while we walked
            for e in entries:
                path = e.path if e.path.startswith("/") else f"{d.rstrip('/')}/{e.path}"
                if e.is_dir:
                    todo.append(path)
                else:
                    out[path] = e
        return out

    def mkdir(self, path: str, *, parents: bool = True, exist_ok: bool = True) -> None:
        path = _check(path)
        if len(self._shards) == 1:
            self._master("Mkdir", pb.MkdirRequest(path=path, parents=parents, exist_ok=exist_ok))
            return
        # sharded: the directory is made on its own shard; its parents may exist on others only
        st = self.stat(path)
        if st is not None:
            if not st.is_dir:
                raise AlreadyExists(f"{path} exists and is a file")
            if not exist_ok:
                raise AlreadyExists(f"{path} already exists")
            return
        if not parents and parent_of(path) != "/":
            up = self.stat(parent_of(path))
            if up is None or not up.is_dir:
                raise NotFound(f"parent of {path} does not exist")
        self._master("Mkdir", pb.MkdirRequest(path=path, parents=True, exist_ok=True), shard=self._shard_of(path))

    def rmdir(self, path: str) -> None:
        path = _check(path)
        if len(self._shards) == 1:
            self._master("Rmdir", pb.PathRequest(path=path))
            return
        if self.ls(path):  # every shard's entries (NotFound when no shard has it)
            exc = L2fsError(f"{path}: directory not empty")
            exc.errno = errno.ENOTEMPTY
            raise exc
        got = self._fan([functools.partial(self._master, "Rmdir", pb.PathRequest(path=path), None, s)
                         for s in range(len(self._shards))])
        errs = [r for r in got if isinstance(r, Exception) and not isinstance(r, NotFound)]
        if errs:
            raise errs[0]
        if all(isinstance(r, NotFound) for r in got):
            raise NotFound(f"{path}: no such directory")

    def rm(self, path: str) -> bool:
        """True if something was removed."""
        self._forget(path)
        path = _check(path)
        if len(self._shards) > 1:
            st = self.stat(path)
            if st is None:
                return False
            if st.is_dir:
                self.rmdir(path)
                return True
        return self._master("Delete", pb.PathRequest(path=path), shard=self._shard_of(path)).removed

    def rename(self, src: str, dst: str, *, overwrite: bool = True) -> None:
        """Atomic; overwrite=True replaces dst (POSIX rename semantics). In a sharded namespace a rename must
        stay on one shard: a file whose new path hashes to another shard, or a directory, raises CrossShard
        (errno EXDEV: copy and delete instead, as `mv` does by itself)."""
        self._forget(src, dst)
        src, dst = _check(src), _check(dst)
        shard = self._shard_of(src)
        if shard != self._shard_of(dst) and len(self._shards) > 1:
            if self.stat(src) is None:
                raise NotFound(f"{src}: no such file or directory")
            raise CrossShard(f"cannot rename {src} to {dst}: they belong to different l2fs shards "
                             f"(copy and delete instead)")
        try:
            self._master("Rename", pb.RenameRequest(src=src, dst=dst, overwrite=overwrite), shard=shard)
        except NotFound:
            if len(self._shards) > 1 and self._dir_elsewhere(src) is not None:
                raise CrossShard(f"cannot rename directory {src} in a sharded l2fs: its files would change "
                                 f"shards (copy and delete them instead)") from None
            raise

    def report(self) -> ClusterReport:
        """Every shard's report merged: files summed; a worker (registered with every shard) is alive when
        every shard that knows it says so."""
        got = self._fan([functools.partial(self._master, "Report", pb.Empty(), None, s)
                         for s in range(len(self._shards))])
        by_id: dict[str, WorkerInfo] = {}
        files = dups = 0
        for r in got:
            if isinstance(r, Exception):
                raise r
            files, dups = files + r.files, dups + r.duplicate_files
            for w in r.workers:
                seen = by_id.get(w.worker_id)
                if seen is None:
                    by_id[w.worker_id] = WorkerInfo(w.worker_id, w.node_id, w.address, w.alive, w.capacity, w.used,
                                                    w.blocks)
                else:
                    seen.alive = seen.alive and w.alive
        ws = [by_id[k] for k in sorted(by_id)]
        alive = [w for w in ws if w.alive]
        return ClusterReport(workers=ws, files=files, capacity=sum(w.capacity for w in alive),
                             used=sum(w.used for w in alive), duplicate_files=dups)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            pool, self._pool = self._pool, None
            spool, self._shard_pool = self._shard_pool, None
            channels, self._channels = self._channels, []
        for p in (pool, spool):
            if p is not None:
                p.shutdown(wait=False, cancel_futures=True)
        self._data.close()
        for ch in channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def combine_prefix(parts: Sequence[Sequence[int]], counts: Sequence[Any], total: int) -> int:
    """A chain's leading hits from per-shard PrefixLookup answers: parts[k] = the chain indexes shard k was
    asked (in order), counts[k] = how many of them lead (or the exception its call raised). The chain's first
    miss is the earliest of the shards' first misses; a failed shard misses at its first path. Raises only
    when every shard failed."""
    errs = [c for c in counts if isinstance(c, Exception)]
    if errs and len(errs) == len(counts):
        raise errs[0]
    if any(isinstance(c, Exception) and not isinstance(c, Unavailable) for c in counts):
        raise next(c for c in counts if isinstance(c, Exception) and not isinstance(c, Unavailable))
    first_miss = [idx[0] if isinstance(n, Exception) else idx[n]
                  for idx, n in zip(parts, counts, strict=True) if isinstance(n, Exception) or n < len(idx)]
    return min(first_miss, default=total)


def _chain(first: Any, rest: Any) -> Any:
    yield first
    yield from rest


# Calls whose deadline is the client timeout. A call waiting for a pool thread (all busy on a hung worker)
# must not wait longer than that: reads become misses, metadata calls raise Unavailable. Measured before:
# 64 concurrent gets against a SIGSTOP'd worker took up to 8 s with a 2 s timeout (tests/reliability).
# get_many is left out: the sync call has no overall deadline (each get has its own), so a big batch may
# legitimately take longer than one timeout.
_READS = ("get", "get_into", "locate_many")  # a late locate_many is a no-op hint too: None
_BOUNDED = (*_READS, "exists", "stat", "stat_many", "prefix_lookup", "ls", "report")


def _async(name: str) -> Callable:
    sync = getattr(Client, name)

    @functools.wraps(sync)
    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        if name in _READS:  # the read's own deadline starts now, not when a pool thread frees up
            kwargs["_deadline"] = time.monotonic() + self._client.timeout
        fut = loop.run_in_executor(self._pool, functools.partial(getattr(self._client, name), *args, **kwargs))
        if name not in _BOUNDED:
            return await fut
        try:
            return await asyncio.wait_for(fut, self._client.timeout + 0.25)
        except TimeoutError:
            if name in _READS:
                return None
            raise Unavailable(f"l2fs {name}: no answer within the {self._client.timeout}s deadline") from None

    return method


class AsyncClient:
    """asyncio twin of Client with the same methods as coroutines (same arguments and conventions).

    The sync client is thread-safe, so each call runs it on a private thread pool: the event loop never
    blocks on gRPC or disk I/O.
    """

    def __init__(self, master: str | None = None, *, node_id: str | None = None, token: str | None = None,
                 tls_ca: str | None = None, timeout: float = 2.0, short_circuit: bool = True,
                 data_plane: bool | None = None, max_workers: int = 16) -> None:
        self._client = Client(master, node_id=node_id, token=token, tls_ca=tls_ca, timeout=timeout,
                              short_circuit=short_circuit, data_plane=data_plane)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="l2fs-async")

    @property
    def sync(self) -> Client:
        """The underlying synchronous client."""
        return self._client

    put = _async("put")
    get = _async("get")
    get_into = _async("get_into")
    locate_many = _async("locate_many")
    put_many = _async("put_many")
    get_many = _async("get_many")
    exists = _async("exists")
    stat = _async("stat")
    stat_many = _async("stat_many")
    prefix_lookup = _async("prefix_lookup")
    ls = _async("ls")
    mkdir = _async("mkdir")
    rmdir = _async("rmdir")
    rm = _async("rm")
    rename = _async("rename")
    report = _async("report")

    async def close(self) -> None:
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
