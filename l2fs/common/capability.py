"""Per-block read/write capabilities with an expiry (HDFS block tokens are the model).

Why: with only the cluster token on the data plane, any token holder could read every block by id (and
write any block the master allocated), and every worker had to hold every client's token. Now the master,
which already decides who may read or write what, hands the client a capability for exactly one block and
operation, and the worker checks it without asking anyone:

- Per-worker data key K_w = HMAC-SHA256(block key, "l2fs-data\\0" + worker id). The master gives K_w to a
  worker in its RegisterResponse (over the worker's authenticated channel). Every master and shard holds
  the same block key, so each derives the same K_w: a worker registered with two shards gets one key. The
  worker never sees the block key, so it can neither mint block ids nor capabilities for other workers;
  a capability leaked from one worker's traffic is worthless on another.
- A capability is `c1.<op>.<block id>.<expiry unix s>.<32 hex MAC>` with op `r` or `w` and MAC the first
  128 bits of HMAC-SHA256(K_w, "c1\\0" op "\\0" block id "\\0" expiry "\\0" path). A read capability has an
  empty path (a rename must not invalidate reads in flight). A write capability binds the path the block
  was allocated for (not in the string: the worker takes it from the request): without that, an engine
  token could write its allocated block under another tenant's path, which the worker keeps in its manifest
  and reports, so a restarted master would publish it there. This extends the brief's (op, id, expiry).
- From protocol 6 a capability also names its holder: `c2.<op>.<block id>.<expiry>.<holder>.<MAC>`, holder
  the first 48 bits of SHA-256 of the credential name the master minted it for (holder_id), inside the MAC. The
  worker counts its data-plane connections and block streams per holder, so one credential cannot take more
  than its share of a worker's slots however many addresses it comes from (before, only per address: a c1
  capability names no credential). A master mints c2 only for workers of protocol >= 6 and only for a caller
  with a credential; otherwise c1 as before, which every worker still takes (limited per address only).
- The expiry is checked against the worker's clock with `skew` seconds of slack (clocks of master and
  worker differ). Checking is one HMAC and a constant-time compare per request (~6 us in Python on a
  loaded 2-core box).

A worker that holds no data key (its master has no block key, or is older than protocol 3) stays in token
mode: any known token of its tokens file is accepted, as before.

Seal MACs (protocol 4): the first 128 bits of HMAC-SHA256(block key, "l2fs-seal\\0" worker id "\\0" block id
"\\0" size "\\0" crc32c), minted by the master when it publishes a commit, delivered to the worker (SealBlocks)
and kept in its manifest. A restarted master publishes a reported block only when its seal verifies over the
reported (worker, id, size, CRC): a worker that altered a block's bytes and rewrote its CRC to match cannot
make a new seal (it never holds the block key). The block id (BlockKey) only binds worker and size, because
the CRC is known after the id is minted.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from collections.abc import Callable
from typing import Any

from l2fs.common.paths import BLOCK_ID

VERSION = "c1"
VERSION_HOLDER = "c2"  # protocol 6: the capability names its holder (holder_id)
HOLDER_HEX = 12
READ, WRITE = "r", "w"
DEFAULT_TTL = 600.0  # seconds a capability is valid after the master minted it (l2fs master --capability-ttl)
DEFAULT_SKEW = 60.0  # seconds of clock difference a worker allows past the expiry (l2fs worker --capability-skew)
MAC_HEX = 32
MAX_LEN = 2 + 1 + 1 + 1 + 32 + 1 + 20 + 1 + HOLDER_HEX + 1 + MAC_HEX  # a longer string is not a capability
_DATA_LABEL = b"l2fs-data\0"


def data_key(block_key: bytes, worker_id: str) -> bytes:
    """K_w: what a worker checks capabilities with (derived, so every master of the cluster agrees)."""
    return hmac.new(block_key, _DATA_LABEL + worker_id.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


_SEAL_LABEL = "l2fs-seal"


def _mac_hex(key: bytes, *fields: object) -> str:
    """The first 128 bits (MAC_HEX hex digits) of HMAC-SHA256(key, fields joined by NUL): every MAC here."""
    msg = "\0".join(map(str, fields)).encode("utf-8", "surrogatepass")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:MAC_HEX]


def seal_mac(block_key: bytes, worker_id: str, bid: str, size: int, crc: int, path: str) -> str:
    """The seal of a committed block at `path`: what the worker keeps and reports, what a master checks at
    registration. The path is in it so a worker cannot republish one of its own (sealed) blocks under another
    file's path; a rename re-seals (SetPaths carries the new seal)."""
    return _mac_hex(block_key, _SEAL_LABEL, worker_id, bid, size, crc, path)


