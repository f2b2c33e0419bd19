"""Per-item results of batched RPCs (AllocateMany, CommitMany, ReserveLocalMany, AdoptLocalMany), the
wire protocol version rule and the worker manifest's format version. Why per item: one bad path or one lost race inside a batch must fail that item
only, exactly as it would have failed its own unary call, never its neighbours."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from l2fs.common.errors import PathError, RpcError
from l2fs.proto import l2fs_pb2 as pb

T = TypeVar("T")
R = TypeVar("R")

# Wire protocol: 1 = before versions existed (a peer that sends no version field, read as 0, is 1);
# 2 = batched calls (AllocateMany/CommitMany/ReserveLocalMany/AdoptLocalMany/ReleaseLocal) and the version
# fields; 3 = block capabilities (RegisterResponse.data_key, Location.capability and the capability fields
# of the block calls): a protocol-3 worker under a master with a block key accepts only capabilities on its
# data plane, fd socket and block calls, so an older client is refused there (DENIED / PERMISSION_DENIED: a
# failed put, a read miss), and the master mints capabilities only for workers that registered with >= 3.
# 4 = seal MACs (BlockReport.seal, the worker call SealBlocks): a master with a block key pushes each committed
# block's seal to its worker (>= 4 only) and, after a restart, publishes a reported block only when its seal
# verifies; a protocol-3 worker is served, but its blocks are not published again after a master restart.
# A peer below MIN_PEER_VERSION is refused with both versions named; a newer peer is served as long
# as it accepts us (its min_protocol_version <= PROTOCOL_VERSION). New calls are optional: a caller that
# gets UNIMPLEMENTED from an older peer falls back to the unary calls.
# 5 = size-bound write capabilities: a master with a block key mints a worker of >= 5 write capabilities whose
# MAC also covers the allocated size, and such a worker (once each of its masters is >= 5) verifies a write's
# capability with the size the write declares (data plane header, WriteBlock, ReserveLocal, AdoptLocal), so a
# writer cannot reserve or send more than it was allocated; older peers keep the size-free MAC.
# 6 = capabilities that name their holder (c2, l2fs/common/capability.py): a master with a block key mints a worker
# of >= 6 capabilities carrying the caller's holder_id, and the worker bounds data-plane connections and block
# streams per holder as well as per address. c1 capabilities (older masters or workers, no authentication) are
# still taken everywhere and limited per address only; clients pass capabilities through unread, so an older
# client works with c2 ones (it only cannot read their expiry: it finds out from the worker's refusal).
PROTOCOL_VERSION = 6
SIZED_CAPABILITIES = 5
HOLDER_CAPABILITIES = 6
MIN_PEER_VERSION = 1
# Worker manifest format (SQLite `PRAGMA user_version` of each data dir's manifest): 0 = written before the
# stamp, the same table as 1; 2 = the seal column (a format-0/1 manifest gets it, its blocks unsealed). A worker
# refuses to start on a manifest newer than it reads (it would misread it) and stamps older ones it can read.
MANIFEST_VERSION = 2
# Master journal of pending deletes/renames (`l2fs master --journal`, SQLite `PRAGMA user_version`): a master
# refuses to start on a journal newer than it reads.
JOURNAL_VERSION = 1

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def peer_version(v: int) -> int:
    """A version field as sent: 0 means the peer predates versions (protocol 1)."""
    return v or 1


def version_mismatch(me: str, peer: str, peer_v: int, peer_min: int, *, mine: int = PROTOCOL_VERSION,
                     my_min: int = MIN_PEER_VERSION) -> str | None:
    """Why `me` and `peer` cannot talk (a message naming both versions), or None when they can."""
    peer_v = peer_version(peer_v)
    if peer_v < my_min:
        return (f"{peer} speaks l2fs protocol {peer_v}, older than the oldest this {me} (protocol {mine}) "
                f"accepts ({my_min}): upgrade the {peer}")
    if peer_min > mine:
        return (f"{peer} (protocol {peer_v}) needs protocol >= {peer_min}, this {me} speaks {mine}: "
                f"upgrade the {me}")
    return None


def item_error(e: Exception) -> pb.ItemError:
    """An item's failure as it travels in a batched response (same code/kind/errno as the unary call)."""
    if isinstance(e, PathError):
        return pb.ItemError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=str(e), kind="path",
                            errno_name=e.errno_name)
    if isinstance(e, RpcError):
        return pb.ItemError(code=e.code.value[0], message=str(e), errno_name=e.errno_name or "", kind=e.kind or "")
    return pb.ItemError(code=grpc.StatusCode.INTERNAL.value[0], message=f"{type(e).__name__}: {e}")


def each(items: list[R], one: Callable[[R], T], failed: Callable[[pb.ItemError], T]) -> list[T]:
    """one(item) for every item; an item that raises becomes failed(its ItemError)."""
    out = []
    for it in items:
        try:
            out.append(one(it))
        except (RpcError, PathError) as e:
            out.append(failed(item_error(e)))
    return out


def status_code(err: pb.ItemError) -> grpc.StatusCode:
    return _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
