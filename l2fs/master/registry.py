"""The worker registry: registration with block reports, heartbeats, block moves/removals, the sweeper."""

from __future__ import annotations

import time
from typing import Any

import grpc

from l2fs.common import (
    BLOCK_ID,
    PathError,
    RpcError,
    capability,
    norm_path,
    valid_address,
)
from l2fs.common.protocol import HOLDER_CAPABILITIES, SIZED_CAPABILITIES, peer_version, version_mismatch
from l2fs.master.state import (
    _MAC_REJECT,
    _SEAL_REJECT,
    _UNSEALED,
    CAPACITY,
    DROPPED,
    USED,
    WORKERS_ALIVE,
    FileEntry,
    WorkerEntry,
    _rpc,
    log,
)
from l2fs.master.writes import WriteOps
from l2fs.proto import l2fs_pb2 as pb

FORGET_DEAD_AFTER = 3600.0  # seconds a dead worker's entry is kept (its owner binding, its Report line)
# Worker ids one node-bound credential may hold at once (alive or dead): a node runs one worker, a few while
# it is replaced; each entry costs master memory and gets a data key. Past it the credential's oldest dead
# entry gives way; with none dead the registration is refused.
WORKERS_PER_NODE_CREDENTIAL = 8


class RegistryOps(WriteOps):
    """Worker-facing RPCs and the sweeper thread that expires workers and allocations."""

    forget_dead_after = FORGET_DEAD_AFTER  # l2fs master --forget-dead-after sets it on the service


    def _drop_worker_files(self, w: WorkerEntry, reason: str) -> None:
        for path in list(w.files):
            self._drop_file(path)
            DROPPED.labels(reason).inc()
        w.files.clear()


    def _update_gauges(self) -> None:
        alive = [w for w in self.workers.values() if w.alive]
        WORKERS_ALIVE.set(len(alive))
        CAPACITY.set(sum(w.capacity for w in alive))
        USED.set(sum(w.used for w in alive))


    def _sweeper(self) -> None:
        """Marks a worker dead within heartbeat_timeout of its failure and drops its locations at once.

        The failure happened up to one heartbeat interval after the last heartbeat, so a worker is dead
        once it has been silent for timeout - interval (but at least two intervals)."""
        period = max(0.02, min(0.1, self.heartbeat_timeout / 20))
        last = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            paused, last = now - last > period + 1.0, now
            with self.lock:
                if paused:  # the master itself stalled (SIGSTOP, swap): silence was ours, not theirs
                    for w in self.workers.values():
                        w.last_seen = max(w.last_seen, now - w.interval)
                forget = []
                for w in self.workers.values():
                    limit = max(self.heartbeat_timeout - w.interval - period, 2 * w.interval)
                    if w.alive and now - w.last_seen > limit:
                        w.alive = False
                        self._drop_worker_files(w, "worker_dead")
                        log.warning("worker %s (%s) dead: no heartbeat for %.1fs", w.worker_id, w.address,
                                    now - w.last_seen)
                    elif not w.alive and now - w.last_seen > self.forget_dead_after:
                        forget.append(w.worker_id)
                for wid in forget:  # dead for long: a stopped node's id must not list (and cost) for ever
                    del self.workers[wid]
                    log.info("forgot worker %s: dead for over %.0fs", wid, self.forget_dead_after)
                self._update_gauges()
                expired = self._expire_allocations(now)
            for wid, ids in expired.items():  # their writers gave up long ago: free whatever got sealed
                log.info("abandoning %d uncommitted block(s) on worker %s", len(ids), wid)
                self._tell_worker(wid, "DeleteBlocks", pb.BlockIds(block_ids=ids))



    def _check_owner(self, context: Any, worker_id: str, claim: bool = False, node_id: str | None = None) -> str:
        """A worker id belongs to the credential that registered it: another worker-role token may not
        heartbeat, report for or (while it is alive) re-register it. Returns the caller's credential name.
        That ownership lives in master memory (after a master restart the first registration claims the id);
        a credential with a "node" in the tokens file is also bound statically to its node's worker ids
        (Credential.may_be_worker), which no restart forgets."""
        cred = self.creds.caller(context)
        if cred is None:
            return ""
        if not cred.may_be_worker(worker_id, node_id):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"credential {cred.name!r} is bound to node {cred.node!r}: it may not act as worker "
                           f"{worker_id!r}" + (f" of node {node_id!r}" if node_id is not None else ""))
        with self.lock:
            w = self.workers.get(worker_id)
            if w is not None and w.owner and w.owner != cred.name and (w.alive or not claim):
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"worker {worker_id!r} is registered by another credential than {cred.name!r}")
        return cred.name


    def _make_room(self, context: Any, owner: str, worker_id: str) -> None:
        """A node-bound credential registering one more worker id: within WORKERS_PER_NODE_CREDENTIAL entries
        (its oldest dead one dropped to make room), else RESOURCE_EXHAUSTED (lock held). Without a bound,
        one node's credential registered any number of ids, each given a data key and never dropped."""
        cred = self.creds.caller(context)
        if cred is None or not cred.node:
            return
        mine = [w for w in self.workers.values() if w.owner == owner]
        if len(mine) < WORKERS_PER_NODE_CREDENTIAL:
            return
        dead = [w for w in mine if not w.alive]
        if not dead:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"credential {owner!r} already has {len(mine)} live worker ids (at most "
                           f"{WORKERS_PER_NODE_CREDENTIAL}): not registering {worker_id!r}")
        oldest = min(dead, key=lambda w: w.last_seen)
        del self.workers[oldest.worker_id]
        log.info("forgot dead worker %s: its credential %s registers %s", oldest.worker_id, owner, worker_id)

    @_rpc
    def RegisterWorker(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:  # noqa: N802
        if not request.worker_id or not request.address:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
        if len(request.worker_id) > 256 or any(ord(ch) < 33 for ch in request.worker_id):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "worker_id must be 1-256 printable characters")
        if not valid_address(request.address):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"worker address must be host:port, got {request.address[:100]!r}")
        if request.data_address and not valid_address(request.data_address):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"worker data_address must be host:port, got {request.data_address[:100]!r}")
        sock = request.domain_socket
        if sock and (not sock.startswith("/") or len(sock.encode()) > 107 or any(ord(ch) < 32 for ch in sock)):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"worker domain_socket must be an absolute path under 108 bytes, got {sock[:100]!r}")
        why = version_mismatch("master", f"worker {request.worker_id}", request.protocol_version,
                               request.min_protocol_version, mine=self.protocol_version,
                               my_min=self.min_peer_version)
        if why:
            log.error("refusing registration: %s", why)
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, why)
        reject: list[str] = []
        foreign = unverified = bad_seal = unsealed = 0
        remote_deletes: list[tuple[str, str, str | None]] = []
        with self.lock:
            owner = self._check_owner(context, request.worker_id, claim=True,  # under the lock: no race
                                      node_id=request.node_id or request.worker_id)
            old = self.workers.get(request.worker_id)
            if old is None and not request.continuation:
                self._make_room(context, owner, request.worker_id)
            if request.continuation:  # more reports of the registration this worker just made
                if old is None or not old.alive or old.address != request.address:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"worker {request.worker_id}: report continues no live registration; "
                                   f"register again")
                w = old
                w.last_seen = time.monotonic()
                w.blocks += len(request.blocks)
            else:
                if old is not None:  # a re-registration replaces the old one cleanly
                    self._drop_worker_files(old, "reregistered")
                w = WorkerEntry(request.worker_id, request.node_id or request.worker_id, request.address,
                                request.capacity, request.used, len(request.blocks), time.monotonic(),
                                data_address=request.data_address, owner=owner,
                                domain_socket=request.domain_socket,
                                caps=self.minter is not None and self.protocol_version >= 3
                                and peer_version(request.protocol_version) >= 3,
                                seals=self.sealing and peer_version(request.protocol_version) >= 4,
                                sized=self.minter is not None and self.protocol_version >= SIZED_CAPABILITIES
                                and peer_version(request.protocol_version) >= SIZED_CAPABILITIES,
                                holders=self.minter is not None and self.protocol_version >= HOLDER_CAPABILITIES
                                and peer_version(request.protocol_version) >= HOLDER_CAPABILITIES)
                self.workers[request.worker_id] = w
            data_key = self.minter.key_for(w.worker_id) if self.minter is not None and w.caps else b""
            for b in request.blocks:
                if not BLOCK_ID.match(b.block_id):
                    continue  # not a block any worker of ours could hold: nothing to publish or delete
                if self.block_key is not None and not self.block_key.verify(b.block_id, w.worker_id, b.size):
                    # never allocated to this worker for this size (made up, another worker's, resized, or from
                    # before the key): not published, but not deleted either, so a master with a wrong key
                    # cannot wipe a cluster's cache; the worker evicts it as cold in time
                    unverified += 1
                    continue
                self._uncharge_allocation(b.block_id)
                if b.block_id in self.abandoned or self.allocations.pop(b.block_id, None) is not None:
                    self._abandon(b.block_id)  # sealed, never committed: its put did not return success
                    reject.append(b.block_id)
                    continue
                has_op, new_path = self.pending.lookup(w.worker_id, b.block_id)
                if has_op and new_path is None:  # deleted or overwritten while the worker was away
                    reject.append(b.block_id)
                    continue
                if self.block_key is not None and self.sealing:
                    mac = self._seal_of(w.worker_id, b)
                    if not mac:  # never sealed: committed just before a master restart, or cached before seals;
                        unsealed += 1  # its id verified, so it is this worker's own allocation: safe to delete
                        reject.append(b.block_id)
                        continue
                    if not capability.seal_ok(self.block_key.key, mac, w.worker_id, b.block_id, b.size, b.crc32c,
                                              b.path):
                        bad_seal += 1  # altered (bytes and CRC), or a seal of another key: neither published
                        continue  # nor deleted, as for an id that does not verify
                try:
                    path = norm_path(new_path if has_op and new_path is not None else b.path)  # renamed meanwhile
                except PathError:
                    reject.append(b.block_id)
                    continue
                if not self._owns(path):  # another shard's block (a worker with a wrong master list): neither
                    foreign += 1  # ours to publish nor to delete
                    continue
                cur = self.files.get(path)
                if cur is not None and cur.block_id != b.block_id:
                    if cur.mtime >= b.mtime:  # keep the newer copy of a path
                        reject.append(b.block_id)
                        continue
                    self._drop_file(path)
                    remote_deletes.append((cur.worker_id, cur.block_id, None))
                try:
                    self._add_file(path, FileEntry(b.block_id, w.worker_id, b.size, b.crc32c, b.mtime,
                                                   b.order_hint, b.local_path))
                except RpcError:  # path clashes with a directory: that block cannot be published
                    reject.append(b.block_id)
            self._update_gauges()
        # a displaced older copy on another worker must not come back with that worker's next report either
        self._record(remote_deletes)
        self._push_wake.set()  # this worker (and those) get their pending changes now
        log.info("registered worker %s node=%s at %s: %d blocks (%d rejected)", request.worker_id,
                 request.node_id, request.address, len(request.blocks), len(reject))
        if unverified:
            _MAC_REJECT.inc(unverified)
            log.warning("worker %s reported %d block(s) whose id does not verify for it and their size (not "
                        "allocated by a master with this block key: forged, another worker's, resized, or written "
                        "before the key was set): not published", request.worker_id, unverified)
        if bad_seal:
            _SEAL_REJECT.inc(bad_seal)
            log.warning("worker %s reported %d block(s) whose seal does not verify over the reported size and CRC32C "
                        "(altered on the worker, or sealed by a master with another key): not published",
                        request.worker_id, bad_seal)
        if unsealed:
            _UNSEALED.inc(unsealed)
            log.info("worker %s reported %d unsealed block(s) (committed just before a master restart, or from before "
                     "seals): not published, deleted", request.worker_id, unsealed)
        if foreign:
            log.warning("worker %s reported %d block(s) of other shards (this master is shard %d/%d): is its "
                        "master list the cluster's?", request.worker_id, foreign, self.shard, self.shards)
        return pb.RegisterResponse(delete_blocks=reject, protocol_version=self.protocol_version, data_key=data_key)


    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:  # noqa: N802
        self._check_owner(context, request.worker_id)
        with self.lock:
            w = self.workers.get(request.worker_id)
            if w is None or not w.alive:
                return pb.HeartbeatResponse(reregister=True)
            w.last_seen = time.monotonic()
            w.capacity, w.used, w.blocks = request.capacity, request.used, request.blocks
            w.pending = 0  # the worker's own figure now includes what landed
            if request.interval > 0:
                w.interval = min(request.interval, self.heartbeat_timeout / 2)
        return pb.HeartbeatResponse(reregister=False)


    @_rpc
    def RemoveBlocks(self, request: pb.BlocksRemoved, context: Any) -> pb.Empty:  # noqa: N802
        self._check_owner(context, request.worker_id)
        with self.lock:
            for bid in request.block_ids:
                path = self.blocks.get(bid)
                if path is not None and self.files[path].worker_id == request.worker_id:
                    self._drop_file(path)
                    DROPPED.labels(request.reason or "removed").inc()
        return pb.Empty()


    @_rpc
    def MoveBlocks(self, request: pb.BlocksMoved, context: Any) -> pb.Empty:  # noqa: N802
        if len(request.block_ids) != len(request.local_paths):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids and local_paths differ in length")
        self._check_owner(context, request.worker_id)
        with self.lock:
            for bid, lp in zip(request.block_ids, request.local_paths, strict=True):
                path = self.blocks.get(bid)
                if path is not None and self.files[path].worker_id == request.worker_id:
                    self.files[path].local_path = lp
        return pb.Empty()


    @_rpc
    def Report(self, request: pb.Empty, context: Any) -> pb.ReportResponse:  # noqa: N802
        with self.lock:
            ws = [pb.WorkerStatus(worker_id=w.worker_id, node_id=w.node_id, address=w.address, alive=w.alive,
                                  capacity=w.capacity, used=w.used, blocks=w.blocks)
                  for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]
            return pb.ReportResponse(workers=ws, files=len(self.files), duplicate_files=self.duplicates)