def seal_ok(block_key: bytes, mac: str, worker_id: str, bid: str, size: int, crc: int, path: str) -> bool:
    """Whether `mac` seals exactly this (worker, block id, size, CRC32C, path) under `block_key`."""
    return (len(mac) == MAC_HEX and mac.isascii()
            and hmac.compare_digest(mac, seal_mac(block_key, worker_id, bid, size, crc, path)))


@functools.lru_cache(maxsize=4096)
def holder_id(name: str) -> str:
    """The holder a capability names for the credential `name`: the same on every master and shard (a worker
    counts one credential's connections together whichever shard minted their capabilities)."""
    return hashlib.sha256(b"l2fs-holder\0" + name.encode("utf-8", "surrogatepass")).hexdigest()[:HOLDER_HEX]


def _mac(key: bytes, op: str, bid: str, expiry: int, path: str, size: int | None = None,
         holder: str | None = None) -> str:
    if holder is not None:  # c2 (protocol 6): sized writes always
        return _mac_hex(key, VERSION_HOLDER, op, bid, expiry, holder, path, "" if size is None else size)
    if size is None:  # a read, or a write minted for a worker older than protocol 5
        return _mac_hex(key, VERSION, op, bid, expiry, path)
    return _mac_hex(key, VERSION, op, bid, expiry, path, size)


def mint(key: bytes, op: str, bid: str, expiry: int, path: str = "", size: int | None = None,
         holder: str | None = None) -> str:
    """A capability for `op` on block `bid` until `expiry` (unix seconds); `path` and `size`: a write's path and
    allocated size (size None: the MAC of protocol 3-4 workers, which bind no size); `holder`: the holder_id of
    the credential it is minted for (a c2 capability, protocol >= 6 workers), None for a c1 one."""
    if op not in (READ, WRITE):
        raise ValueError(f"capability op must be {READ!r} or {WRITE!r}, not {op!r}")
    w = op == WRITE
    mac = _mac(key, op, bid, expiry, path if w else "", size if w else None, holder)
    if holder is not None:
        if len(holder) != HOLDER_HEX or not _is_hex(holder):
            raise ValueError(f"capability holder must be {HOLDER_HEX} hex digits (holder_id), not {holder!r}")
        return f"{VERSION_HOLDER}.{op}.{bid}.{expiry}.{holder}.{mac}"
    return f"{VERSION}.{op}.{bid}.{expiry}.{mac}"


def _is_hex(s: str) -> bool:
    return s.isascii() and all(c in "0123456789abcdef" for c in s)


def _parse(cap: str) -> tuple[str, str, int, str, str | None] | None:
    """(op, block id, expiry, mac, holder or None) of a well-formed c1 or c2 capability string, else None."""
    if not cap or len(cap) > MAX_LEN:
        return None
    parts = cap.split(".")
    holder = None
    if len(parts) == 6 and parts[0] == VERSION_HOLDER:
        holder = parts.pop(4)
        if len(holder) != HOLDER_HEX or not _is_hex(holder):
            return None
    elif len(parts) != 5 or parts[0] != VERSION:
        return None
    _, op, bid, exp, mac = parts
    if op not in (READ, WRITE) or not BLOCK_ID.match(bid) or not exp.isdigit() or len(exp) > 20 \
            or len(mac) != MAC_HEX:
        return None
    return op, bid, int(exp), mac, holder


