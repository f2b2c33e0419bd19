"""Pieces shared by the l2fs master, worker and client: path rules, sizes, auth, TLS, metrics HTTP."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc

MAX_PATH_LEN = 4096
MAX_NAME_LEN = 255
DEFAULT_MAX_FILE_SIZE = 1 << 30
FRAME = 4 << 20  # gRPC data frame size
MAX_MSG = 64 << 20  # gRPC max message size (frames are well under it)
MAX_STREAMS = 256  # concurrent calls on one client connection (our clients keep <= 64 in flight)
# Server options. The receive limit stays MAX_MSG for every method because gRPC Python has no per-method
# limit and RegisterWorker carries the worker's whole block report in one message (~250 B per block:
# 64 MiB is ~250k blocks) until it is paged; unauthenticated calls never get that far (TokenInterceptor).
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
    ("grpc.max_concurrent_streams", MAX_STREAMS),
    ("grpc.so_reuseport", 0),
]
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
    ("grpc.enable_retries", 1),
    # gRPC's default reconnect backoff grows to 120 s: after a master outage the workers' heartbeat
    # channels would wait that long to re-register (13.6 s measured after a 25 s outage). Cap it at 1 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# block ids are 32 lowercase hex (uuid4, or minted by BlockKey): also what makes them safe file names
BLOCK_ID = re.compile(r"^[0-9a-f]{32}$")
ERROR_KIND_KEY = "l2fs-error"  # trailing metadata naming the error kind (e.g. "path"), so clients need no text


def check_block_id(bid: str) -> str:
    """`bid` when it is a well-formed block id, else INVALID_ARGUMENT (it becomes a file name on workers)."""
    if not BLOCK_ID.match(bid or ""):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed block id {bid[:80]!r}")
    return bid


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


def rpc_handler(latency: Any, errors: Any | None = None) -> Callable[[Callable], Callable]:
    """Decorator for servicer methods: time each call (`latency` histogram, labelled by method), count
    errors (`errors` counter, by method and code) and map RpcError/PathError to a gRPC status."""

    def decorate(method: Callable) -> Callable:
        name = method.__name__
        # the labelled child once, not a labels() lookup per call (13 % of the master's GIL time per put)
        observe = latency.labels(name).observe

        @functools.wraps(method)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                return method(self, request, context)
            except PathError as e:
                if errors is not None:
                    errors.labels(name, "INVALID_ARGUMENT").inc()
                context.set_trailing_metadata(((ERROR_KIND_KEY, "path"), ("l2fs-errno", e.errno_name)))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RpcError as e:
                if errors is not None:
                    errors.labels(name, e.code.name).inc()
                trailers = ((("l2fs-errno", e.errno_name),) if e.errno_name else ()) + (
                    ((ERROR_KIND_KEY, e.kind),) if e.kind else ())
                if trailers:
                    context.set_trailing_metadata(trailers)
                context.abort(e.code, str(e))
            finally:
                observe(time.perf_counter() - t0)

        return wrapper

    return decorate


def wait_for_stop_signal() -> None:
    """Block until SIGTERM or SIGINT: servers then shut down cleanly on either."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


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


# ---------- shards ----------
# KV paths are content hashes, so the namespace shards by path hash: each master owns the files whose
# normalised path hashes to its index. One function, used by every role (master refusal, worker reports,
# client routing): a mismatch would split the namespace.

def shard_of(path: str, shards: int) -> int:
    """The shard (0..shards-1) that owns the normalised `path`: crc32 of its UTF-8 bytes, mod shards."""
    if shards <= 1:
        return 0
    return zlib.crc32(path.encode("utf-8", "surrogatepass")) % shards


def parse_masters(spec: str) -> list[list[str]]:
    """'m0a:p,m0b:p;m1:p' -> [['m0a:p', 'm0b:p'], ['m1:p']]: ';' separates shards (each its own namespace
    slice), ',' the failover addresses of one shard. A spec without ';' is one shard, as before."""
    shards = [[a.strip() for a in part.split(",") if a.strip()] for part in (spec or "").split(";")]
    if not shards or any(not s for s in shards):
        raise ValueError(f"bad l2fs master list {spec!r}: want host:port[,host:port][;host:port...] "
                         f"(';' between shards, ',' between one shard's failover masters)")
    return shards


