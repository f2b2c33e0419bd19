"""Path rules shared by master, worker and client: normalisation, limits, block ids, the shard hash."""

from __future__ import annotations

import re
import zlib

import grpc

from l2fs.common.errors import PathError, RpcError

MAX_PATH_LEN = 4096
MAX_NAME_LEN = 255


# block ids are 32 lowercase hex (uuid4, or minted by BlockKey): also what makes them safe file names
BLOCK_ID = re.compile(r"^[0-9a-f]{32}$")


def check_block_id(bid: str) -> str:
    """`bid` when it is a well-formed block id, else INVALID_ARGUMENT (it becomes a file name on workers)."""
    if not BLOCK_ID.match(bid or ""):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed block id {bid[:80]!r}")
    return bid


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # NUL, C0 controls, DEL; a per-character generator cost 27 % of the
# master's GIL time per put (docs/results.md section 5)


# An ASCII path that is already normal: components of 1-255 characters, no control characters, none "." or
# "..". Such a path (every KV chunk's) is returned as it is in one regex match; anything else takes the
# component-by-component route below, which also says what is wrong.
_NORMAL_ASCII = re.compile(r"(?:/(?!\.\.?(?:/|$))[^/\x00-\x1f\x7f]{1,255})+")


def norm_path(path: str) -> str:
    """Validate an l2fs path and return it normalised (no trailing slash; "/" for the root).

    Rejected: non-str, empty, relative, NUL/control bytes, "." or ".." components, empty components
    ("a//b"), over-long names or paths. Rejecting instead of resolving means no path can escape.
    """
    if type(path) is str and len(path) <= MAX_PATH_LEN and path.isascii() and _NORMAL_ASCII.fullmatch(path):
        return path
    return _norm_path_checked(path)


def _norm_path_checked(path: str) -> str:
    """norm_path the long way: each rule in turn, with its own message."""
    if not isinstance(path, str) or not path:
        raise PathError("path must be a non-empty string")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_LEN:
        raise PathError(f"path longer than {MAX_PATH_LEN} bytes", "ENAMETOOLONG")
    if not path.startswith("/"):
        raise PathError(f"path must be absolute (start with '/'): {path!r}")
    if _CONTROL.search(path):
        raise PathError(f"path contains NUL or control characters: {path!r}")
    try:  # a lone surrogate (e.g. from os.fsdecode of a non-UTF-8 name) cannot go on the wire
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise PathError(f"path is not valid UTF-8: {path!r}") from None
    if path == "/":
        return "/"
    body = path[1:-1] if path.endswith("/") else path[1:]
    parts = body.split("/")
    for p in parts:
        if p == "":
            raise PathError(f"path has an empty component: {path!r}")
        if p in (".", ".."):
            raise PathError(f"path has a '.' or '..' component: {path!r}")
        if len(p.encode()) > MAX_NAME_LEN:
            raise PathError(f"path component longer than {MAX_NAME_LEN} bytes", "ENAMETOOLONG")
    return "/" + "/".join(parts)


# KV paths are content hashes, so the namespace shards by path hash: each master owns the files whose
# normalised path hashes to its index. One function, used by every role (master refusal, worker reports,
# client routing): a mismatch would split the namespace.

def shard_of(path: str, shards: int) -> int:
    """The shard (0..shards-1) that owns the normalised `path`: crc32 of its UTF-8 bytes, mod shards."""
    if shards <= 1:
        return 0
    return zlib.crc32(path.encode("utf-8", "surrogatepass")) % shards


def parent_of(path: str) -> str:
    """Parent directory of a normalised path ("/" for top-level entries)."""
    i = path.rfind("/")
    return "/" if i <= 0 else path[:i]
