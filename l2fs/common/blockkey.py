"""Block ids minted as a MAC over (worker, size) with the cluster's block key, so forged reports are refused."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from l2fs.common.paths import BLOCK_ID


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
    """Mints and verifies block ids that are their own MAC (worker trust: blocks the master never allocated are
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
        """The raw key (l2fs.common.capability derives each worker's data key from it)."""
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
