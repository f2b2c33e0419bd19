"""Metadata calls: stat, ls, walk, mkdir, rmdir, rm, rename, prefix lookups and the cluster report."""

from __future__ import annotations

import errno
import functools
import time
from collections.abc import Sequence
from typing import Any

from l2fs.client.core import ClientCore, _check
from l2fs.client.errors import AlreadyExists, CrossShard, L2fsError, NotFound, Unavailable
from l2fs.client.types import ClusterReport, FileInfo, WorkerInfo, _info
from l2fs.common import (
    MAX_BATCH_ITEMS,
    parent_of,
)
from l2fs.proto import l2fs_pb2 as pb


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


class NamespaceOps(ClientCore):
    """Namespace (metadata) calls, fanned out over shards where needed."""



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
        """One RPC per shard (in parallel) per MAX_BATCH_ITEMS paths. A directory is found on its own shard
        only (use stat)."""
        if len(paths) > MAX_BATCH_ITEMS:
            return [i for k in range(0, len(paths), MAX_BATCH_ITEMS)
                    for i in self.stat_many(paths[k:k + MAX_BATCH_ITEMS])]
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
        if len(paths) > MAX_BATCH_ITEMS:  # the master takes MAX_BATCH_ITEMS per call: chain them
            n = 0
            for k in range(0, len(paths), MAX_BATCH_ITEMS):
                here = self.prefix_lookup(paths[k:k + MAX_BATCH_ITEMS])
                n += here
                if here < len(paths[k:k + MAX_BATCH_ITEMS]):
                    break
            return n
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
        got = self._fan([functools.partial(self._list_shard, path, s) for s in range(len(self._shards))])
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


    def _list_shard(self, path: str, shard: int) -> pb.ListResponse:
        """One shard's whole listing of `path`, page by page (the master answers at most MAX_BATCH_ITEMS
        entries per call)."""
        out = pb.ListResponse()
        after = ""
        while True:
            r = self._master("List", pb.ListRequest(path=path, start_after=after, limit=MAX_BATCH_ITEMS), None, shard)
            out.entries.extend(r.entries)
            if not r.next_after:
                return out
            after = r.next_after


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