def parse(cap: str) -> tuple[str, str, int, str] | None:
    """(op, block id, expiry, mac) of a well-formed capability string, else None."""
    got = _parse(cap)
    return got[:4] if got is not None else None


def holder_of(cap: str | bytes) -> str | None:
    """The holder a well-formed c2 capability names (unverified: check it first), None for anything else."""
    if isinstance(cap, bytes):
        cap = cap.decode("ascii", "replace")
    got = _parse(cap)
    return got[4] if got is not None else None


def expiry_of(cap: str) -> int | None:
    """When a capability expires (unix seconds; clients drop cached locations past it), None if not one."""
    got = parse(cap)
    return got[2] if got else None


def why_denied(key: bytes, presented: str | bytes, op: str, bid: str, path: str = "", *,
               now: float | None = None, skew: float = DEFAULT_SKEW, size: int | None = None) -> str | None:
    """None when `presented` is a capability of this worker's key for `op` on `bid` (and a write's `path` and,
    when given, `size`: the bytes the request declares), unexpired within `skew`; else why not (the message a
    refused client sees)."""
    if isinstance(presented, bytes):
        presented = presented.decode("ascii", "replace")
    got = _parse(presented)
    if got is None:
        return ("this worker needs a block capability from the master (l2fs protocol >= 3), not a token: "
                "upgrade the client")
    cop, cbid, exp, mac, holder = got
    if cop != op or cbid != bid:
        return f"capability is for {'reading' if cop == READ else 'writing'} another block or operation"
    if (time.time() if now is None else now) > exp + skew:
        return "capability expired: locate the block again"
    w = op == WRITE
    if not hmac.compare_digest(mac, _mac(key, op, bid, exp, path if w else "", size if w else None, holder)):
        return ("capability does not verify for this worker (forged, another worker's, another path, or a size "
                "other than the allocated one)")
    return None


def mint_for(block_key: bytes, worker_id: str, op: str, bid: str, path: str = "", ttl: float = DEFAULT_TTL,
             size: int | None = None, holder: str | None = None) -> str:
    """A capability as a master with `block_key` mints it for `worker_id` (tools and tests holding the key)."""
    return mint(data_key(block_key, worker_id), op, bid, int(time.time() + ttl), path, size, holder)


NOT_READY = "worker not registered with its master yet: retry"  # a (re)started worker's first instants
MASTER_MD = "l2fs-master-mac"  # call metadata: the master's MAC on its maintenance calls to a worker
_MASTER_LABEL = "m1"
MASTER_CALL_TTL = 60  # seconds a master call's MAC is valid (plus the worker's skew)


def master_call_mac(key: bytes, method: str, body: bytes, expiry: int) -> str:
    """`<expiry>.<mac>`: K_w's MAC over (method, expiry, SHA-256 of the request bytes).

    Why: a worker's DeleteBlocks/SetPaths/SealBlocks took any worker-role token, so one worker (or anyone with a
    worker token) could delete another worker's blocks or repoint its manifest. Only the master (and that
    worker) holds K_w, so in capability mode the worker takes these calls only from the master, for exactly the
    request the master sent. A replay of the same request before its expiry repeats an idempotent change."""
    return f"{expiry}.{_mac_hex(key, _MASTER_LABEL, method, expiry, hashlib.sha256(body).hexdigest())}"


def master_call_denied(key: bytes, presented: str, method: str, body: bytes, *, now: float | None = None,
                       skew: float = DEFAULT_SKEW) -> str | None:
    """None when `presented` is the master's MAC for this call (unexpired within `skew`), else why not."""
    exp, _, mac = presented.partition(".")
    if not exp.isdigit() or len(exp) > 20 or len(mac) != MAC_HEX:
        return f"{method} is the master's call: it needs the master's {MASTER_MD} (a worker token is not enough)"
    if (time.time() if now is None else now) > int(exp) + skew:
        return f"{method}: the master's MAC expired"
    if not hmac.compare_digest(presented, master_call_mac(key, method, body, int(exp))):
        return f"{method}: the master's MAC does not verify for this worker and request"
    return None


