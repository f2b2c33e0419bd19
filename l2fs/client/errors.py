"""The client's exceptions and the one mapping from gRPC status (and its trailers) to them."""

from __future__ import annotations

import errno

import grpc

from l2fs.common import (
    ERROR_KIND_KEY,
)
from l2fs.common.protocol import status_code
from l2fs.proto import l2fs_pb2 as pb


class L2fsError(Exception):
    """Base class of l2fs client errors."""

    errno: int | None  # set when the server named one (annotation only: OSError subclasses have their own)


class InvalidArgument(L2fsError, ValueError):
    """The server refused the request's arguments (e.g. a file over the max file size)."""


class InvalidPath(InvalidArgument):
    """The path is not a valid l2fs path."""


class NotFound(L2fsError, FileNotFoundError):
    """The path does not exist (metadata operations only; reads return None instead)."""


class AlreadyExists(L2fsError, FileExistsError):
    """Target exists and the operation does not overwrite."""


class Unavailable(L2fsError, ConnectionError):
    """Master (or every candidate worker) unreachable within the deadline."""


class Busy(Unavailable):
    """A worker refused for load (RESOURCE_EXHAUSTED: e.g. too many bytes promised to unfinished writes): a
    write miss. An Unavailable, so callers skip or try another worker as before, but the cluster is up:
    circuit breakers that stop calling a dead master must not trip on it."""


class QuotaExceeded(L2fsError):
    """The path's prefix is at its L2 quota (`l2fs master --prefix-quota`): a write miss. Not Unavailable on
    purpose: the cluster is up, and callers that open a circuit breaker on outages must not trip on it."""


class PermissionDenied(L2fsError, PermissionError):
    """Authentication/authorization failed (bad or missing token)."""


class WrongShard(L2fsError):
    """A master refused a path of another shard: this client's master list does not match the cluster's."""


class CrossShard(L2fsError):
    """A rename that would move a file (or a directory's files) to another shard (errno EXDEV: copy and
    delete instead, as `mv` does across file systems)."""

    errno = errno.EXDEV


class Unimplemented(L2fsError):
    """The server does not have this call (a peer older than this client's protocol)."""


def _trailer(e: grpc.RpcError, name: str) -> str | None:
    """A trailing metadata value the server attached to an error (`l2fs-errno`, `l2fs-error`), if any."""
    try:
        md = e.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not every RpcError carries a call
        return None
    for key, value in md:
        if key == name:
            return str(value)
    return None


def _errno(e: grpc.RpcError) -> int | None:
    """The errno the server named in trailing metadata `l2fs-errno` (e.g. ENOTEMPTY), if any."""
    code = getattr(errno, _trailer(e, "l2fs-errno") or "", None)
    return code if isinstance(code, int) else None


def _error(e: grpc.RpcError) -> L2fsError:
    """Map a gRPC status to the client's exception types (message kept; `.errno` set when the server
    named one, so callers such as the FUSE mount need not parse messages)."""
    return _with_errno(_error_type(e), _errno(e))


def _with_errno(exc: L2fsError, code: int | None) -> L2fsError:
    """`exc` with the errno the server named; a prefix quota refusal (EDQUOT) becomes QuotaExceeded."""
    if code == errno.EDQUOT:
        exc = QuotaExceeded(str(exc))
    elif code == errno.EXDEV:
        exc = CrossShard(str(exc))
    if code is not None:
        exc.errno = code
    return exc


def _error_type(e: grpc.RpcError) -> L2fsError:
    return _exception(e.code(), e.details() or str(e.code()), _trailer(e, ERROR_KIND_KEY))


def _item_error(err: pb.ItemError) -> L2fsError:
    """One failed item of a batched call, as the exception its unary call would have raised."""
    code = getattr(errno, err.errno_name, None) if err.errno_name else None
    return _with_errno(_exception(status_code(err), err.message, err.kind), code if isinstance(code, int) else None)


def _exception(code: grpc.StatusCode, msg: str, kind: str | None) -> L2fsError:
    if kind == "shard":
        return WrongShard(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidPath(msg) if kind == "path" else InvalidArgument(msg)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(msg)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(msg)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionDenied(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Busy(msg)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(msg)
    return L2fsError(f"{code.name}: {msg}")
