"""The worker's gRPC service: block writes and reads (streamed), short-circuit reserve/adopt, and the
master's maintenance calls. Storage rules live in `l2fs.worker.store`; this module maps them onto RPCs."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from l2fs.common import READERS, WORKERS, WRITERS, RpcError, check_block_id, norm_path, rpc_handler
from l2fs.common.capability import MASTER_MD, READ, WRITE, DataGate, holder_of
from l2fs.common.protocol import each
from l2fs.proto import l2fs_pb2 as pb
from l2fs.proto import l2fs_pb2_grpc as pbg
from l2fs.worker.store import BYTES_READ, READ_HITS, READ_MISSES, Store, VerifiedFrames

RPC_LATENCY = Histogram("l2fs_worker_rpc_seconds", "Worker RPC latency", ["method"],
                        buckets=(.0001, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5))

REVERIFY_SKIPPED = Counter("l2fs_worker_reverify_skipped_total",
                           "ReportCorrupt calls for a block re-verified less than REVERIFY_INTERVAL s before")
REVERIFY_INTERVAL = 10.0  # seconds: a reported block is re-read at most this often
STREAMS_REFUSED = Counter("l2fs_worker_streams_refused_total",
                          "Block streams (ReadBlock, WriteBlock) refused or cancelled", ["reason"])
# Each block stream holds one of the worker's gRPC threads (32) for as long as its caller takes: 40 unread
# ReadBlock streams held them all, and same-node puts and the master's SealBlocks/DeleteBlocks timed out. So
# at most STREAMS run at once (the other threads stay for the unary calls), STREAMS_PER_PEER from one peer
# address, and a stream slower than STREAM_MIN_RATE bytes/s (after STREAM_GRACE s) is cancelled.
STREAMS = 24
STREAMS_PER_PEER = 16
STREAM_MIN_RATE = 1 << 20
STREAM_GRACE = 10.0
REVERIFY_MEMORY = 4096  # blocks remembered for REVERIFY_INTERVAL (bounded: oldest half dropped when full)

_rpc = rpc_handler(RPC_LATENCY)

# Which roles may call which RPC (TokenInterceptor, before the message is read): the master's maintenance
# calls need a worker-role token (the master sends one), block writes an engine or admin token.
WORKER_POLICY = {
    **dict.fromkeys(("WriteBlock", "ReserveLocal", "AdoptLocal", "ReserveLocalMany", "AdoptLocalMany",
                     "ReleaseLocal"), WRITERS),
    **dict.fromkeys(("ReadBlock", "Touch", "ReportCorrupt"), READERS),
    **dict.fromkeys(("DeleteBlocks", "SetPaths", "SealBlocks"), WORKERS),
}


class StreamGate:
    """Admission of block streams: a total, a per-peer-address and a per-holder bound (the credential a c2
    capability names: one credential from many addresses), and a watchdog that cancels a stream past its
    deadline (STREAM_GRACE + size / STREAM_MIN_RATE), which frees its thread."""

    def __init__(self, total: int = STREAMS, per_peer: int = STREAMS_PER_PEER, grace: float = STREAM_GRACE,
                 min_rate: float = STREAM_MIN_RATE) -> None:
        self.total, self.per_peer, self.grace, self.min_rate = total, per_peer, grace, min_rate
        self._lock = threading.Lock()
        self._per: dict[str, int] = {}
        self._live: dict[int, tuple[Any, float]] = {}  # id(context) -> (context, deadline)
        self._watchdog: threading.Thread | None = None

    @staticmethod
    def _peer(context: Any) -> str:
        return str(context.peer()).rsplit(":", 1)[0]

    def enter(self, context: Any, size: int, cap: str = "") -> tuple[str, ...]:
        """Admit a stream of about `size` bytes whose (verified) capability is `cap`, or RESOURCE_EXHAUSTED;
        returns the keys to leave() with."""
        holder = holder_of(cap) if cap else None
        keys = (self._peer(context),) + ((f"holder:{holder}",) if holder else ())
        with self._lock:
            if len(self._live) >= self.total or any(self._per.get(k, 0) >= self.per_peer for k in keys):
                STREAMS_REFUSED.labels("busy").inc()
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"worker busy: {len(self._live)} block streams ({self._per.get(keys[0], 0)} from "
                               f"{keys[0]}" + (f", {self._per.get(keys[1], 0)} of this credential" if holder else "")
                               + f"; at most {self.total}, {self.per_peer} per peer and per credential)")
            for k in keys:
                self._per[k] = self._per.get(k, 0) + 1
            self._live[id(context)] = (context, time.monotonic() + self.grace + max(0, size) / self.min_rate)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="l2fs-stream-watchdog", daemon=True)
                self._watchdog.start()
        return keys

    def leave(self, context: Any, keys: tuple[str, ...]) -> None:
        with self._lock:
            if self._live.pop(id(context), None) is None:
                return
            for k in keys:
                n = self._per.get(k, 1) - 1
                if n > 0:
                    self._per[k] = n
                else:
                    self._per.pop(k, None)

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                late = [ctx for ctx, deadline in self._live.values() if deadline < now]
            for ctx in late:
                STREAMS_REFUSED.labels("slow").inc()
                ctx.cancel()  # the handler's pending write fails; its generator closes and leave() runs


class WorkerService(pbg.WorkerServicer):
    """`report_now` wakes the registration loop, so blocks a call removed (evicted, corrupt) or moved reach
    the master at once instead of at the next heartbeat."""

    def __init__(self, store: Store, report_now: Callable[[], None], gate: DataGate | None = None) -> None:
        """`gate`: the worker's capability gate. In capability mode the block calls need the block's
        capability on top of the caller's token (checked first, by TokenInterceptor): a read one for
        ReadBlock, a write one bound to the path for WriteBlock, ReserveLocal* and AdoptLocal*."""
        self.store = store
        self._report_now = report_now
        self.gate = gate
        self._reverified: dict[str, float] = {}  # block id -> when ReportCorrupt last re-read it
        self.streams = StreamGate()

    def _need(self, cap: str, op: str, bid: str, path: str = "", size: int | None = None) -> None:
        """PERMISSION_DENIED unless `cap` lets the caller `op` block `bid` (a no-op in token mode).

        In cap mode Touch and ReportCorrupt need each block's read capability and ReleaseLocal the
        reservation's write capability (BlockIds.capabilities/paths), so a token alone can neither keep
        blocks warm, nor make the worker re-read them, nor cancel another client's write."""
        if self.gate is None or (self.gate.ready and not self.gate.cap_mode):
            return
        why = self.gate.check(cap, op, bid, path, size)  # a write's: the size it declares (bound when sized)
        if why:
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, f"block {bid}: {why}", "EACCES")

    @_rpc
    def WriteBlock(self, request_iterator: Iterator[pb.WriteChunk], context: Any) -> pb.WriteResult:  # noqa: N802
        it = iter(request_iterator)
        first = next(it, None)
        if first is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "empty write stream")
        bid = check_block_id(first.block_id)
        path = norm_path(first.path)
        self._need(first.capability, WRITE, bid, path, first.size)
        peer = self.streams.enter(context, first.size, first.capability)
        try:
            b = self.store.receive(bid, path, first.size, first.order_hint,
                                   (m.data for m in itertools.chain([first], it) if m.data))
        finally:
            self.streams.leave(context, peer)
            self._report_now()  # reserving or sealing may have evicted
        return pb.WriteResult(block_id=bid, size=b.size, crc32c=b.crc32c, local_path=self.store.local_path(b))

    def ReadBlock(self, request: pb.ReadRequest, context: Any) -> Iterator[pb.ReadChunk]:  # noqa: N802
        t0 = time.perf_counter()
        try:
            bid = check_block_id(request.block_id)
            self._need(request.capability, READ, bid)
        except RpcError as e:
            context.abort(e.code, str(e))
        # Stream frame by frame (memory per read = one frame, not the whole block), checksumming as we go; a
        # mismatch found at the end aborts the stream (the client discards what it got) and drops the block.
        opened = self.store.open_block(bid)
        if opened is None:
            READ_MISSES.inc()
            self._report_now()
            context.abort(grpc.StatusCode.NOT_FOUND, f"block {bid} not found (missing or failed checksum)")
            return  # abort raises; this tells the type checker
        b, path, f = opened
        try:
            peer = self.streams.enter(context, b.size, request.capability)
        except RpcError as e:
            f.close()
            context.abort(e.code, str(e))
            return
        try:
            with f:
                frames = VerifiedFrames(b, f)
                for i, data in enumerate(frames):
                    yield pb.ReadChunk(size=b.size, crc32c=b.crc32c, data=data) if i == 0 else pb.ReadChunk(data=data)
        finally:
            self.streams.leave(context, peer)
        if not frames.ok:
            READ_MISSES.inc()
            self.store.drop_damaged(bid, path)
            self._report_now()
            context.abort(grpc.StatusCode.DATA_LOSS, f"block {bid} failed verification while streaming")
        self.store.touch(bid)
        READ_HITS.inc()
        BYTES_READ.inc(b.size)
        RPC_LATENCY.labels("ReadBlock").observe(time.perf_counter() - t0)

    @_rpc
    def ReserveLocal(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:  # noqa: N802
        resp = self._reserve(request)
        self._report_now()
        return resp

    @_rpc
    def AdoptLocal(self, request: pb.AdoptRequest, context: Any) -> pb.WriteResult:  # noqa: N802
        resp = self._adopt(request)
        self._report_now()  # sealing may have evicted
        return resp

    def _each_allowed(self, request: pb.BlockIds, op: str) -> list[str]:
        """The request's block ids, once each has passed `_need` (all or nothing: one bad capability refuses
        the call, as a read with it would be refused)."""
        n = len(request.block_ids)
        bids = [check_block_id(b) for b in request.block_ids]  # malformed input first: INVALID_ARGUMENT
        if self.gate is not None and self.gate.cap_mode and len(request.capabilities) != n:
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{n} block ids but {len(request.capabilities)} capabilities", "EACCES")
        if request.paths and len(request.paths) != n:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids and paths differ in length")
        for i, bid in enumerate(bids):
            cap = request.capabilities[i] if i < len(request.capabilities) else ""
            # a write capability (ReleaseLocal) binds the size: the reservation's (none: nothing to release)
            size = self.store.reserved_size(bid) if op == WRITE else None
            if op == WRITE and size is None:
                continue  # nothing reserved under that id: releasing it changes nothing
            self._need(cap, op, bid, self._cap_path(request.paths[i]) if request.paths else "", size)
        return bids

    @_rpc
    def Touch(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        for bid in self._each_allowed(request, READ):
            self.store.touch(bid)
            READ_HITS.inc()
        return pb.Empty()

    @_rpc
    def ReportCorrupt(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        """Re-verify (and drop) blocks a client found bad; a block is re-read at most once per
        REVERIFY_INTERVAL s, so repeated reports cost a dict lookup, not a read of the block each."""
        now = time.monotonic()
        for bid in self._each_allowed(request, READ):
            last = self._reverified.get(bid)
            if last is not None and now - last < REVERIFY_INTERVAL:
                REVERIFY_SKIPPED.inc()
                continue
            if len(self._reverified) >= REVERIFY_MEMORY:  # forget the oldest half (dicts keep insertion order)
                for old in list(itertools.islice(self._reverified, REVERIFY_MEMORY // 2)):
                    del self._reverified[old]
            self._reverified[bid] = now
            self.store.verify(bid)  # re-checked here: a client alone cannot get data deleted
        self._report_now()
        return pb.Empty()

    def _from_master(self, context: Any, method: str, request: Any) -> None:
        """PERMISSION_DENIED unless the call carries the master's MAC for this request (cap mode): a worker
        token alone, which every worker holds, must not delete or repoint another worker's blocks."""
        if self.gate is None:
            return
        presented = next((v for k, v in context.invocation_metadata() if k == MASTER_MD), "")
        why = self.gate.check_master(presented if isinstance(presented, str) else "", method,
                                     request.SerializeToString())
        if why:
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, why, "EACCES")

    @_rpc
    def DeleteBlocks(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        bids = [check_block_id(bid) for bid in request.block_ids]  # malformed input first: INVALID_ARGUMENT
        self._from_master(context, "DeleteBlocks", request)
        for bid in bids:
            self.store.delete(bid)
        return pb.Empty()

    @_rpc
    def SetPaths(self, request: pb.SetPathsRequest, context: Any) -> pb.Empty:  # noqa: N802
        if len(request.block_ids) != len(request.paths):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids and paths differ in length")
        self._from_master(context, "SetPaths", request)
        if request.seals and len(request.seals) != len(request.block_ids):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids and seals differ in length")
        seals = list(request.seals) or [""] * len(request.block_ids)
        for bid, path, seal in zip(request.block_ids, request.paths, seals, strict=True):
            self.store.set_path(check_block_id(bid), norm_path(path), seal)
        return pb.Empty()

    @_rpc
    def SealBlocks(self, request: pb.SealRequest, context: Any) -> pb.Empty:  # noqa: N802
        """The master's seal MACs of committed blocks, kept in the manifest and reported at registration (a
        restarted master publishes only blocks whose seal verifies). A block committed with a CRC32C other
        than the one this worker computed is dropped as corrupt and reported at once."""
        if not len(request.block_ids) == len(request.crc32cs) == len(request.seals):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "block_ids, crc32cs and seals differ in length")
        ids = [check_block_id(bid) for bid in request.block_ids]
        self._from_master(context, "SealBlocks", request)
        if self.store.seal_blocks(zip(ids, request.crc32cs, request.seals, strict=True)) < len(ids):
            self._report_now()  # some were dropped (or are gone): the master hears of it now
        return pb.Empty()

    # ---------- batched short-circuit writes (one RPC per put batch, each item on its own) ----------

    def _cap_path(self, raw: str) -> str:
        """A reservation's path, as its write capability was minted for ("" when not sent: older client)."""
        return norm_path(raw) if raw else ""

    def _reserve(self, request: pb.ReserveRequest) -> pb.ReserveResponse:
        bid = check_block_id(request.block_id)
        self._need(request.capability, WRITE, bid, self._cap_path(request.path), request.size)
        i = self.store.reserve(bid, request.size, expires=True)
        return pb.ReserveResponse(tmp_path=str(self.store.dirs[i].tmp_file(bid)))

    def _adopt(self, request: pb.AdoptRequest) -> pb.WriteResult:
        bid = check_block_id(request.block_id)
        path = norm_path(request.path)
        self._need(request.capability, WRITE, bid, path, request.size)
        b = self.store.adopt(bid, path, request.size, request.crc32c, request.order_hint)
        return pb.WriteResult(block_id=bid, size=b.size, crc32c=b.crc32c, local_path=self.store.local_path(b))

    @_rpc
    def ReserveLocalMany(self, request: pb.ReserveManyRequest, context: Any) -> pb.ReserveManyResponse:  # noqa: N802
        try:
            return pb.ReserveManyResponse(items=each(list(request.items), self._reserve,
                                                     lambda err: pb.ReserveResponse(error=err)))
        finally:
            self._report_now()

    @_rpc
    def AdoptLocalMany(self, request: pb.AdoptManyRequest, context: Any) -> pb.WriteResults:  # noqa: N802
        try:
            return pb.WriteResults(items=each(list(request.items), self._adopt,
                                              lambda err: pb.WriteResult(error=err)))
        finally:
            self._report_now()  # sealing may have evicted

    @_rpc
    def ReleaseLocal(self, request: pb.BlockIds, context: Any) -> pb.Empty:  # noqa: N802
        """A same-node client could not open the reserved temp files (no hostPath in its pod, other uid):
        give the space back now instead of when the reservation expires."""
        for bid in self._each_allowed(request, WRITE):
            self.store.release(bid)
        return pb.Empty()
