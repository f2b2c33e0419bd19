"""The write path: placement, allocations and their expiry, commits, deletes and renames."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import grpc

from l2fs.common import (
    Credential,
    RpcError,
    capability,
    check_batch,
    check_block_id,
    norm_path,
    parent_of,
)
from l2fs.common.protocol import each
from l2fs.master.pusher import PusherOps
from l2fs.master.state import _EXISTED, _PUBLISHED, Allocation, FileEntry, WorkerEntry, _rpc
from l2fs.proto import l2fs_pb2 as pb


class WriteOps(PusherOps):
    """Allocate/Commit (single and batched), Delete and Rename."""


    def _remember(self, memory: OrderedDict[str, Any], bid: str, value: Any) -> None:
        """Add to a bounded block-id memory (allocations, abandoned): the oldest entry goes first."""
        memory[bid] = value
        if len(memory) > self.ALLOC_MEMORY:
            old, _ = memory.popitem(last=False)
            if memory is self.allocations:
                self._uncharge_allocation(old)


    def _abandon(self, bid: str) -> None:
        self._remember(self.abandoned, bid, None)


    def _expire_allocations(self, now: float) -> dict[str, list[str]]:
        """Abandon allocations older than allocation_ttl (lock held); returns worker -> block ids to delete."""
        out: dict[str, list[str]] = {}
        while self.allocations:
            bid, (wid, expiry, *_) = next(iter(self.allocations.items()))
            if expiry > now:
                break
            self.allocations.popitem(last=False)
            self._uncharge_allocation(bid)
            self._abandon(bid)
            out.setdefault(wid, []).append(bid)
        return out



    @_rpc
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:  # noqa: N802
        self.creds.check_write(context, [(request.path, request.if_absent)])
        return self._allocate(request, self.creds.caller(context))


    @_rpc
    def AllocateMany(self, request: pb.AllocateManyRequest, context: Any) -> pb.AllocateManyResponse:  # noqa: N802
        """Allocate for a whole put batch under one lock hold; a failed item gets its error, the rest go on."""
        check_batch(len(request.items), "AllocateMany")
        # a batch with one path outside the caller's scope is refused whole
        self.creds.check_write(context, [(r.path, r.if_absent) for r in request.items])
        cred = self.creds.caller(context)
        with self.lock:
            items = each(list(request.items), lambda r: self._allocate(r, cred),
                         lambda err: pb.AllocateResponse(error=err))
        return pb.AllocateManyResponse(items=items)


    def _allocate(self, request: pb.AllocateRequest, cred: Credential | None = None) -> pb.AllocateResponse:
        """`cred`: the caller, remembered with the allocation: only it may commit the block, at this path and
        size (Allocation)."""
        path = norm_path(request.path)
        self._own(path)
        if path == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot write to '/'")
        if request.size > self.max_file_size:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"file of {request.size} bytes exceeds the max file size {self.max_file_size}", "EFBIG")
        with self.lock:
            if request.if_absent and path in self.files:
                return pb.AllocateResponse(exists=True)
            if path in self.children:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path} is a directory", "EISDIR")
            cur = self.files.get(path)
            self._check_quota([(path if cur is not None else None, None, cur.size if cur else 0),
                               (None, path, request.size)])
            w = self._place(request.size, request.node_id, set(request.exclude_workers))
            w.pending += request.size  # until the next heartbeat: spreads concurrent writers
            # the exact size asked for: the client writes (and the worker seals) exactly that many bytes
            bid = self.block_key.mint(w.worker_id, request.size) if self.block_key else uuid.uuid4().hex
            self._remember(self.allocations, bid, Allocation(w.worker_id, time.monotonic() + self.allocation_ttl,
                                                             cred.name if cred is not None else "", path,
                                                             request.size))
            charged = self._quotas_of(path) if self.quotas else []
            if charged:
                self._alloc_charge[bid] = (path, request.size)
                for q in charged:
                    self.quota_inflight[q] += request.size
            return pb.AllocateResponse(block_id=bid, worker=pb.Location(
                worker_id=w.worker_id, node_id=w.node_id, address=w.address, data_address=w.data_address,
                domain_socket=w.domain_socket,
                capability=self._cap(w, capability.WRITE, bid, path, request.size, self._holder(cred))))


    def _place(self, size: int, node_id: str, exclude: set[str]) -> WorkerEntry:
        """Local-first if the local worker has free room, else the most free; eviction makes room last."""
        alive = [w for w in self.workers.values()
                 if w.alive and w.capacity >= size and w.worker_id not in exclude]
        if not alive:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no live worker can hold {size} bytes", "ENOSPC")
        local = [w for w in alive if node_id and w.node_id == node_id]
        for w in local:
            if w.free >= size:
                return w
        roomy = [w for w in alive if w.free >= size]
        if roomy:
            return max(roomy, key=lambda w: w.free)
        if local:
            return local[0]
        return max(alive, key=lambda w: w.free)


    @_rpc
    def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:  # noqa: N802
        self.creds.check_write(context, [(request.path, request.if_absent)])
        orphans: list[tuple[str, str]] = []
        sealed: list[tuple[str, str]] = []
        try:
            return self._commit(request, orphans, sealed, self.creds.caller(context))
        finally:
            self._deliver_now(sealed)
            self._delete_orphans(orphans)


    @_rpc
    def CommitMany(self, request: pb.CommitManyRequest, context: Any) -> pb.CommitManyResponse:  # noqa: N802
        """Publish a whole put batch under one lock hold; each item is its own atomic, put-if-absent commit."""
        check_batch(len(request.items), "CommitMany")
        self.creds.check_write(context, [(r.path, r.if_absent) for r in request.items])
        orphans: list[tuple[str, str]] = []
        sealed: list[tuple[str, str]] = []
        with self.lock:
            cred = self.creds.caller(context)
            items = each(list(request.items), lambda r: self._commit(r, orphans, sealed, cred),
                         lambda err: pb.CommitResponse(error=err))
        self._deliver_now(sealed)
        self._delete_orphans(orphans)
        return pb.CommitManyResponse(items=items)


    def _delete_orphans(self, orphans: list[tuple[str, str]]) -> None:
        """Blocks that lost a put-if-absent race or were replaced: pending deletes (so a re-report never
        publishes them again), pushed in the background."""
        if not orphans:
            return
        try:
            self._record([(wid, bid, None) for wid, bid in orphans])
        except RpcError:  # the commit itself is done; the orphan is only kept until its worker re-registers
            return
        self._push_wake.set()


    def _check_allocation(self, request: pb.CommitRequest, path: str, cred: Credential | None) -> None:
        """PERMISSION_DENIED (nothing changes, the allocation stays open) unless the block is an open allocation
        of this caller, for this path, size and worker (lock held).

        Why: the id's MAC binds only worker and size, and `Stat` hands out every file's block id, so an engine
        of endpoint A committed endpoint B's blocks: onto a path A owns the master took them as A's lost-race
        orphans and had the worker delete them; under a fresh path it re-sealed them for A. An allocation the
        master no longer holds (forgotten past ALLOC_MEMORY, or made before a master restart) is refused the
        same way: that put fails, a miss, and its block is dropped when its worker re-registers."""
        a = self.allocations.get(request.block_id)
        who = cred.name if cred is not None else ""
        if a is None or (a.writer, a.path, a.size, a.worker_id) != (who, path, request.size, request.worker_id):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"block {request.block_id} is not an open allocation of {who or 'this caller'} for "
                           f"{path} ({request.size} bytes on {request.worker_id!r}): not published (another "
                           f"writer's block, another path or size, or allocated before a master restart)",
                           "EACCES")

    def _commit(self, request: pb.CommitRequest, orphans: list[tuple[str, str]],
                sealed: list[tuple[str, str]], cred: Credential | None = None) -> pb.CommitResponse:
        path = norm_path(request.path)
        self._own(path)
        if path == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot write to '/'")
        check_block_id(request.block_id)
        orphan: tuple[str, str] | None = None
        with self.lock:
            w = self.workers.get(request.worker_id)
            if w is None or not w.alive:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"worker {request.worker_id!r} is not alive")
            # the client names the worker and the size: believed only when the id is their MAC
            if self.block_key is not None and not self.block_key.verify(request.block_id, request.worker_id,
                                                                        request.size):
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"block {request.block_id} was not allocated on worker {request.worker_id!r} for "
                               f"{request.size} bytes (its id's MAC does not verify): not published", "EACCES")
            cur = self.files.get(path)
            if cur is not None and cur.block_id == request.block_id:
                return pb.CommitResponse(published=True)  # a retried commit of our own block
            if request.block_id in self.abandoned:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"block {request.block_id} was abandoned before its commit (allocation older than "
                               f"{self.allocation_ttl:.0f} s, or its worker restarted): write it again")
            self._check_allocation(request, path, cred)
            self.allocations.pop(request.block_id, None)
            self._uncharge_allocation(request.block_id)
            if cur is not None and request.if_absent:
                orphan = (request.worker_id, request.block_id)  # lost the race: drop our copy
                published = False
            elif cur is not None and cred is not None and not cred.may_replace(cur.writer):
                self._abandon(request.block_id)
                orphans.append((request.worker_id, request.block_id))
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"token {cred.name!r} may not overwrite {path}: another credential wrote it", "EACCES")
            else:
                try:  # authoritative: concurrent allocations each fitted alone
                    self._check_quota([(path if cur is not None else None, None, cur.size if cur else 0),
                                       (None, path, request.size)])
                except RpcError:
                    self._abandon(request.block_id)
                    orphans.append((request.worker_id, request.block_id))
                    raise
                if cur is not None:
                    self._drop_file(path)
                    orphan = (cur.worker_id, cur.block_id)
                self._add_file(path, FileEntry(request.block_id, w.worker_id, request.size, request.crc32c,
                                               time.time(), request.order_hint, request.local_path,
                                               cred.name if cred is not None else ""))
                self._seal(w.worker_id, request.block_id, request.size, request.crc32c, path, sealed)
                published = True
        (_PUBLISHED if published else _EXISTED).inc()
        if orphan is not None:
            orphans.append(orphan)
        return pb.CommitResponse(published=published)


    @_rpc
    def Delete(self, request: pb.PathRequest, context: Any) -> pb.DeleteResponse:  # noqa: N802
        path = norm_path(request.path)
        cred = self.creds.caller(context)
        scoped = self._scoped(cred)
        with self.lock:
            if self._hidden(scoped, path):  # outside its reads: the missing path's answer, whatever is there
                self._count_hidden(scoped)
                return pb.DeleteResponse(removed=False)
            if path in self.children:
                self._may_replace(cred, path, "")
                self._rmdir(path)
                return pb.DeleteResponse(removed=True)
            self._own(path)
            e = self.files.get(path)
            if e is None:
                return pb.DeleteResponse(removed=False)
            self._may_replace(cred, path, e.writer)
            self._record([(e.worker_id, e.block_id, None)])  # durable before the namespace changes
            self._drop_file(path)
        self._push(e.worker_id)  # one attempt now; the pusher retries until the worker confirms
        return pb.DeleteResponse(removed=True)


    @_rpc
    def Rename(self, request: pb.RenameRequest, context: Any) -> pb.Empty:  # noqa: N802
        src, dst = norm_path(request.src), norm_path(request.dst)
        if src == "/" or dst == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot rename '/'")
        cred = self.creds.caller(context)
        scoped = self._scoped(cred)
        if scoped is not None:
            with self.lock:
                hidden = self._hidden(scoped, src)
            if hidden:  # before any answer that depends on what src is (a directory, missing, another's)
                self._count_hidden(scoped)
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"{src}: no such file or directory")
        if src == dst:
            with self.lock:
                if src not in self.files and src not in self.children:
                    raise RpcError(grpc.StatusCode.NOT_FOUND, f"{src}: no such file or directory")
            return pb.Empty()
        if dst.startswith(src + "/"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot move {src} inside itself", "EINVAL")
        if self.shards > 1:  # a rename may not move a file to another shard's master (copy + delete instead)
            with self.lock:
                if src in self.children:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"cannot rename directory {src} in a sharded l2fs: its files would change "
                                   f"shards (copy and delete them instead)", "EXDEV")
            self._own(src)
            if not self._owns(dst):
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"cannot rename {src} to {dst}: they belong to different l2fs shards "
                               f"(copy and delete instead)", "EXDEV")
        changes: list[tuple[str, str, str | None]] = []  # (worker, block, new path | None = deleted)
        with self.lock:
            if cred is not None and "admin" not in cred.roles:  # a mount: its own file, to a free path of its own
                self._may_replace(cred, src, self.files[src].writer if src in self.files else "")
                if dst in self.files or dst in self.children or not cred.may_write(dst, True):
                    raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"token {cred.name!r} may not rename onto {dst}", "EACCES")
            if src in self.files:
                if dst in self.children:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{dst} is a directory", "EISDIR")
                if dst in self.files and not request.overwrite:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{dst} already exists")
                self._ensure_dirs(parent_of(dst))
                e, old = self.files[src], self.files.get(dst)
                self._check_quota([(src, dst, e.size)] + ([(dst, None, old.size)] if old is not None else []))
                if old is not None:
                    changes.append((old.worker_id, old.block_id, None))
                changes.append((e.worker_id, e.block_id, dst))
                self._record(changes)  # durable before the namespace changes
                self._drop_file(dst)
                self._drop_file(src)
                self._add_file(dst, e)
            elif src in self.children:
                if dst in self.files:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{dst} is a file", "ENOTDIR")
                if dst in self.children:
                    if self.children[dst]:
                        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{dst}: directory not empty", "ENOTEMPTY")
                    if not request.overwrite:
                        raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{dst} already exists")
                    self._rmdir(dst)
                self._ensure_dirs(parent_of(dst))
                prefix = src + "/"
                subdirs = sorted(d for d in self.children if d == src or d.startswith(prefix))
                subfiles = [p for p in self.files if p.startswith(prefix)]
                self._check_quota([(p, dst + p[len(src):], self.files[p].size) for p in subfiles])
                changes = [(self.files[p].worker_id, self.files[p].block_id, dst + p[len(src):]) for p in subfiles]
                self._record(changes)
                entries = [(p, self._drop_file(p)) for p in subfiles]
                for d in reversed(subdirs):
                    self._drop_dir(d)
                for d in subdirs:
                    self._ensure_dirs(dst + d[len(src):])
                for p, moved in entries:
                    assert moved is not None
                    self._add_file(dst + p[len(src):], moved)
            else:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"{src}: no such file or directory")
        for wid in dict.fromkeys(w for w, _, _ in changes):  # one attempt now; the pusher retries
            self._push(wid)
        return pb.Empty()