def parse_shard(spec: str) -> tuple[int, int]:
    """'1/2' -> (1, 2): this master's shard index and the shard count (`l2fs master --shard`)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"bad shard {spec!r}: want INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 0/2")
    return int(m.group(1)), int(m.group(2))


_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,252}[A-Za-z0-9])?):(\d{1,5})$")


def valid_address(addr: str) -> bool:
    """host:port with a DNS name, IPv4 or [IPv6] host and a port in 1..65535."""
    m = _HOSTPORT.match(addr or "")
    return m is not None and 0 < int(m.group(2)) < 65536


def parent_of(path: str) -> str:
    """Parent directory of a normalised path ("/" for top-level entries)."""
    i = path.rfind("/")
    return "/" if i <= 0 else path[:i]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?[bB]?)\s*$")


def parse_size(text: str | int) -> int:
    """'10G', '512M', '1.5g', '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r} (use e.g. 512M, 10G)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for launchers and tests that must name a port up front)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_port_file(path: str | None, **info: Any) -> None:
    """Atomically write bound ports as JSON so launchers using --port 0 can find them."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(info))
    os.replace(tmp, path)


# ---------- auth ----------

log = logging.getLogger("l2fs.common")

ROLES = ("worker", "engine", "router", "mount", "admin")
# role sets for the per-method policies of master and worker (TokenInterceptor): the method's name -> these
WORKERS = frozenset({"worker"})
READERS = frozenset({"admin", "engine", "router", "mount"})
# engines further limited to put-if-absent under their prefixes, mounts to their prefixes (Credential.may_write)
WRITERS = frozenset({"admin", "engine", "mount"})
REMOVERS = frozenset({"admin", "mount"})  # Delete/Rename: a mount only of files it wrote (may_replace)
ADMINS = frozenset({"admin"})


class TokensFileError(ValueError):
    """A --tokens-file that cannot be used (the processes exit 2 with this message)."""


@dataclass(frozen=True)
class Credential:
    """Who a bearer token is: its name (for logs), roles, the path prefixes an engine may write under, and the
    node a worker credential is bound to ("" = any node: the weaker, in-memory-only binding)."""

    name: str
    roles: frozenset[str]
    prefixes: tuple[str, ...] = ()
    node: str = ""

    def may_be_worker(self, worker_id: str, node_id: str | None = None) -> bool:
        """A node-bound worker credential may only act as a worker of its node: node_id (when given) equal to
        the node, and the worker id the node itself or "<node>-..." (the worker's default id). Static, so it
        holds across master restarts, unlike the in-memory owner binding."""
        if not self.node:
            return True
        if node_id is not None and node_id != self.node:
            return False
        return worker_id == self.node or worker_id.startswith(self.node + "-")

    def may_write(self, path: str, if_absent: bool, mkdir: bool = False) -> bool:
        """admin: anything; engine: put-if-absent under one of its prefixes (and mkdir of the prefixes'
        ancestors, which the connector creates); mount: puts under its prefixes, an overwrite only of a file
        it wrote itself (the master checks that against the file: may_replace); everyone else: nothing."""
        if "admin" in self.roles:
            return True
        if not (("engine" in self.roles and if_absent) or "mount" in self.roles):
            return False
        return any(p == "/" or path == p or path.startswith(p + "/")
                   or (mkdir and (path == "/" or p.startswith(path + "/"))) for p in self.prefixes)

    def may_replace(self, writer: str) -> bool:
        """Whether this credential may overwrite, delete or rename away a file that credential `writer` wrote
        ("" = unknown: reported by a worker after a master restart): admin any; mount only its own (a FUSE
        publish after more writes, LMCache's temp file renamed into place or unlinked after a failed write);
        never another's."""
        return "admin" in self.roles or ("mount" in self.roles and bool(writer) and writer == self.name)


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def token_digest(token: str | bytes) -> str:
    """The verifier of a token: hex SHA-256 of its bytes (a verifier file holds these instead of tokens)."""
    raw = token if isinstance(token, bytes) else token.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


def load_token_entries(path: str) -> list[tuple[str, str, Credential]]:
    """[(token or "", sha256 hex of the token, credential)] from a JSON list of {"name", "token" | "sha256",
    "role", "prefixes", "node"}; TokensFileError says what is wrong (a typo must stop the process, not silently
    open or close the cluster). "node" (worker role only) binds a worker credential to one node's worker ids
    (Credential.may_be_worker). An entry with "sha256" instead of "token" is a verifier: the server accepts the
    token whose digest it is but cannot present it (a verifier file lets workers check tokens they do not hold)."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TokensFileError(f"tokens file {path}: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise TokensFileError(f"tokens file {path}: want a non-empty JSON list of {{name, token, role, prefixes}}")
    out: list[tuple[str, str, Credential]] = []
    seen: set[str] = set()
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"tokens file {path} entry {i}"
        if not isinstance(entry, dict) or set(entry) - {"name", "token", "sha256", "role", "prefixes", "node"}:
            raise TokensFileError(f"{where}: want an object with keys name, token (or sha256), role, prefixes, node")
        token, role, prefixes = entry.get("token"), entry.get("role"), entry.get("prefixes", [])
        node = entry.get("node", "")
        if ("token" in entry) == ("sha256" in entry):
            raise TokensFileError(f"{where}: want exactly one of token and sha256")
        if "sha256" in entry:
            digest = entry["sha256"]
            if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
                raise TokensFileError(f"{where}: sha256 must be 64 lowercase hex characters (sha256 of the token)")
            token = ""
        elif not isinstance(token, str) or len(token) < 16:
            raise TokensFileError(f"{where}: token must be a string of at least 16 characters")
        else:
            digest = token_digest(token)
        if digest in seen:
            raise TokensFileError(f"{where}: duplicate token")
        if role not in ROLES:
            raise TokensFileError(f"{where}: role must be one of {', '.join(ROLES)}, not {role!r}")
        if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
            raise TokensFileError(f"{where}: prefixes must be a list of paths")
        if role in ("engine", "mount") and not prefixes:
            raise TokensFileError(f"{where}: {'an' if role == 'engine' else 'a'} {role} token needs at least one "
                                  f"prefix it may write under")
        if "node" in entry and (role != "worker" or not isinstance(node, str) or not 0 < len(node) <= 253
                                or any(ord(ch) < 33 for ch in node)):
            raise TokensFileError(f"{where}: node must be a node name (1-253 printable characters, no spaces) "
                                  f"on a worker-role entry")
        try:
            norm = tuple(norm_path(p) for p in prefixes)
        except PathError as err:
            raise TokensFileError(f"{where}: {err}") from None
        name = str(entry.get("name") or f"entry{i}")
        if name in names:  # the name is the identity a worker id is bound to: two holders must not share it
            raise TokensFileError(f"{where}: duplicate name {name!r}")
        seen.add(digest)
        names.add(name)
        out.append((token, digest, Credential(name, frozenset({role}), norm, node)))
    return out


def load_tokens_file(path: str) -> list[tuple[str, Credential]]:
    """[(token, credential)] of a tokens file (load_token_entries); token "" for a verifier-only entry."""
    return [(t, c) for t, _, c in load_token_entries(path)]


class FileToken:
    """A bearer token read from a file at every use (a projected ServiceAccount token: the kubelet rewrites
    it before it expires, so a copy taken at start-up would go stale). An unreadable file gives "" (the call
    then fails UNAUTHENTICATED and is retried, like any refused heartbeat)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> str:
        try:
            return Path(self.path).read_text().strip()
        except OSError as e:
            log.warning("token file %s: %s", self.path, e.strerror or e)
            return ""


class Credentials:
    """The tokens a server accepts and what each may do. Without a tokens file the single `--token` is the
    old shared secret (admin + worker: every holder can do everything, the insecure-between-pods mode);
    with neither (and no `identity`), authentication is off (`enabled` False, every call allowed).

    Tokens are matched by their SHA-256 (load_token_entries), so a verifier file (digests only) checks the
    same tokens as the full file. `identity` (l2fs.identity.K8sIdentity) turns a bearer token no entry knows
    into a node-bound worker or mount credential, for the methods where the caller asks for it (`review`)."""

    LEGACY = frozenset({"admin", "worker"})

    def __init__(self, token: str | None = None, tokens_file: str | None = None, identity: Any = None) -> None:
        if tokens_file:
            self.entries = load_token_entries(tokens_file)
        elif token:
            self.entries = [(token, token_digest(token), Credential("shared-token", self.LEGACY))]
        else:
            self.entries = []
        self.identity = identity
        self._digests = [(bytes.fromhex(d), c) for _, d, c in self.entries]

    @property
    def enabled(self) -> bool:
        return bool(self.entries) or self.identity is not None

    def _match(self, got: bytes) -> Credential | None:
        digest = hashlib.sha256(got).digest()
        found = None
        for want, cred in self._digests:  # compare against every entry in constant time: no guessing by timing
            if hmac.compare_digest(digest, want):
                found = cred
        return found

    def from_metadata(self, metadata: Any, review: bool = True) -> Credential | None:
        """The credential of `authorization: Bearer <token>`; a token no entry knows goes to `identity` when
        `review` (the interceptor asks only on methods a role the identity grants may call: worker methods,
        and client methods only with a mount ServiceAccount configured; so strangers cannot make every call
        cost an API round trip)."""
        got = dict(metadata or ()).get("authorization", "")
        got = got if isinstance(got, bytes) else str(got).encode("utf-8", "surrogatepass")
        if not got.startswith(b"Bearer "):
            return None
        raw = got[len(b"Bearer "):]
        cred = self._match(raw)
        if cred is None and review and self.identity is not None and raw:
            cred = self.identity.review(raw.decode("utf-8", "replace"))
        return cred

    def data_token_ok(self, token: bytes) -> bool:
        """Token mode of the raw-TCP data plane (a worker whose master has no block key): any known token,
        whatever its role. With a block key the worker takes per-block capabilities instead
        (l2fs.capability.DataGate)."""
        return not self.entries or self._match(token) is not None

    def caller(self, context: grpc.ServicerContext) -> Credential | None:
        """The credential of a call already past TokenInterceptor; None when authentication is off."""
        return self.from_metadata(context.invocation_metadata()) if self.enabled else None

    def check_write(self, context: grpc.ServicerContext, writes: Any, mkdir: bool = False) -> None:
        """PERMISSION_DENIED unless the caller may make every (path, if_absent) write (prefix known only once
        the message is read). The caller is looked up once per call, not per item of a batch."""
        cred = self.caller(context)
        if cred is None:
            return
        for p, if_absent in writes:
            if not cred.may_write(norm_path(p), if_absent, mkdir):
                what = "put-if-absent" if if_absent else "overwrite"
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"token {cred.name!r} ({', '.join(sorted(cred.roles))}) may not {what} {p}", "EACCES")

    def outbound_token(self, own: str | None) -> str | None:
        """The token a master uses to call workers: its own --token, else the first worker-role entry."""
        if own:
            return own
        return next((t for t, _, c in self.entries if t and "worker" in c.roles), None)


class BlockKeyError(ValueError):
    """A --block-key-file that cannot be used (the master exits 2 with this message)."""


BLOCK_KEY_MIN = 32  # bytes: a 256-bit HMAC key


def load_block_key(path: str) -> bytes:
    """The raw bytes of a block-key file (>= BLOCK_KEY_MIN of them, taken as they are: every master reads the
    same Secret the same way); BlockKeyError says what is wrong."""
    try:
        key = Path(path).read_bytes()
    except OSError as e:
        raise BlockKeyError(f"block key file {path}: {e.strerror or e}") from None
    if len(key) < BLOCK_KEY_MIN:
        raise BlockKeyError(f"block key file {path}: {len(key)} bytes, want at least {BLOCK_KEY_MIN} random bytes "
                            f"(e.g. kvtier tokens generate --block-key FILE, or head -c 32 /dev/urandom > FILE)")
    return key


def new_block_key() -> bytes:
    """A fresh block key: 64 random hex characters (32 bytes of entropy, printable, so it fits a Secret's
    stringData and a file alike)."""
    return secrets.token_hex(32).encode()


def ensure_block_key(path: str | os.PathLike[str]) -> Path:
    """Create `path` (0600, 64 random hex characters) unless it exists; the file either way. Local clusters keep
    it in their state dir, so a restarted master verifies the blocks its predecessor minted."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return p
    with os.fdopen(fd, "wb") as f:
        f.write(new_block_key())
    return p


class BlockKey:
    """Mints and verifies block ids that are their own MAC (issue 13: blocks the master never allocated are
    never published).

    An id is 16 hex of randomness + the first 16 hex of HMAC-SHA256(key, worker_id \\0 random \\0 size). Why
    the id itself and not a MAC stored next to it: ids stay 32 lowercase hex, so BLOCK_ID, block file names,
    the worker manifest and the wire are unchanged; there is nothing extra to store, push or lose; it needs no
    master memory, so it survives a master restart; and every shard's master holds the same key, so any of
    them verifies what another minted. A worker-credential holder cannot forge one (64 MAC bits, checked per
    report/commit) and cannot move one to another worker id or size. Not bound: the path (renames change it;
    the block's own worker could still report it under another path) and the CRC (chosen after the id)."""

    RAND, MAC = 16, 16  # hex characters of each half

    def __init__(self, key: bytes) -> None:
        if len(key) < BLOCK_KEY_MIN:
            raise BlockKeyError(f"block key of {len(key)} bytes, want at least {BLOCK_KEY_MIN}")
        self._key = key

    @property
    def key(self) -> bytes:
        """The raw key (l2fs.capability derives each worker's data key from it)."""
        return self._key

    def _mac(self, worker_id: str, rand: str, size: int) -> str:
        msg = f"{worker_id}\0{rand}\0{size}".encode("utf-8", "surrogatepass")
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:self.MAC]

    def mint(self, worker_id: str, size: int) -> str:
        rand = secrets.token_hex(self.RAND // 2)
        return rand + self._mac(worker_id, rand, size)

    def verify(self, block_id: str, worker_id: str, size: int) -> bool:
        """Whether `block_id` was minted by a master with this key for exactly this worker id and size."""
        if not BLOCK_ID.match(block_id or ""):
            return False
        rand, mac = block_id[:self.RAND], block_id[self.RAND:]
        return hmac.compare_digest(mac, self._mac(worker_id, rand, size))


class TokenInterceptor(grpc.ServerInterceptor):
    """Maps `authorization: Bearer <token>` metadata to a credential and checks its roles against the
    method's `policy` entry (method name -> roles allowed; unlisted methods: admin only), before the request
    message is read: unknown token UNAUTHENTICATED, known token with the wrong role PERMISSION_DENIED.

    Why request-streaming deny handlers for every method: gRPC Python reads a unary request whole before
    it calls even a denying handler (a 60 MiB unauthenticated call cost the master its full size, several
    at once +360 MiB). A handler for a request stream is called before any message is read, and the wire
    does not tell unary from streaming, so the stranger's call ends with UNAUTHENTICATED after at most the
    HTTP/2 flow-control window has been buffered."""

    def __init__(self, creds: Credentials | str, policy: dict[str, frozenset[str]] | None = None) -> None:
        self._creds = creds if isinstance(creds, Credentials) else Credentials(creds)
        self._policy = policy

        def denier(code: grpc.StatusCode, msg: str) -> tuple[Any, Any]:
            def deny(_requests: Any, context: grpc.ServicerContext) -> Any:
                context.abort(code, msg)
            return grpc.stream_unary_rpc_method_handler(deny), grpc.stream_stream_rpc_method_handler(deny)

        self._unauth = denier(grpc.StatusCode.UNAUTHENTICATED, "missing or bad l2fs bearer token")
        self._forbidden = denier(grpc.StatusCode.PERMISSION_DENIED, "this l2fs token's role may not call this method")

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        name = method.rpartition("/")[2]
        # an unknown token is reviewed (l2fs.identity) only on methods a role the identity grants may call
        grantable = getattr(self._creds.identity, "roles", WORKERS)
        review = self._policy is not None and bool(grantable & self._policy.get(name, ADMINS))
        cred = self._creds.from_metadata(handler_call_details.invocation_metadata, review=review)
        if cred is not None:
            if self._policy is None or cred.roles & self._policy.get(name, frozenset({"admin"})):
                return continuation(handler_call_details)
            deny = self._forbidden
        else:
            deny = self._unauth
        return deny[1] if name == "ReadBlock" else deny[0]  # ReadBlock: the one server-streaming method


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the bearer token (None when no token is configured)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials | None:
    """TLS server credentials when both --tls-cert and --tls-key are given."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def grpc_server(host: str, port: int, add_servicer: Callable[[grpc.Server], None], *, name: str,
                token: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                threads: int = 32, creds: Credentials | None = None,
                policy: dict[str, frozenset[str]] | None = None) -> tuple[grpc.Server, int, bool]:
    """A bound, not yet started gRPC server for master or worker: thread pool, message limits, bearer-token
    and role check (`creds`, else the single `token`) when configured, TLS when cert and key are given.
    Returns (server, bound port, TLS on)."""
    creds = creds if creds is not None else Credentials(token)
    interceptors = [TokenInterceptor(creds, policy)] if creds.enabled else []
    server = grpc.server(futures.ThreadPoolExecutor(threads, thread_name_prefix=name),
                         interceptors=interceptors, options=GRPC_OPTIONS)
    add_servicer(server)
    creds = server_credentials(tls_cert, tls_key)
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"could not bind {addr}")
    return server, bound, creds is not None


def make_channel(address: str, tls_ca: str | None) -> grpc.Channel:
    """A client channel (TLS when a CA bundle is given) with large message limits."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.secure_channel(address, creds, options=CLIENT_OPTIONS)
    return grpc.insecure_channel(address, options=CLIENT_OPTIONS)


# ---------- metrics / health HTTP ----------

def start_metrics_server(host: str, port: int, health: Callable[[], dict]) -> ThreadingHTTPServer:
    """Serve Prometheus /metrics and JSON /healthz on a separate HTTP port (0 = pick a free one)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, code = generate_latest(), CONTENT_TYPE_LATEST, 200
            elif path in ("/healthz", "/readyz"):
                try:
                    info = health()
                    key = "ready" if path == "/readyz" else "ok"  # ready: e.g. worker registered
                    code = 200 if info.get(key, info.get("ok", True)) else 503
                except Exception as e:  # noqa: BLE001 - health must answer, never crash the server
                    info, code = {"ok": False, "error": str(e)}, 503
                body, ctype = json.dumps(info).encode(), "application/json"
            else:
                body, ctype, code = b"not found; try /metrics or /healthz\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="l2fs-metrics", daemon=True).start()
    return srv


# ---------- parallel CRC32C ----------
# A 14.7 MB KV chunk takes ~1.5 ms to checksum on one core, as long as the read itself when the file is
# in the page cache. Large buffers are split into 4 MiB pieces checksummed on a small thread pool (the
# crc32c extension releases the GIL) and recombined with the GF(2) shift operator for 4 MiB of zeros.

_CRC_POLY = 0x82F63B78  # CRC32C, reflected
_CRC_PIECE_LOG2 = 22
_CRC_PIECE = 1 << _CRC_PIECE_LOG2
_crc_op: list[int] | None = None
_crc_pool = None
_crc_lock = threading.Lock()


def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _crc_setup() -> tuple[list[int], Any]:
    """Shift operator for one piece of zeros (computed once, ~3 ms) and the pool."""
    global _crc_op, _crc_pool
    with _crc_lock:
        if _crc_op is None:
            from concurrent.futures import ThreadPoolExecutor

            m = [_CRC_POLY] + [1 << n for n in range(31)]  # one zero bit
            for _ in range(3 + _CRC_PIECE_LOG2):
                m = [_gf2_times(m, m[n]) for n in range(32)]
            _crc_pool = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="l2fs-crc")
            _crc_op = m
        return _crc_op, _crc_pool


def crc32c_fast(buf: bytes | bytearray | memoryview) -> int:
    """CRC32C of buf, identical to crc32c.crc32c(buf); parallel for buffers of 8 MiB and more."""
    import crc32c

    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if n < 2 * _CRC_PIECE or (os.cpu_count() or 1) < 2:
        return crc32c.crc32c(mv)
    op, pool = _crc_setup()
    first = n % _CRC_PIECE or _CRC_PIECE  # only the first piece may be short: one operator suffices
    pieces = [mv[:first]] + [mv[o:o + _CRC_PIECE] for o in range(first, n, _CRC_PIECE)]
    crcs = list(pool.map(lambda p: crc32c.crc32c(p, gil_release_mode=1), pieces))
    c = crcs[0]
    for x in crcs[1:]:
        c = _gf2_times(op, c) ^ x
    return c


def crc_pieces(n: int) -> list[tuple[int, int]]:
    """(start, end) of the pieces crc32c_fast/CrcPipeline use: only the first may be short."""
    if n < 2 * _CRC_PIECE:
        return [(0, n)]
    first = n % _CRC_PIECE or _CRC_PIECE
    return [(0, first)] + [(o, o + _CRC_PIECE) for o in range(first, n, _CRC_PIECE)]


class CrcPipeline:
    """Checksum pieces (from crc_pieces) on the pool while the caller reads/receives the next one, so
    verification overlaps I/O instead of following it."""

    def __init__(self, pieces: int = 0) -> None:
        """pieces: how many add() calls will follow, when known. With one there is nothing to overlap: it is
        checksummed inline (GIL released), which saves a pool hop per small object (~0.15 ms per 1 MiB chunk)."""
        self._parts: list[Any] = []  # crc (inline) or a future of one
        self._inline = pieces == 1
        self._op, self._pool = _crc_setup()

    def add(self, piece: memoryview) -> None:
        import crc32c

        if self._inline:
            self._parts.append(crc32c.crc32c(piece, 0, 1))
        else:
            self._parts.append(self._pool.submit(crc32c.crc32c, piece, 0, 1))

    def result(self) -> int:
        crcs = [p if isinstance(p, int) else p.result() for p in self._parts]
        if not crcs:
            return 0
        c = crcs[0]
        for x in crcs[1:]:
            c = _gf2_times(self._op, c) ^ x
        return c
