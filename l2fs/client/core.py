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

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import grpc

from l2fs import envs
from l2fs.client.errors import InvalidPath, L2fsError, Unavailable, _error
from l2fs.client.types import _Shard
from l2fs.common import (
    PathError,
    auth_metadata,
    make_channel,
    norm_path,
    parse_masters,
    shard_of,
)
from l2fs.dataplane import DataClient, enabled_by_default
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg

log = logging.getLogger("l2fs.client")


_TRANSIENT = {grpc.StatusCode.UNAVAILABLE}


def _check(path: str) -> str:
    try:
        return norm_path(path)
    except PathError as e:
        exc = InvalidPath(str(e))
        exc.errno = getattr(errno, e.errno_name)
        raise exc from None


class ClientCore:
    """Connections, master calls with failover, shard fan-out, the location cache's forget, close."""

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
        local_writes: bool | None = None,
    ) -> None:
        master = master or envs.get("L2FS_MASTER")
        if not master:
            raise ValueError("no l2fs master: pass master='host:port' or set L2FS_MASTER")
        shards = parse_masters(master)
        self.masters = [m for addrs in shards for m in addrs]
        self.node_id = node_id if node_id is not None else envs.node_id()
        tok = token if token is not None else envs.get("L2FS_TOKEN")
        # a callable (l2fs.common.FileToken: a projected ServiceAccount token the kubelet rotates) is asked at
        # every call; `token` is then None (capabilities, not tokens, carry the data plane and fd requests)
        self._token_fn: Callable[[], str] | None = tok if callable(tok) else None
        self.token: str | None = None if callable(tok) else tok
        self.tls_ca = tls_ca if tls_ca is not None else envs.get("L2FS_TLS_CA")
        self.timeout = timeout
        self.short_circuit = short_circuit
        self.fd_passing = fd_passing
        self._local_writes = local_writes  # None: decided by the transport (the local_writes property)
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


    _LOCATED_MAX = 65536
    _MASTER_PAUSE = 1.0  # seconds lookups skip the master after it was unreachable
    _MASTER_ATTEMPT = 1.0  # seconds one call may wait for one of several masters before the next is tried

    def _pause_master(self, shard: int = 0) -> None:
        """A shard's master just failed a lookup: for a moment, answer its lookups from what we know, without
        waiting."""
        self._shards[shard].down_until = time.monotonic() + self._MASTER_PAUSE


    def _forget(self, *paths: str) -> None:
        with self._lock:
            for p in paths:
                try:
                    n = norm_path(p)
                    self._located.pop(n, None)
                    self._prefetched.pop(n, None)
                except PathError:
                    pass  # an invalid path was never remembered


    @property
    def local_writes(self) -> bool:
        """Whether same-node blocks are written through sealed memfds (Client's docstring says why: by default
        only when there is no data plane to write them over)."""
        return (not self.data_plane) if self._local_writes is None else self._local_writes

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


    def __enter__(self) -> Self:
        return self


    def __exit__(self, *exc: object) -> None:
        self.close()
