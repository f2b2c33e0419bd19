"""Data-plane wire format, shared by server and client (little-endian), several requests per connection:

  request   b"L2D1" op:1 token_len:u16 token block_id:32   (token: the block's capability when the worker
            has a data key, l2fs/common/capability.py; else the bearer token)
  op R  ->  status:u8 then (status 0) size:u64 crc32c:u32 + size bytes via sendfile, or msg_len:u16 msg
  op W      + path_len:u16 path size:u64 order_hint:i64
        ->  status:u8 (0 = send the data; else msg_len:u16 msg)  then the client sends size bytes
        ->  status:u8 then (0) crc32c:u32 path_len:u16 local_path, or msg_len:u16 msg

The status byte is the error's type (clients map it, never the message text).
"""

from __future__ import annotations

import socket
import struct

from l2fs import envs

MAGIC = b"L2D1"
OK, NOT_FOUND, DENIED, BAD, BUSY = 0, 1, 2, 3, 4
# BAD: the request is refused for its content (malformed protocol, block id or path, or arguments such as
# a size over the max file size): the caller's fault. BUSY: refused for load, worth trying elsewhere.
HDR = struct.Struct("<4scH")
READ_OK = struct.Struct("<QI")
WRITE_HDR = struct.Struct("<Qq")
BUF = 4 << 20
DATA_MAX_CONNS = 256  # concurrent connections a worker serves (one thread each)
DATA_IDLE_TIMEOUT = 30.0  # seconds an idle connection is kept open
# Before its first request header and token are in, a connection holds no serving slot and no thread: it
# waits in a small pre-auth pool, for one deadline over the whole handshake (not reset by each byte).
HANDSHAKE_TIMEOUT = 3.0  # seconds from accept to a complete, authenticated first request header
PREAUTH_MAX = 64  # connections handshaking at once; a new one past it pushes out the oldest
PREAUTH_PER_IP = 16  # connections handshaking at once from one peer address; past it refused (BUSY)
MAX_TOKEN_LEN = 4096  # a longer token field is refused without reading it
BUSY_MSG = "worker data plane busy: too many connections (limit {}); use gRPC or retry"
PER_IP_MSG = "worker data plane busy: too many connections (limit {}) still authenticating from {}; retry"


class DataPlaneError(Exception):
    """Server answered with an error status (message kept)."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


class DataPlaneBusy(ConnectionError):
    """Worker refused for load (connection limit, too many pending writes): an OSError, so callers treat
    it like an unreachable worker (reads miss, writes try another worker) rather than as bad input."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = sock.recv(n - got)
        if not b:
            raise ConnectionError("peer closed the connection")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def send_err(sock: socket.socket, status: int, msg: str) -> None:
    m = msg.encode()[:1000]
    sock.sendall(struct.pack("<BH", status, len(m)) + m)


def enabled_by_default() -> bool:
    """$L2FS_DATA_PLANE=grpc forces gRPC streaming (for comparisons)."""
    return envs.get("L2FS_DATA_PLANE") != "grpc"
