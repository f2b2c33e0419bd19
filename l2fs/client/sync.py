"""Client: the synchronous client, assembled from its read, write and namespace parts."""

from __future__ import annotations

from l2fs.client.namespace import NamespaceOps
from l2fs.client.read import ReadOps
from l2fs.client.write import WriteOps


class Client(ReadOps, WriteOps, NamespaceOps):


    """Synchronous client. Thread-safe; share one per process.

    master: "host:port", a comma-separated failover list, or shards separated by ';' ("m0a:p,m0b:p;m1:p":
        paths are routed by shard_of(path), batches split per shard and sent in parallel); default
        $L2FS_MASTER.
    node_id: this process's node, for local-first placement and short-circuit I/O; default $L2FS_NODE_ID, else
        the hostname (l2fs.envs.node_id).
    token: bearer token for clusters started with --token; default $L2FS_TOKEN. A callable returning it (e.g.
        l2fs.common.FileToken) is asked at every call.
    tls_ca: CA bundle path to enable TLS; default $L2FS_TLS_CA.
    timeout: per-call deadline in seconds (reads fail as a miss after it).
    short_circuit: read/write local blocks directly on disk when the worker is on this node.
    fd_passing: for that, ask a same-node worker that advertises a Unix socket (visible here) for file
        descriptors instead of opening paths in its data dir (which this pod then need not mount).
    data_plane: move bulk bytes over the workers' raw-TCP data plane when they offer one (else gRPC
        streaming); default on unless $L2FS_DATA_PLANE=grpc.
    local_writes: write same-node blocks through the worker's ReserveLocal/AdoptLocal calls (short-circuit:
        sealed memfds the worker copies at adoption). None (default): only when bytes move over gRPC (no data
        plane), because over the loopback data plane a same-node put is faster at every block size measured
        (`kvtier bench local-put`, 2026-12-04: the memfd path 0.66-0.96x at 64 KiB-1 MiB, 0.25-0.32x at 4-8 MiB).
        True forces it. Off for a caller whose token the workers do not know (a pod ServiceAccount token only the
        master reviews): its writes go over the data plane with capabilities, while same-node reads still take fds
        from the worker's socket, which checks capabilities, not tokens.
    """
