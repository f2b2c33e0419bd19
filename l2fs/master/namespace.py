"""The namespace: files and directories of this master's shard, their locations, and the read-only RPCs."""

from __future__ import annotations

import heapq
from typing import Any

import grpc

from l2fs.common import (
    MAX_BATCH_ITEMS,
    Credential,
    RpcError,
    capability,
    check_batch,
    norm_path,
    parent_of,
    shard_of,
)
from l2fs.master.quotas import QuotaOps
from l2fs.master.state import (
    DUPLICATES,
    FILES,
    LOOKUP_HITS,
    LOOKUP_MISSES,
    READ_SCOPE_MISSES,
    FileEntry,
    WorkerEntry,
    _rpc,
)
from l2fs.proto import l2fs_pb2 as pb

# Directories are metadata nobody's byte quota saw: one Mkdir(parents) of a 4 KiB path of one-letter names made
# ~2,000 of them (4.7 MiB of master memory), and any number of calls more. Now a new directory may be at most
# MAX_DEPTH components deep, counts DIR_BYTES against every --prefix-quota strictly above it, and a non-admin
# credential may hold at most MAX_DIRS_PER_CREDENTIAL directories made with Mkdir.
MAX_DEPTH = 64
DIR_BYTES = 4096
MAX_DIRS_PER_CREDENTIAL = 65536


