"""Who may call what: roles, credentials, tokens files and the TokenInterceptor that checks them."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from l2fs.common.errors import PathError, RpcError
from l2fs.common.paths import norm_path

log = logging.getLogger("l2fs.common")

ROLES = ("worker", "engine", "router", "mount", "admin")
# role sets for the per-method policies of master and worker (TokenInterceptor): the method's name -> these
WORKERS = frozenset({"worker"})
READERS = frozenset({"admin", "engine", "router", "mount"})
# engines further limited to put-if-absent under their prefixes, mounts to their prefixes (Credential.may_write)
WRITERS = frozenset({"admin", "engine", "mount"})
REMOVERS = frozenset({"admin", "mount"})  # Delete/Rename: a mount only of files it wrote (may_replace)
ADMINS = frozenset({"admin"})
# Read scopes: engine and mount credentials read, list and look up only under their read prefixes (and see the
# directories on the way to them); the other roles read everywhere (a router looks up every endpoint).
SCOPED_READERS = frozenset({"engine", "mount"})
# What an engine or mount entry reads when its tokens-file entry names no "read_prefixes": its own prefixes and
# the shared key-compatibility records (kvtier.contract.META_PREFIX, which every replica's connector lists and
# reads: connector.fingerprint; l2fs imports nothing of kvtier, tests/kvtier/test_kvtier_tokens.py ties the two)
SHARED_READ_PREFIXES = ("/kvtier/meta",)
# Where an engine may also write, and overwrite what it wrote itself: its replicas' records there (key-compat
# fingerprints and the installed LMCache's known-answer keys, rewritten while the engine runs), which routers
# and the other replicas read. Only its own files: another engine's record answers EACCES.
SHARED_RECORD_PREFIXES = SHARED_READ_PREFIXES


def read_scope(roles: frozenset[str], prefixes: tuple[str, ...],
               read_prefixes: tuple[str, ...] | None = None) -> tuple[str, ...] | None:
    """The prefixes a credential may read under, None = everywhere. Admin, router (and worker, which has no
    read calls) read everywhere; an engine or mount reads its write prefixes (what it may write it may look
    up: put-if-absent answers "exists" anyway) plus `read_prefixes`, by default SHARED_READ_PREFIXES."""
    if not roles & SCOPED_READERS or roles & {"admin", "router"}:
        return None
    out = tuple(sorted({*prefixes, *(SHARED_READ_PREFIXES if read_prefixes is None else read_prefixes)}))
    return None if "/" in out else out


class TokensFileError(ValueError):
    """A --tokens-file that cannot be used (the processes exit 2 with this message)."""


WORKER_ID_SEP = "@"  # between a worker id's node name and its suffix: no Kubernetes node name holds it


def worker_node(worker_id: str) -> str:
    """The node a worker id names: all of it up to the first WORKER_ID_SEP (the whole id without one).
    Node names cannot contain the separator (DNS subdomain names; tokens-file nodes are checked), so no
    node's name extends another's ids."""
    return worker_id.partition(WORKER_ID_SEP)[0]


def new_worker_id(node_id: str) -> str:
    """A fresh worker id of `node_id`: "<node>@<8 hex>"."""
    return f"{node_id}{WORKER_ID_SEP}{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Credential:
    """Who a bearer token is: its name (for logs), roles, the path prefixes an engine may write under, the node
    a worker credential is bound to ("" = any node: the weaker, in-memory-only binding) and the extra prefixes
    an engine or mount reads under (`read_prefixes`, None = SHARED_READ_PREFIXES; `reads` is the whole scope,
    read_scope)."""

    name: str
    roles: frozenset[str]
    prefixes: tuple[str, ...] = ()
    node: str = ""
    # a mount's: prefixes served by an engine credential (an endpoint of its own, plugin mode), which no mount
    # may write under (Credentials sets them from the tokens file: Credentials.bounded)
    excluded: tuple[str, ...] = ()
    read_prefixes: tuple[str, ...] | None = None
    # derived (read_scope): every prefix it reads under, None = everywhere; and those + "/" for one startswith
    reads: tuple[str, ...] | None = field(init=False, repr=False, compare=False)
    _read_dirs: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        reads = read_scope(self.roles, self.prefixes, self.read_prefixes)
        object.__setattr__(self, "reads", reads)
        object.__setattr__(self, "_read_dirs", tuple(p + "/" for p in reads or ()))

    def may_read(self, path: str) -> bool:
        """Whether this credential may look `path` up (Stat, StatMany, PrefixLookup, List) and so get a read
        capability for its block: at or under one of its read prefixes (`reads`), or anywhere when unscoped."""
        return self.reads is None or path in self.reads or path.startswith(self._read_dirs)

    def leads_to(self, path: str) -> bool:
        """Whether `path` is a directory on the way to a read prefix (a strict ancestor of one): it may see that
        such a directory exists, and in a listing of it only the entries on the way (visible_names)."""
        if self.reads is None:
            return True
        return path == "/" or any(p.startswith(path + "/") for p in self.reads)

    def visible_names(self, path: str) -> set[str] | None:
        """The child names of directory `path` this credential may see in a listing: None = all of them (it may
        read `path`), else the next components towards its read prefixes (empty: none)."""
        if self.may_read(path):
            return None
        base = "" if path == "/" else path
        return {p[len(base) + 1:].split("/", 1)[0] for p in self.reads or () if p.startswith(base + "/")}

    def may_be_worker(self, worker_id: str, node_id: str | None = None) -> bool:
        """A node-bound worker credential may only act as a worker of its node: node_id (when given) equal to
        the node, and the worker id's node part (worker_node) exactly the node. Static, so it holds across
        master restarts, unlike the in-memory owner binding. (A prefix rule, "<node>-...", let node-1's
        credential take node-1-gpu's worker ids.)"""
        if not self.node:
            return True
        if node_id is not None and node_id != self.node:
            return False
        return worker_node(worker_id) == self.node

    def may_write(self, path: str, if_absent: bool, mkdir: bool = False) -> bool:
        """admin: anything; engine: put-if-absent under one of its prefixes (and mkdir of the prefixes'
        ancestors, which the connector creates), and puts under SHARED_RECORD_PREFIXES, an overwrite there only
        of its own file; mount: puts under its prefixes, an overwrite only of a file it wrote itself (the master
        checks that against the file: may_replace); everyone else: nothing."""
        if "admin" in self.roles:
            return True
        if "engine" in self.roles and any(path == r or path.startswith(r + "/") or (mkdir and r.startswith(path + "/"))
                                          for r in SHARED_RECORD_PREFIXES):
            return True
        if not (("engine" in self.roles and if_absent) or "mount" in self.roles):
            return False
        if any(path.startswith(p + "/") or (path == p and not mkdir) for p in self.excluded):
            return False  # another endpoint's (its engine credential's) directory: the mount may make it, no more
        return any(p == "/" or path == p or path.startswith(p + "/")
                   or (mkdir and (path == "/" or p.startswith(path + "/"))) for p in self.prefixes)

    def may_replace(self, writer: str) -> bool:
        """Whether this credential may overwrite, delete or rename away a file that credential `writer` wrote
        ("" = unknown: reported by a worker after a master restart): admin any; mount only its own (a FUSE
        publish after more writes, LMCache's temp file renamed into place or unlinked after a failed write);
        engine only its own (its record under SHARED_RECORD_PREFIXES: elsewhere may_write lets it only
        put-if-absent, and it may not call Delete or Rename); never another's."""
        return "admin" in self.roles or (bool(self.roles & {"mount", "engine"}) and bool(writer)
                                         and writer == self.name)


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def token_digest(token: str | bytes) -> str:
    """The verifier of a token: hex SHA-256 of its bytes (a verifier file holds these instead of tokens)."""
    raw = token if isinstance(token, bytes) else token.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


def load_token_entries(path: str) -> list[tuple[str, str, Credential]]:
    """[(token or "", sha256 hex of the token, credential)] from a JSON list of {"name", "token" | "sha256",
    "role", "prefixes", "read_prefixes", "node"}; TokensFileError says what is wrong (a typo must stop the
    process, not silently open or close the cluster). "node" (worker role only) binds a worker credential to one
    node's worker ids (Credential.may_be_worker). "read_prefixes" (engine and mount roles only; default
    SHARED_READ_PREFIXES) is what it reads besides its own prefixes (read_scope): a file without it keeps working
    with that default. An entry with "sha256" instead of "token" is a verifier: the server accepts the
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
        if not isinstance(entry, dict) or set(entry) - {"name", "token", "sha256", "role", "prefixes",
                                                         "read_prefixes", "node"}:
            raise TokensFileError(f"{where}: want an object with keys name, token (or sha256), role, prefixes, "
                                  f"read_prefixes, node")
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
                                or any(ord(ch) < 33 for ch in node) or WORKER_ID_SEP in node):
            raise TokensFileError(f"{where}: node must be a node name (1-253 printable characters, no spaces, "
                                  f"no {WORKER_ID_SEP!r}) on a worker-role entry")
        reads = entry.get("read_prefixes")
        if "read_prefixes" in entry and (role not in SCOPED_READERS or not isinstance(reads, list)
                                         or not all(isinstance(p, str) for p in reads)):
            raise TokensFileError(f"{where}: read_prefixes must be a list of paths, on an engine or mount entry "
                                  f"(admin and router entries read everything)")
        try:
            norm = tuple(norm_path(p) for p in prefixes)
            read_norm = tuple(norm_path(p) for p in reads) if reads is not None else None
        except PathError as err:
            raise TokensFileError(f"{where}: {err}") from None
        name = str(entry.get("name") or f"entry{i}")
        if name in names:  # the name is the identity a worker id is bound to: two holders must not share it
            raise TokensFileError(f"{where}: duplicate name {name!r}")
        seen.add(digest)
        names.add(name)
        out.append((token, digest, Credential(name, frozenset({role}), norm, node, read_prefixes=read_norm)))
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


ENDPOINT_WRITES = ("plugin", "mount")  # how endpoints write their KV (master --endpoint-writes)


class Credentials:
    """The tokens a server accepts and what each may do. Without a tokens file the single `--token` is the
    old shared secret (admin + worker: every holder can do everything, the insecure-between-pods mode);
    with neither (and no `identity`), authentication is off (`enabled` False, every call allowed).

    Tokens are matched by their SHA-256 (load_token_entries), so a verifier file (digests only) checks the
    same tokens as the full file. `identity` (l2fs.master.identity.K8sIdentity) turns a bearer token no entry knows
    into a node-bound worker or mount credential, for the methods where the caller asks for it (`review`)."""

    LEGACY = frozenset({"admin", "worker"})

    def __init__(self, token: str | None = None, tokens_file: str | None = None, identity: Any = None, *,
                 endpoint_writes: str = "plugin") -> None:
        """`endpoint_writes` (ENDPOINT_WRITES): "plugin", endpoints write with their engine credentials and a
        prefix one serves is closed to every mount (Credentials.bounded); "mount", they write through the node
        mounts, which may then write under every prefix of theirs (mount mode: no endpoint's KV is closed)."""
        if endpoint_writes not in ENDPOINT_WRITES:
            raise ValueError(f"endpoint writes must be one of {ENDPOINT_WRITES}, not {endpoint_writes!r}")
        if tokens_file:
            self.entries = load_token_entries(tokens_file)
        elif token:
            self.entries = [(token, token_digest(token), Credential("shared-token", self.LEGACY))]
        else:
            self.entries = []
        self.identity = identity
        # Prefixes an engine credential serves are that endpoint's alone: a mount's prefixes (the whole KV
        # prefix by default) covered them, so a write through any node's mount planted a key of a plugin-mode
        # endpoint, whose put then answered "exists" and whose engine loaded the planted bytes.
        self.served = tuple(sorted({p for _, _, c in self.entries if "engine" in c.roles and "admin" not in c.roles
                                    for p in c.prefixes if p != "/"})) if endpoint_writes == "plugin" else ()
        self.entries = [(t, d, self.bounded(c)) for t, d, c in self.entries]
        self._digests = [(bytes.fromhex(d), c) for _, d, c in self.entries]

    def bounded(self, cred: Credential) -> Credential:
        """A mount credential kept out of the prefixes engine credentials serve (those not inside its own
        prefixes at or below them); any other credential as it is."""
        if "mount" not in cred.roles or "admin" in cred.roles or not self.served:
            return cred
        # only prefixes strictly inside one of its own can ever match a path it may write (may_write): a
        # per-endpoint mount then carries none, instead of every other endpoint's (16 us per write at 200)
        out = tuple(p for p in self.served if not any(q == p or q.startswith(p + "/") for q in cred.prefixes)
                    and any(q == "/" or p.startswith(q + "/") for q in cred.prefixes))
        return cred if out == cred.excluded else replace(cred, excluded=out)

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

    @staticmethod
    def _bearer(metadata: Any) -> bytes | None:
        got = dict(metadata or ()).get("authorization", "")
        got = got if isinstance(got, bytes) else str(got).encode("utf-8", "surrogatepass")
        return got[len(b"Bearer "):] if got.startswith(b"Bearer ") else None

    def from_metadata(self, metadata: Any, review: bool = True, source: str | None = None) -> Credential | None:
        """The credential of `authorization: Bearer <token>`; a token no entry knows goes to `identity` when
        `review` (the interceptor asks only on methods a role the identity grants may call: worker methods,
        and client methods only with a mount ServiceAccount configured; so strangers cannot make every call
        cost an API round trip). `source`: the caller's address (peer_source), for the identity's per-source
        limit on unknown tokens."""
        raw = self._bearer(metadata)
        if raw is None:
            return None
        cred = self._match(raw)
        if cred is None and review and self.identity is not None and raw:
            cred = self.identity.review(raw.decode("utf-8", "replace"), source)
            if cred is not None:  # a mount pod's ServiceAccount: bounded like a tokens-file mount
                cred = self.bounded(cred)
        return cred

    def data_token_ok(self, token: bytes) -> bool:
        """Token mode of the raw-TCP data plane (a worker whose master has no block key): any known token,
        whatever its role. With a block key the worker takes per-block capabilities instead
        (l2fs.common.capability.DataGate)."""
        return not self.entries or self._match(token) is not None

    def caller(self, context: grpc.ServicerContext) -> Credential | None:
        """The credential of a call already past TokenInterceptor; None when authentication is off."""
        if not self.enabled:
            return None
        return self.from_metadata(context.invocation_metadata(), source=peer_source(context.peer()))

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


def peer_source(peer: str | None) -> str | None:
    """The address part of a gRPC peer string ("ipv4:10.0.0.5:41234" -> "ipv4:10.0.0.5", "ipv6:[::1]:5" ->
    "ipv6:[::1]"): what per-source limits count by (the port changes per connection)."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    return f"{kind}:{rest.rsplit(':', 1)[0]}" if kind in ("ipv4", "ipv6") and ":" in rest else peer


class TokenInterceptor(grpc.ServerInterceptor):
    """Maps `authorization: Bearer <token>` metadata to a credential and checks its roles against the
    method's `policy` entry (method name -> roles allowed; unlisted methods: admin only), before the request
    message is read: unknown token UNAUTHENTICATED, known token with the wrong role PERMISSION_DENIED.

    Why request-streaming deny handlers for every method: gRPC Python reads a unary request whole before
    it calls even a denying handler (a 60 MiB unauthenticated call cost the master its full size, several
    at once +360 MiB). A handler for a request stream is called before any message is read, and the wire
    does not tell unary from streaming, so the stranger's call ends with UNAUTHENTICATED after at most the
    HTTP/2 flow-control window has been buffered.

    A token no entry knows, on a method where the identity may grant a role, is reviewed inside the handler
    rather than here: an interceptor sees no peer, and the identity limits unknown tokens per source address
    (K8sIdentity). The method's handler is then wrapped as a request-streaming one (same reason as the deny
    handlers: the review comes before any message is read) that reviews with the caller's address and only
    then reads the request and calls the method."""

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
        # an unknown token is reviewed (l2fs.master.identity) only on methods a role the identity grants may call
        grantable = getattr(self._creds.identity, "roles", WORKERS)
        review = self._policy is not None and bool(grantable & self._policy.get(name, ADMINS))
        cred = self._creds.from_metadata(handler_call_details.invocation_metadata, review=False)
        if cred is not None:
            if self._policy is None or cred.roles & self._policy.get(name, frozenset({"admin"})):
                return continuation(handler_call_details)
            deny = self._forbidden
        elif review and self._creds.identity is not None and self._creds._bearer(
                handler_call_details.invocation_metadata):
            return self._reviewing(continuation(handler_call_details), handler_call_details.invocation_metadata,
                                   self._policy.get(name, ADMINS) if self._policy is not None else ADMINS)
        else:
            deny = self._unauth
        return deny[1] if name == "ReadBlock" else deny[0]  # ReadBlock: the one server-streaming method

    def _reviewing(self, handler: Any, metadata: Any, allowed: frozenset[str]) -> Any:
        """`handler` wrapped so that the unknown token is reviewed with the caller's address before a message
        is read (UNAUTHENTICATED / PERMISSION_DENIED as the deny handlers answer)."""
        if handler is None:
            return None

        def admit(context: grpc.ServicerContext) -> None:
            cred = self._creds.from_metadata(metadata, review=True, source=peer_source(context.peer()))
            if cred is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or bad l2fs bearer token")
            elif not cred.roles & allowed:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "this l2fs token's role may not call this method")

        def first(requests: Any, context: grpc.ServicerContext) -> Any:
            for r in requests:
                return r
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")

        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            def uu(requests: Any, context: grpc.ServicerContext) -> Any:
                admit(context)
                return handler.unary_unary(first(requests, context), context)
            return grpc.stream_unary_rpc_method_handler(uu, **kw)
        if handler.unary_stream is not None:
            def us(requests: Any, context: grpc.ServicerContext) -> Any:
                admit(context)
                yield from handler.unary_stream(first(requests, context), context)
            return grpc.stream_stream_rpc_method_handler(us, **kw)
        if handler.stream_unary is not None:
            def su(requests: Any, context: grpc.ServicerContext) -> Any:
                admit(context)
                return handler.stream_unary(requests, context)
            return grpc.stream_unary_rpc_method_handler(su, **kw)

        def ss(requests: Any, context: grpc.ServicerContext) -> Any:
            admit(context)
            yield from handler.stream_stream(requests, context)
        return grpc.stream_stream_rpc_method_handler(ss, **kw)
