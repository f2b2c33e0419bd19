"""Short-circuit I/O through file descriptors passed over a Unix socket (HDFS short-circuit style).

Why: path-based short-circuit needs the worker's data dir in the client's pod, and a read-write mount lets
any pod overwrite any block or the manifest. Here the worker opens the files itself and hands the client
only an fd: a sealed block O_RDONLY for a read, a fresh temp file (O_CREAT|O_EXCL|O_NOFOLLOW, 0600) for a
write it reserved. A pod needs only the socket (a hostPath dir holding nothing else), never the data dir.

Wire (one request per connection, big-endian):

  request  b"L2FD" op:u8 token_len:u16 bid_len:u16 path_len:u16 token block_id path
  reply    status:u8 size:u64 crc32c:u32 msg_len:u16 msg, with one fd (SCM_RIGHTS) when status is OK

op READ (1): the block's fd, size and CRC32C (the client still verifies what it reads). op WRITE (2): the
reserved temp file's write fd (block id of a ReserveLocal reservation, path the put is for); the client
writes it and calls AdoptLocal, which re-checks the file and recomputes the CRC as before.
Auth as on the data plane: a worker with a data key wants the block's capability in the token field (a
read one for READ, a write one for that block and `path` for WRITE; l2fs/common/capability.py). In token mode (no
block key) any known token reads; a write needs a writer token allowed to put-if-absent `path` (an engine
token only under its prefixes). Bounded: `max_conns` connections (more are answered
BUSY), one deadline over the whole request, and the worker closes its copy of the fd right after sending.

This module is the wire and the client (`request_fd`); the worker's server is l2fs/worker/fdserver.py.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

MAGIC = b"L2FD"
READ, WRITE = 1, 2
OK, NOT_FOUND, DENIED, BAD, BUSY = 0, 1, 2, 3, 4
REQ = struct.Struct("!4sBHHH")
REPLY = struct.Struct("!BQIH")
MAX_TOKEN, MAX_FIELD = 4096, 4096
FD_MAX_CONNS = 64
FD_HANDSHAKE_TIMEOUT = 2.0  # seconds from accept to a complete request
SUN_PATH_MAX = 107


class FdPassError(Exception):
    """The worker refused the request (status says why: DENIED, NOT_FOUND, BAD, BUSY)."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


def default_socket_path(first_data_dir: Path, worker_id: str) -> str:
    """Next to (not inside) the first data dir: a pod can mount the socket's dir without the blocks."""
    return str(first_data_dir.parent / f"l2fs-{worker_id}.sock")


# ---------- client side ----------

def request_fd(sock_path: str, op: int, token: str | None, bid: str, path: str = "", timeout: float = 2.0
               ) -> tuple[int, int, int]:
    """Ask the worker at `sock_path` for a block's fd: (fd, size, crc32c); the caller closes the fd.
    FdPassError when the worker refused, OSError when it could not be asked (no socket, worker gone)."""
    t, b, p = (token or "").encode(), bid.encode(), path.encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(REQ.pack(MAGIC, op, len(t), len(b), len(p)) + t + b + p)
        data, fds, _, _ = socket.recv_fds(s, REPLY.size + 1024, 1, socket.MSG_CMSG_CLOEXEC)
        try:
            while len(data) < REPLY.size:
                more = s.recv(REPLY.size - len(data))
                if not more:
                    raise ConnectionError("worker closed the fd socket mid-reply")
                data += more
            status, size, crc, mlen = REPLY.unpack_from(data)
            if status != OK or not fds:
                msg = data[REPLY.size:REPLY.size + mlen]
                while len(msg) < mlen:
                    more = s.recv(mlen - len(msg))
                    if not more:
                        break
                    msg += more
                raise FdPassError(status if status != OK else BAD, msg.decode(errors="replace") or "no fd passed")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        for fd in fds[1:]:
            os.close(fd)
        return fds[0], size, crc
