"""The errors l2fs servers raise in handlers (RpcError, PathError), mapped to gRPC status by rpc_handler."""

from __future__ import annotations

import grpc

ERROR_KIND_KEY = "l2fs-error"  # trailing metadata naming the error kind (e.g. "path"), so clients need no text


class PathError(ValueError):
    """A path that l2fs refuses (mapped to INVALID_ARGUMENT / InvalidPath). errno_name travels like
    RpcError's (ENAMETOOLONG for over-long names, EINVAL otherwise), so no client parses the text."""

    def __init__(self, msg: str, errno_name: str = "EINVAL") -> None:
        super().__init__(msg)
        self.errno_name = errno_name


class RpcError(Exception):
    """Raised inside master/worker handlers; turned into a gRPC status with a message. `errno_name`
    (e.g. "ENOTEMPTY") travels as trailing metadata `l2fs-errno`, so clients (the FUSE mount) map errors
    without parsing text."""

    def __init__(self, code: grpc.StatusCode, msg: str, errno_name: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(msg)
        self.code = code
        self.errno_name = errno_name
        self.kind = kind  # travels as ERROR_KIND_KEY (e.g. "shard": a path this master does not own)
