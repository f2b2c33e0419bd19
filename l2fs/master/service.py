"""l2fs master: in-memory namespace (dirs, files -> block -> worker), worker registry, placement.

No Raft: the namespace is soft state. Workers persist a manifest of their sealed blocks and re-report it
on (re)registration, so a restarted master rebuilds the namespace from block reports. KV data is
recomputable, so anything lost in that window only costs cache misses. What must not come back from those
reports (deleted files, old names of renamed files, overwritten blocks) waits in `l2fs.master.journal.PendingOps`
(on disk with `--journal`) until the worker has confirmed it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent import futures

import grpc

from l2fs.common import (
    DEFAULT_MAX_FILE_SIZE,
    BlockKey,
    Credentials,
    capability,
    grpc_server,
    norm_path,
)
from l2fs.master.journal import PendingOps
from l2fs.master.namespace import MAX_DIRS_PER_CREDENTIAL
from l2fs.master.registry import RegistryOps
from l2fs.master.state import MASTER_POLICY, PENDING, Allocation, FileEntry, WorkerEntry
from l2fs.proto import l2fs_pb2_grpc as pbg


class MasterService(RegistryOps, pbg.MasterServicer):
    """Namespace + registry. One lock guards all state; handlers are short and never do I/O under it."""

    def __init__(self, *, heartbeat_timeout: float = 10.0, max_file_size: int = DEFAULT_MAX_FILE_SIZE,
                 token: str | None = None, tls_ca: str | None = None, allocation_ttl: float = 600.0,
                 journal: str | None = None, prefix_quotas: dict[str, int] | None = None,
                 creds: Credentials | None = None, shard: tuple[int, int] = (0, 1),
                 block_key: BlockKey | None = None, capability_ttl: float = capability.DEFAULT_TTL) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        # With a key, block ids are minted as their own MAC over (worker id, size) (BlockKey): a commit or a
        # block report whose id does not verify was never allocated by a master of this cluster. Without one,
        # uuid4 ids and no check (any worker-role caller can publish blocks it made up).
        self.block_key = block_key
        # ... and the data plane takes per-block capabilities instead of the token (l2fs/common/capability.py): each
        # protocol->=3 worker gets its data key K_w at registration, clients a capability per location
        self.minter = capability.Minter(block_key.key, capability_ttl) if block_key is not None else None
        # Path-hash sharding: this master owns the files whose path hashes to shard[0] of shard[1] (shard_of);
        # directories live on every shard that has something under them.
        self.shard, self.shards = shard
        # Per-prefix byte quotas (tenant isolation): a prefix at its quota gets write misses instead of
        # evicting everyone else's blocks. Counted on published files; checked at Allocate and Commit.
        self.quotas = {norm_path(k): v for k, v in (prefix_quotas or {}).items()}
        self.quota_used = dict.fromkeys(self.quotas, 0)
        # bytes allocated under a quota prefix and not committed yet: a batch of puts must not write (and make
        # the worker evict for) more than the quota before its first commit is checked
        self.quota_inflight = dict.fromkeys(self.quotas, 0)
        # directories a non-admin credential made with Mkdir (dir -> its name), and how many each holds
        self.dir_maker: dict[str, str] = {}
        self.dirs_by: dict[str, int] = {}
        self.max_dirs_per_credential = MAX_DIRS_PER_CREDENTIAL  # master --max-dirs-per-credential
        self._alloc_charge: dict[str, tuple[str, int]] = {}  # block id -> (path, size) charged in flight
        # Deletes/renames a worker has not confirmed: applied to its block reports, pushed until it acks.
        self.pending = PendingOps(journal)
        self._send_locks: dict[str, threading.Lock] = {}  # one push at a time per worker: acks stay ordered
        self._push_wake = threading.Event()
        # Seal MACs of committed blocks not delivered to their worker yet: worker id -> block id -> (crc32c,
        # MAC), pushed (SealBlocks) by the pusher thread. Also what a worker's re-registration is checked
        # against while its seals are on their way. Bounded per worker (a protocol-3 worker never takes them).
        self.seals: dict[str, OrderedDict[str, tuple[int, str]]] = {}
        self.allocation_ttl = allocation_ttl
        # Blocks allocated but not committed yet (block id -> Allocation: worker, expiry, and the caller, path
        # and size only whose commit publishes it), and those given up on: an
        # expired allocation, or one whose worker re-registered before the commit. An abandoned block is never
        # published (a put that never returned must not surface after a worker restart) and is deleted.
        self.allocations: OrderedDict[str, Allocation] = OrderedDict()
        self.abandoned: OrderedDict[str, None] = OrderedDict()
        self.max_file_size = max_file_size
        self.lock = threading.RLock()
        self.files: dict[str, FileEntry] = {}
        self.blocks: dict[str, str] = {}  # block_id -> path
        self.children: dict[str, set[str]] = {"/": set()}  # dir -> child names (files and dirs)
        self.workers: dict[str, WorkerEntry] = {}
        self.content: dict[tuple[int, int], int] = {}  # (size, crc32c) -> files with it (>= 4 KiB)
        self.duplicates = 0
        # who may write where (checked in the handlers, where the path is known); `token` is what the master
        # sends when it calls workers
        self.creds = creds if creds is not None else Credentials(token)
        self._token = self.creds.outbound_token(token)
        self._tls_ca = tls_ca
        self._stubs: dict[str, pbg.WorkerStub] = {}
        self._bg = futures.ThreadPoolExecutor(8, thread_name_prefix="l2fs-master-bg")
        self._stop = threading.Event()
        threading.Thread(target=self._sweeper, name="l2fs-sweeper", daemon=True).start()
        threading.Thread(target=self._pusher, name="l2fs-pending", daemon=True).start()
        PENDING.set(len(self.pending))


    def close(self) -> None:
        self._stop.set()
        self._push_wake.set()
        self._bg.shutdown(wait=False, cancel_futures=True)
        self.pending.close()


    def health(self) -> dict:
        with self.lock:
            alive = sum(w.alive for w in self.workers.values())
            return {"ok": True, "role": "master", "workers_alive": alive, "files": len(self.files),
                    "pending_namespace_ops": len(self.pending), "shard": f"{self.shard}/{self.shards}"}


def serve(host: str, port: int, service: MasterService, *, token: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, threads: int = 32) -> tuple[grpc.Server, int]:
    """Start the master gRPC server; returns it and the bound port. The service's credentials (a tokens
    file) take precedence over `token`."""
    creds = service.creds if service.creds.enabled else Credentials(token)
    server, bound, _ = grpc_server(host, port, lambda s: pbg.add_MasterServicer_to_server(service, s),
                                   name="l2fs-master", creds=creds, policy=MASTER_POLICY,
                                   tls_cert=tls_cert, tls_key=tls_key, threads=threads)
    server.start()
    return server, bound
