"""Raw-TCP data plane beside gRPC: bulk block reads (sendfile) and writes (recv_into) on loopback/LAN.

Why: Python gRPC streaming measured ~0.1x of a raw loopback TCP stream for 14.7 MB objects (see
docs/l2fs.md), far below the 1.84 GB/s cross-node target. Control stays on gRPC; only bytes move here.
The checksum is verified end to end by the reader (a mismatch is a miss and is reported to the worker,
which re-verifies and drops the block). TLS clusters do not start this plane; clients then use gRPC.

`wire` is the format, `server` the worker side (imports the store), `client` the pooled client. This
package re-exports only the client side, so clients never load the worker's store or its metrics.
"""

from l2fs.dataplane.client import DataClient
from l2fs.dataplane.wire import (
           DATA_IDLE_TIMEOUT,
           DATA_MAX_CONNS,
           DataPlaneBusy,
           DataPlaneError,
           enabled_by_default,
)

__all__ = ["DATA_IDLE_TIMEOUT", "DATA_MAX_CONNS", "DataClient", "DataPlaneBusy", "DataPlaneError",
           "enabled_by_default"]
