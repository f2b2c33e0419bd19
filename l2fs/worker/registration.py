"""The worker's link to the master: register (re-report every sealed block), heartbeat, and report blocks
the store removed or moved. A master that restarted or dropped the worker asks it to re-register, which
is how the master's soft-state namespace is rebuilt.

With a path-hash sharded namespace (`--master "m0:p;m1:p"`) a worker keeps one link per shard (MasterLinks):
each shard's master gets only the blocks whose path hashes to it, its own heartbeats (capacity included, so
every master can place), and every removal (a master ignores block ids it does not hold)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from l2fs.common import PathError, auth_metadata, make_channel, norm_path, parse_masters, shard_of
from l2fs.common.protocol import MIN_PEER_VERSION, PROTOCOL_VERSION, peer_version, version_mismatch
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.worker.store import Store

log = logging.getLogger("l2fs.worker")


class VersionRefused(Exception):
    """This worker cannot work with the master's protocol version (the message names both)."""


class MasterLink:
    """Heartbeat/registration loop on its own thread; setting `wake` (or calling `wake()`) sends pending
    removals/moves now instead of at the next heartbeat."""

    REPORT_PART = 20_000  # block reports per registration message (~3 MB)

    def __init__(self, store: Store, *, master: str, tls_ca: str | None, token: str | Callable[[], str] | None,
                 worker_id: str,
                 node_id: str, address: str, data_address: str, heartbeat_interval: float,
                 wake: threading.Event | None = None, shard: tuple[int, int] = (0, 1),
                 domain_socket: str = "", on_data_key: Callable[[bytes], None] | None = None) -> None:
        """`on_data_key` gets each registration answer's data key (b"" = none): the worker's DataGate."""
        self.store = store
        self._on_data_key = on_data_key
        self.domain_socket = domain_socket  # advertised to same-node clients (fd-passing short-circuit)
        self.shard, self.shards = shard
        # removals/moves still to report to THIS master (the store's queues are drained into every link's)
        self.removed: list[tuple[str, str]] = []
        self.moved: list[tuple[str, str]] = []
        self.peers: list[MasterLink] = [self]  # the links sharing this store (one per shard)
        self.worker_id, self.node_id = worker_id, node_id
        self.address, self.data_address = address, data_address
        self.heartbeat_interval = heartbeat_interval
        self._token = token  # a str, or a FileToken re-read per call (a projected ServiceAccount token)
        self._wake = wake or threading.Event()
        self._stop = threading.Event()
        self.master = pbg.MasterStub(make_channel(master, tls_ca))
        self.registered = False
        self.master_version = 0  # the master's protocol version, once registered
        self.protocol_version, self.min_peer_version = PROTOCOL_VERSION, MIN_PEER_VERSION  # tests play old/new

    @property
    def _md(self) -> Any:
        return auth_metadata(self._token() if callable(self._token) else self._token)

    def wake(self) -> None:
        self._wake.set()

    def owns(self, path: str) -> bool:
        """Whether this link's master owns `path` (shard_of of the normalised path; a path the master would
        refuse anyway goes to shard 0, which rejects it)."""
        if self.shards <= 1:
            return True
        try:
            return shard_of(norm_path(path), self.shards) == self.shard
        except PathError:
            return self.shard == 0

    def _drain(self) -> None:
        """Move the store's pending removals/moves into every link's own queue (a move only to the link
        owning the block's path; a removed block's path is gone, so every shard hears of it)."""
        with self.store.lock:
            removed, self.store.removed = self.store.removed, []
            moved, self.store.moved = self.store.moved, []
            if not removed and not moved:
                return
            for link in self.peers:
                link.removed.extend(removed)
                for bid, lp in moved:
                    b = self.store.blocks.get(bid)
                    if b is not None and link.owns(b.path):
                        link.moved.append((bid, lp))

    def start(self) -> None:
        threading.Thread(target=self._loop, name="l2fs-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _send(self, blocks: list[pb.BlockReport], continuation: bool = False) -> pb.RegisterResponse:
        return self.master.RegisterWorker(pb.RegisterRequest(
            worker_id=self.worker_id, node_id=self.node_id, address=self.address,
            capacity=self.store.capacity, used=self.store.used, blocks=blocks, data_address=self.data_address,
            protocol_version=self.protocol_version, min_protocol_version=self.min_peer_version,
            continuation=continuation, domain_socket=self.domain_socket), timeout=30, metadata=self._md,
            # waits for the master to come back: a fail-fast call does not drive gRPC's reconnect, and
            # re-registration after a master restart took 4-15 s instead of <= 1 s (the backoff cap)
            wait_for_ready=True)

    def _register(self) -> None:
        """Register and report every sealed block: in parts of REPORT_PART blocks to a protocol-2 master (one
        message for 500,000 blocks passed gRPC's 64 MiB limit and the namespace never came back), whole to an
        older one (it would take each part for a fresh registration)."""
        self._drain()
        reports = self.store.reports()
        if self.shards > 1:
            reports = [r for r in reports if self.owns(r.path)]
        resp = self._send(reports[:self.REPORT_PART])
        why = version_mismatch("worker", "master", resp.protocol_version, 0, mine=self.protocol_version,
                               my_min=self.min_peer_version)
        if why:  # the master took our blocks but we cannot work with it: say so and keep asking
            log.error("%s", why)
            raise VersionRefused(why)
        self.master_version = peer_version(resp.protocol_version)
        if self._on_data_key is not None:
            self._on_data_key(resp.data_key)
        deletes = list(resp.delete_blocks)
        if len(reports) > self.REPORT_PART and self.master_version < 2:
            deletes = list(self._send(reports).delete_blocks)
        else:
            for i in range(self.REPORT_PART, len(reports), self.REPORT_PART):
                deletes += self._send(reports[i:i + self.REPORT_PART], continuation=True).delete_blocks
        for bid in deletes:
            self.store.delete(bid)
        with self.store.lock:
            self.removed.clear()  # the full report supersedes pending removals and moves
            self.moved.clear()
        self.registered = True
        log.info("registered with master as %s (%d blocks reported, master protocol %d, ours %d)",
                 self.worker_id, len(reports), self.master_version, self.protocol_version)

    def _report_removed(self) -> None:
        with self.store.lock:
            pending, self.removed = self.removed, []
        by_reason: dict[str, list[str]] = {}
        for bid, reason in pending:
            by_reason.setdefault(reason, []).append(bid)
        for reason, ids in by_reason.items():
            try:
                self.master.RemoveBlocks(pb.BlocksRemoved(worker_id=self.worker_id, block_ids=ids,
                                                          reason=reason),
                                         timeout=5, metadata=self._md)
            except grpc.RpcError:
                with self.store.lock:
                    self.removed.extend((b, reason) for b in ids)
                raise

    def _report_moved(self) -> None:
        with self.store.lock:
            pending, self.moved = self.moved, []
        try:
            self.master.MoveBlocks(pb.BlocksMoved(worker_id=self.worker_id, block_ids=[b for b, _ in pending],
                                                  local_paths=[p for _, p in pending]),
                                   timeout=5, metadata=self._md)
        except grpc.RpcError:
            with self.store.lock:
                self.moved[:0] = pending
            raise

    def _loop(self) -> None:
        """Heartbeat every interval; re-register when the master asks (it restarted or dropped us)."""
        next_hb = 0.0
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                self._drain()
                if self.removed:
                    self._report_removed()
                if self.moved:
                    self._report_moved()
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + self.heartbeat_interval
                    self.store.maybe_evict()
                    self.store.flush_access()
                    resp = self.master.Heartbeat(pb.HeartbeatRequest(
                        worker_id=self.worker_id, capacity=self.store.capacity, used=self.store.used,
                        blocks=len(self.store.blocks), interval=self.heartbeat_interval),
                        timeout=5, metadata=self._md)
                    if resp.reregister:
                        self.registered = False
                        continue
            except VersionRefused:
                self._stop.wait(5.0)
                continue
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and not self.registered:
                    log.error("master refused registration: %s", e.details())  # e.g. protocol versions
                    self._stop.wait(5.0)
                    continue
                if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    # not a network fault: this worker's credential (token, pod token, node) is refused
                    log.error("master refused this worker's credential (%s): %s; retrying", e.code(), e.details())
                else:
                    log.warning("master unreachable (%s); retrying", e.code())
                self.registered = self.registered and e.code() != grpc.StatusCode.UNAVAILABLE
                self._stop.wait(min(1.0, self.heartbeat_interval))
                continue
            self._wake.wait(max(0.0, next_hb - time.monotonic()))
            self._wake.clear()


class MasterLinks:
    """One MasterLink per shard of `master` ("m0a:p,m0b:p;m1:p": ';' between shards): same interface as a
    single link. Registered once every shard's master has taken this worker's report."""

    def __init__(self, store: Store, *, master: str, wake: threading.Event | None = None, **kw: Any) -> None:
        shards = parse_masters(master)
        self._wake = wake or threading.Event()
        self._stop = threading.Event()
        # one shard: the link waits on the worker's event itself (as before); several: each its own event,
        # set by a fan-out thread, so one link clearing it cannot hide a wake from another
        self.links = [MasterLink(store, master=",".join(addrs), wake=self._wake if len(shards) == 1 else None,
                                 shard=(i, len(shards)), **kw) for i, addrs in enumerate(shards)]
        for link in self.links:
            link.peers = self.links

    @property
    def registered(self) -> bool:
        return all(link.registered for link in self.links)

    @property
    def master_version(self) -> int:
        return min(link.master_version for link in self.links)

    def wake(self) -> None:
        self._wake.set()

    def _fan_wake(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            for link in self.links:
                link.wake()

    def start(self) -> None:
        for link in self.links:
            link.start()
        if len(self.links) > 1:
            threading.Thread(target=self._fan_wake, name="l2fs-wake", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for link in self.links:
            link.stop()
