"""The l2fs client, the one way every other part of kvtier reaches L2 (conventions: `l2fs.client.core`).

`Client` (sync.py) is assembled from its parts: `core` (connections, master failover, shard fan-out),
`locate` (where a block is), `read` (the fail-as-miss read path), `write` (put/put_many), `namespace`
(metadata calls); `errors` maps gRPC status to the exceptions below, `types` holds what calls return and
`aio` the asyncio twin. Import these names from here."""

from l2fs.client.aio import AsyncClient
from l2fs.client.core import _check
from l2fs.client.errors import (
    AlreadyExists,
    Busy,
    CrossShard,
    InvalidArgument,
    InvalidPath,
    L2fsError,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unavailable,
    Unimplemented,
    WrongShard,
    _exception,
    _with_errno,
)
from l2fs.client.namespace import combine_prefix
from l2fs.client.sync import Client
from l2fs.client.types import ClusterReport, FileInfo, WorkerInfo
from l2fs.client.write import PUT_BATCH

__all__ = ["PUT_BATCH", "AlreadyExists", "AsyncClient", "Busy", "Client", "ClusterReport", "CrossShard", "FileInfo",
           "InvalidArgument", "InvalidPath", "L2fsError", "NotFound", "PermissionDenied", "QuotaExceeded",
           "Unavailable", "Unimplemented", "WorkerInfo", "WrongShard", "_check", "_exception", "_with_errno",
           "combine_prefix"]