class Minter:
    """The master's side: capabilities for a worker's blocks, under K_w derived once per worker id."""

    def __init__(self, block_key: bytes, ttl: float = DEFAULT_TTL) -> None:
        self._block_key = block_key
        self.ttl = ttl
        self._keys: dict[str, bytes] = {}

    def key_for(self, worker_id: str) -> bytes:
        k = self._keys.get(worker_id)
        if k is None:
            if len(self._keys) > 65536:  # ids come and go (worker restarts without a stored id): bounded
                self._keys.clear()
            k = self._keys[worker_id] = data_key(self._block_key, worker_id)
        return k

    def mint(self, worker_id: str, op: str, bid: str, path: str = "", size: int | None = None,
             holder: str | None = None) -> str:
        return mint(self.key_for(worker_id), op, bid, int(time.time() + self.ttl), path, size, holder)

    def call_metadata(self, worker_id: str, method: str, request: Any) -> tuple[tuple[str, str], ...]:
        """The metadata that proves a maintenance call to `worker_id` comes from a master (master_call_mac)."""
        mac = master_call_mac(self.key_for(worker_id), method, request.SerializeToString(),
                              int(time.time() + MASTER_CALL_TTL))
        return ((MASTER_MD, mac),)


class DataGate:
    """The worker's side: what its raw-TCP data plane, fd socket and block RPCs accept.

    Modes: before the first registration answer it refuses everything (a restarted worker does not know
    yet whether its master issues capabilities, and must not fall back to "any token reads any block");
    with a data key (cap mode) only a capability for the op and block; without one (token mode: the master
    has no block key or predates protocol 3) any known token, as before. Once in cap mode a worker stays
    in it until restarted, even if a master answers without a key (fail closed: a misconfigured shard must
    not reopen the data plane to every token)."""

    def __init__(self, token_ok: Callable[[bytes], bool], skew: float = DEFAULT_SKEW) -> None:
        self._token_ok = token_ok  # callable(bytes) -> bool: token mode's check
        self.skew = skew
        self.key: bytes | None = None
        self.ready = False
        # write capabilities bind the allocated size (a master of protocol >= 5 mints them so): a write that
        # declares any other size is refused, so a 1-byte allocation cannot reserve (and evict for) 40 MiB
        self.sized = False

    def set_key(self, key: bytes) -> bool:
        """A registration answer's data key (b"" = none); True when this changed the mode or key."""
        changed = not self.ready or (key and key != self.key)
        if key:
            self.key = key
        self.ready = True
        return bool(changed)

    @property
    def cap_mode(self) -> bool:
        return self.key is not None

    def check_master(self, presented: str, method: str, body: bytes) -> str | None:
        """None when a maintenance call (DeleteBlocks, SetPaths, SealBlocks) may go on: in cap mode only with
        the master's MAC for exactly this request (master_call_mac); in token mode the worker-role token the
        interceptor already checked is all there is."""
        if self.key is None:
            return None
        return master_call_denied(self.key, presented, method, body, skew=self.skew)

    def check(self, presented: str | bytes, op: str, bid: str, path: str = "", size: int | None = None) -> str | None:
        """None when the request may go on, else why it is refused. `size`: the bytes a write declares (a
        reservation, a stream's header); under a sized master a write capability verifies only for the size it
        was allocated for."""
        if self.key is not None:  # a c2 capability (protocol 6) binds the size whatever the other masters do
            sized = self.sized or (presented[:3] in (b"c2.", "c2.") if presented else False)
            return why_denied(self.key, presented, op, bid, path, skew=self.skew,
                              size=size if sized and op == WRITE else None)
        if not self.ready:
            return NOT_READY
        tok = presented if isinstance(presented, bytes) else presented.encode()
        return None if self._token_ok(tok) else "missing or bad l2fs bearer token"