class NamespaceOps(QuotaOps):
    """Namespace helpers (call with the lock held unless noted) and the lookup/dir RPCs."""



    def _owns(self, path: str) -> bool:
        return self.shards <= 1 or shard_of(path, self.shards) == self.shard


    def _own(self, path: str) -> None:
        """FAILED_PRECONDITION (kind "shard") for a file path that hashes to another shard: a client or
        worker with a wrong master list must fail loudly, not split the namespace silently."""
        if not self._owns(path):
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{path} belongs to l2fs shard {shard_of(path, self.shards)} of {self.shards}, this "
                           f"master is shard {self.shard}/{self.shards}: the caller's master list does not "
                           f"match the cluster's shards", kind="shard")


    def _own_or_dir(self, path: str) -> None:
        """Lookups of another shard's path are refused unless it is a directory here (directories exist on
        every shard that holds something under them, so a sharded client asks all shards for them)."""
        if not self._owns(path) and path not in self.children:
            self._own(path)


    def _ensure_dirs(self, path: str, maker: str = "") -> None:
        """Create path and its missing parents as directories: within MAX_DEPTH, the quotas above them
        (DIR_BYTES each) and, for `maker` (a non-admin credential's Mkdir), max_dirs_per_credential
        (MAX_DIRS_PER_CREDENTIAL unless master --max-dirs-per-credential says otherwise)."""
        missing = []
        p = path
        while p not in self.children:
            if p in self.files:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{p} is a file, not a directory", "ENOTDIR")
            missing.append(p)
            p = parent_of(p)
        if not missing:
            return
        if path.count("/") > MAX_DEPTH:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{path[:100]}...: deeper than {MAX_DEPTH} directories", "ENAMETOOLONG")
        cap = self.max_dirs_per_credential
        if maker and self.dirs_by.get(maker, 0) + len(missing) > cap:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"credential {maker!r} holds {self.dirs_by.get(maker, 0)} directories and this Mkdir "
                           f"makes {len(missing)} more (at most {cap}): remove some first", "EDQUOT")
        if self.quotas:
            grow: dict[str, int] = {}
            for d in missing:
                for q in self._dir_quotas(d):
                    grow[q] = grow.get(q, 0) + DIR_BYTES
            self._check_quota([(None, q, n) for q, n in grow.items()])
            for q, n in grow.items():
                self._charge(q, n)
        for d in reversed(missing):
            self.children[d] = set()
            self.children[parent_of(d)].add(d.rsplit("/", 1)[1])
            if maker:
                self.dir_maker[d] = maker
                self.dirs_by[maker] = self.dirs_by.get(maker, 0) + 1

    def _dir_quotas(self, d: str) -> list[str]:
        """The quota prefixes a directory counts against: those strictly above it (a quota's own root dir
        is free, so a prefix holds exactly its quota of files)."""
        return [q for q in self._quotas_of(d) if q != d]

    def _drop_dir(self, d: str) -> None:
        """Remove directory d (its entries gone already), giving back what it counted."""
        self.children.pop(d, set()).clear()
        self.children.get(parent_of(d), set()).discard(d.rsplit("/", 1)[1])
        for q in self._dir_quotas(d) if self.quotas else ():
            self._charge(q, -DIR_BYTES)
        maker = self.dir_maker.pop(d, None)
        if maker is not None:
            n = self.dirs_by.get(maker, 1) - 1
            if n > 0:
                self.dirs_by[maker] = n
            else:
                self.dirs_by.pop(maker, None)


    def _add_file(self, path: str, entry: FileEntry) -> None:
        if path in self.children:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path} is a directory", "EISDIR")
        self._ensure_dirs(parent_of(path))
        self.files[path] = entry
        self.blocks[entry.block_id] = path
        self.children[parent_of(path)].add(path.rsplit("/", 1)[1])
        w = self.workers.get(entry.worker_id)
        if w is not None:
            w.files.add(path)
        self._count_content(entry, +1)
        self._charge(path, entry.size)
        FILES.set(len(self.files))


    def _drop_file(self, path: str) -> FileEntry | None:
        e = self.files.pop(path, None)
        if e is None:
            return None
        self.blocks.pop(e.block_id, None)
        kids = self.children.get(parent_of(path))
        if kids is not None:
            kids.discard(path.rsplit("/", 1)[1])
        w = self.workers.get(e.worker_id)
        if w is not None:
            w.files.discard(path)
        self._count_content(e, -1)
        self._charge(path, -e.size)
        FILES.set(len(self.files))
        return e


    def _count_content(self, e: FileEntry, delta: int) -> None:
        """Key-divergence detector: track files whose bytes (size + crc32c) equal another file's."""
        if e.size < 4096:
            return
        key = (e.size, e.crc32c)
        n = self.content.get(key, 0)
        if delta > 0:
            self.duplicates += n > 0
            self.content[key] = n + 1
        else:
            self.duplicates -= n > 1
            if n <= 1:
                self.content.pop(key, None)
            else:
                self.content[key] = n - 1
        DUPLICATES.set(self.duplicates)


    def _cap(self, w: WorkerEntry, op: str, bid: str, path: str = "", size: int | None = None,
             holder: str | None = None) -> str:
        """The capability a client shows `w` for `op` on `bid` ("" when `w` takes tokens); a write's binds its
        path and, for a worker that checks it (protocol >= 5), the allocated `size`; for a worker of protocol
        >= 6 it names `holder` (the caller's capability.holder_id), which that worker counts connections by."""
        if self.minter is None or not w.caps:
            return ""
        return self.minter.mint(w.worker_id, op, bid, path, size if w.sized else None,
                                holder if w.holders else None)

    def _holder(self, cred: Credential | None) -> str | None:
        """The holder capabilities minted for `cred` name (None without authentication: c1 capabilities)."""
        return capability.holder_id(cred.name) if cred is not None and self.minter is not None else None


    def _location(self, e: FileEntry, caps: bool = True, w: WorkerEntry | None = None,
                  holder: str | None = None) -> pb.Location:
        """`w`: e's worker when looked up already (StatMany builds its answer outside the lock)."""
        w = w if w is not None else self.workers[e.worker_id]
        return pb.Location(worker_id=w.worker_id, node_id=w.node_id, address=w.address,
                           block_id=e.block_id, local_path=e.local_path, data_address=w.data_address,
                           domain_socket=w.domain_socket,
                           capability=self._cap(w, capability.READ, e.block_id, holder=holder) if caps else "")


    def _stat(self, path: str, caps: bool = True, holder: str | None = None) -> pb.FileStat:
        """`caps`: mint read capabilities into the locations (lookups before a read; a List need not)."""
        e = self.files.get(path)
        if e is not None:
            return pb.FileStat(path=path, exists=True, size=e.size, mtime=e.mtime, crc32c=e.crc32c,
                               order_hint=e.order_hint, locations=[self._location(e, caps, holder=holder)])
        if path in self.children:
            return pb.FileStat(path=path, exists=True, is_dir=True)
        return pb.FileStat(path=path, exists=False)


    @staticmethod
    def _scoped(cred: Credential | None) -> Credential | None:
        """The caller when its reads are scoped (an engine or mount credential: Credential.reads), else None."""
        return cred if cred is not None and cred.reads is not None else None

    def _hidden(self, scoped: Credential | None, path: str) -> bool:
        """Whether `path` lies outside a scoped caller's reads: neither under its read prefixes nor an existing
        directory on the way to one (lock held). Such a path gets the answer a missing path gets, whether or
        not it exists, and before any check that depends on what is there (a shard's directory test), so
        nothing tells another endpoint's names, directories or blocks from nothing."""
        return scoped is not None and not scoped.may_read(path) and not (path in self.children
                                                                         and scoped.leads_to(path))

    @staticmethod
    def _count_hidden(scoped: Credential | None, n: int = 1) -> None:
        if scoped is not None and n:
            READ_SCOPE_MISSES.labels(scoped.name).inc(n)

    @_rpc
    def Stat(self, request: pb.PathRequest, context: Any) -> pb.FileStat:  # noqa: N802
        path = norm_path(request.path)
        cred = self.creds.caller(context)
        holder, scoped = self._holder(cred), self._scoped(cred)
        with self.lock:
            hidden = self._hidden(scoped, path)
            if not hidden:
                self._own_or_dir(path)
            st = pb.FileStat(path=path, exists=False) if hidden else self._stat(path, holder=holder)
        if hidden:
            self._count_hidden(scoped)
        (LOOKUP_HITS if st.exists else LOOKUP_MISSES).inc()
        return st


    @_rpc
    def StatMany(self, request: pb.PathsRequest, context: Any) -> pb.StatManyResponse:  # noqa: N802
        """At most MAX_BATCH_ITEMS paths; the read capabilities are minted after the lock is released (only
        the entries are looked up under it), so a batch of lookups holds the namespace for microseconds."""
        check_batch(len(request.paths), "StatMany")
        paths = [norm_path(p) for p in request.paths]
        cred = self.creds.caller(context)
        holder, scoped = self._holder(cred), self._scoped(cred)
        hidden = 0
        with self.lock:
            # a path outside a scoped caller's reads is answered in its own slot as missing (the others answered
            # as usual): a batch of lookups is a batch of misses at worst, as every fault is
            shown = [not self._hidden(scoped, p) for p in paths] if scoped is not None else None
            for i, p in enumerate(paths) if self.shards > 1 else ():
                if shown is None or shown[i]:
                    self._own_or_dir(p)
            found: list[tuple[str, FileEntry | None, WorkerEntry | None, bool]] = []
            for i, p in enumerate(paths):
                if shown is not None and not shown[i]:
                    hidden += 1
                    found.append((p, None, None, False))
                    continue
                e = self.files.get(p)
                found.append((p, e, self.workers[e.worker_id] if e is not None else None, p in self.children))
        self._count_hidden(scoped, hidden)
        stats = [self._stat_found(p, e, w, is_dir, holder) for p, e, w, is_dir in found]
        hits = sum(s.exists for s in stats)
        LOOKUP_HITS.inc(hits)
        LOOKUP_MISSES.inc(len(stats) - hits)
        return pb.StatManyResponse(stats=stats)


    def _stat_found(self, path: str, e: FileEntry | None, w: WorkerEntry | None, is_dir: bool,
                    holder: str | None = None) -> pb.FileStat:
        """_stat of an entry looked up under the lock, built (and its capability minted) outside it."""
        if e is not None and w is not None:
            return pb.FileStat(path=path, exists=True, size=e.size, mtime=e.mtime, crc32c=e.crc32c,
                               order_hint=e.order_hint, locations=[self._location(e, w=w, holder=holder)])
        return pb.FileStat(path=path, exists=True, is_dir=True) if is_dir else pb.FileStat(path=path, exists=False)


    @_rpc
    def PrefixLookup(self, request: pb.PathsRequest, context: Any) -> pb.PrefixLookupResponse:  # noqa: N802
        check_batch(len(request.paths), "PrefixLookup")
        paths = [norm_path(p) for p in request.paths]
        for p in paths if self.shards > 1 else ():
            self._own(p)
        scoped = self._scoped(self.creds.caller(context))
        n = 0
        with self.lock:
            for p in paths:
                if scoped is not None and not scoped.may_read(p):  # the chain's first miss, existing or not
                    self._count_hidden(scoped)
                    break
                if p not in self.files:
                    break
                n += 1
        LOOKUP_HITS.inc(n)
        if n < len(paths):
            LOOKUP_MISSES.inc()
        return pb.PrefixLookupResponse(count=n)


    @_rpc
    def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:  # noqa: N802
        """A page of at most `limit` (<= MAX_BATCH_ITEMS) entries after `start_after`, and the name to go on
        from. Before, one call listed a whole directory under the lock, however large; a caller that asks for
        no page (limit 0, as clients before paging) gets the whole listing only up to one page, else
        INVALID_ARGUMENT (a listing is complete or an error)."""
        path = norm_path(request.path)
        limit = min(request.limit or MAX_BATCH_ITEMS, MAX_BATCH_ITEMS)
        scoped = self._scoped(self.creds.caller(context))
        with self.lock:
            if self._hidden(scoped, path):
                self._count_hidden(scoped)
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"{path}: no such file or directory")
            if path in self.files:
                return pb.ListResponse(entries=[self._stat(path, caps=False)])
            kids = self.children.get(path)
            if kids is None:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"{path}: no such file or directory")
            base = "" if path == "/" else path
            if scoped is not None and (way := scoped.visible_names(path)) is not None:
                # a directory on the way to its read prefixes (/, /kvtier/kv): only the entries on that way,
                # never another endpoint's (salted) directory names; a file there only when it may read it
                kids = {n for n in way & kids if f"{base}/{n}" not in self.files or scoped.may_read(f"{base}/{n}")}
            if not request.limit and len(kids) > limit:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{path} has {len(kids)} entries: list it in pages of at most {limit} "
                               f"(ListRequest.limit, start_after)")
            after = request.start_after
            names = heapq.nsmallest(limit + 1, (n for n in kids if n > after) if after else kids)
            entries = [self._stat(f"{base}/{name}", caps=False) for name in names[:limit]]
        return pb.ListResponse(entries=entries, next_after=names[limit - 1] if len(names) > limit else "")


    @_rpc
    def Mkdir(self, request: pb.MkdirRequest, context: Any) -> pb.Empty:  # noqa: N802
        path = norm_path(request.path)
        self.creds.check_write(context, [(path, True)], mkdir=True)
        cred = self.creds.caller(context)
        maker = cred.name if cred is not None and "admin" not in cred.roles else ""
        with self.lock:
            if path in self.files:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{path} exists and is a file")
            if path in self.children:
                if not request.exist_ok:
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"{path} already exists")
                return pb.Empty()
            if not request.parents and parent_of(path) not in self.children:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"parent of {path} does not exist")
            self._ensure_dirs(path, maker)
        return pb.Empty()


    @_rpc
    def Rmdir(self, request: pb.PathRequest, context: Any) -> pb.Empty:  # noqa: N802
        path = norm_path(request.path)
        with self.lock:
            self._rmdir(path)
        return pb.Empty()


    def _rmdir(self, path: str) -> None:
        if path == "/":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cannot remove '/'")
        kids = self.children.get(path)
        if kids is None:
            if path in self.files:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path} is a file, not a directory", "ENOTDIR")
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"{path}: no such directory")
        if kids:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{path}: directory not empty", "ENOTEMPTY")
        self._drop_dir(path)


    @staticmethod
    def _may_replace(cred: Credential | None, path: str, writer: str) -> None:
        if cred is not None and not cred.may_replace(writer):
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"token {cred.name!r} may not delete or rename {path}: not a file it wrote", "EACCES")
