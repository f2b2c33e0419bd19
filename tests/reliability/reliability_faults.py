"""Fault-injection helpers for the reliability suite.

Every fault here is real: signals to real processes, bytes flipped in real block files on disk, a real
TCP proxy that drops or black-holes connections. Nothing here replaces one of our own servers.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import socket
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polling import wait_until, waited  # noqa: F401  (the suite's one poller, re-exported)

from kvtier.bench.common import rss_bytes  # noqa: F401  (re-exported: the reliability tests use it)
from l2fs.common import free_port

# Client deadline used throughout the suite: the l2fs client's default (2 s), the most a fault may cost a call
# before it is a miss or an error (docs/reliability.md).
DEADLINE = 2.0
# Scheduling slack on a shared 2-core CI box: a call may overrun its deadline by at most this much.
SLACK = 0.75

# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------


def proc_pid(handle: Any) -> int:
    """The OS pid behind a LocalCluster worker/master handle (or a Popen, or an int).

    LocalCluster exposes its processes in a few shapes; accept them all so the tests survive refactors.
    """
    if isinstance(handle, int):
        return handle
    for attr in ("pid", "proc", "process", "popen"):
        value = getattr(handle, attr, None)
        if value is None:
            continue
        if isinstance(value, int):
            return value
        pid = getattr(value, "pid", None)
        if isinstance(pid, int):
            return pid
    raise TypeError(f"cannot find a pid on {handle!r}")


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the duration of the block (a hung peer: TCP stays open, nothing answers)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One timed client call: what it returned or raised, and how long it took."""

    op: str
    key: str
    seconds: float
    result: Any = None
    error: BaseException | None = None


def timed(op: str, key: str, fn: Callable[[], Any]) -> Call:
    """Run fn and record its duration and outcome (exceptions are captured, not raised)."""
    t0 = time.monotonic()
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - the harness classifies every outcome
        return Call(op, key, time.monotonic() - t0, error=exc)
    return Call(op, key, time.monotonic() - t0, result=result)


@dataclass
class Hammer:
    """Threads calling `work(i, n)` in a loop until stopped; every call is recorded.

    Used to keep reads/writes in flight while a fault is injected, then to check every single call.
    """

    work: Callable[[int, int], Call]
    threads: int = 4
    calls: list[Call] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: list[threading.Thread] = field(default_factory=list)

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            call = self.work(i, n)
            with self._lock:
                self.calls.append(call)
            n += 1

    def __enter__(self) -> Hammer:
        self._pool = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(self.threads)]
        for t in self._pool:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._pool:
            t.join(timeout=30)
        stuck = [t for t in self._pool if t.is_alive()]
        if stuck:
            raise AssertionError(f"{len(stuck)} client threads still blocked 30 s after stop (a hang)")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


# --------------------------------------------------------------------------------------------------
# Payloads that prove their own integrity
# --------------------------------------------------------------------------------------------------

_HDR = 16  # b"KVT1" + 4-byte writer id + 8-byte length


def payload(writer: int, size: int, key: str = "") -> bytes:
    """A self-describing object: header (writer id, length) + a pattern derived from (writer, key).

    `check_payload` recognises a whole object and tells which writer made it; any torn, mixed, short
    or bit-flipped object fails the check. The pattern is pseudo-random so it is findable on disk.
    """
    if size < _HDR + 16:
        raise ValueError("payload too small")
    rng = random.Random((writer << 32) ^ zlib.crc32(key.encode()) ^ 0x5EED)
    body = rng.randbytes(size - _HDR)
    return b"KVT1" + writer.to_bytes(4, "little") + size.to_bytes(8, "little") + body


def check_payload(data: bytes | None, size: int | None = None, key: str = "") -> int:
    """Return the writer id of a whole, untorn object made by `payload`; raise AssertionError otherwise."""
    if data is None or len(data) < _HDR or data[:4] != b"KVT1":
        if data is None:
            raise AssertionError("no data (a miss) where a whole object was required")
        raise AssertionError(f"bad header ({len(data)} bytes)")
    writer = int.from_bytes(data[4:8], "little")
    length = int.from_bytes(data[8:16], "little")
    if length != len(data) or (size is not None and length != size):
        raise AssertionError(f"length {len(data)} != header {length} / expected {size}")
    if bytes(data) != payload(writer, length, key):
        raise AssertionError(f"content of writer {writer} object differs from what it wrote (torn/mixed)")
    return writer


# --------------------------------------------------------------------------------------------------
# On-disk corruption
# --------------------------------------------------------------------------------------------------


def files_under(root: Path) -> list[Path]:
    """Every regular file below root (block files, manifests, temp files)."""
    return [p for p in Path(root).rglob("*") if p.is_file()]


def find_block_files(roots: Sequence[Path], needle: bytes, min_size: int = 0) -> list[Path]:
    """Files under any root whose bytes contain `needle` (a slice of a payload we wrote).

    The worker's on-disk layout is its own business; searching for our data finds the block file
    without depending on it. SQLite manifests and similar never contain the payload pattern.
    """
    hits: list[Path] = []
    for root in roots:
        for p in files_under(Path(root)):
            try:
                if p.stat().st_size < min_size:
                    continue
                if needle in p.read_bytes():
                    hits.append(p)
            except OSError:
                continue  # evicted or renamed while we looked
    return hits


def flip_bit(path: Path, offset: int | None = None, bit: int = 0, seed: int = 0) -> int:
    """Flip one bit of a file in place (the middle byte by default); returns the byte offset."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty")
    if offset is None:
        offset = random.Random(seed).randrange(size) if seed else size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))
        f.flush()
        os.fsync(f.fileno())
    return offset


def truncate(path: Path, keep: int | None = None) -> int:
    """Cut a file short (to half by default); returns the new length."""
    keep = path.stat().st_size // 2 if keep is None else keep
    os.truncate(path, keep)
    return keep


def dir_bytes(root: Path) -> int:
    """Bytes of all regular files below root (what the disk really holds)."""
    total = 0
    for p in files_under(Path(root)):
        with contextlib.suppress(OSError):
            total += p.stat().st_size
    return total


# --------------------------------------------------------------------------------------------------
# Network faults: a TCP proxy that can drop or black-hole connections
# --------------------------------------------------------------------------------------------------


class FaultProxy:
    """A loopback TCP proxy in front of a real server.

    mode "pass": forward bytes; "drop": reset every connection (RST) now and on accept;
    "blackhole": accept and hold connections without forwarding a byte (a partitioned peer).
    listen: where to listen; another loopback address (127.0.0.2) lets the proxy take the same port
    number as its target, for servers that advertise "<advertised host>:<their own port>".
    """

    def __init__(self, target: str, listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.mode = "pass"
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(listen)
        self._lsock.listen(128)
        self.address = f"{listen[0]}:{self._lsock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        """Switch behaviour; 'drop' also resets every open connection at once."""
        if mode not in ("pass", "drop", "blackhole"):
            raise ValueError(mode)
        self.mode = mode
        if mode == "drop":
            with self._lock:
                conns, self._conns = self._conns, []
            for s in conns:
                _reset(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._lsock.accept()
            except OSError:
                return
            if self.mode == "drop":
                _reset(c)
                continue
            with self._lock:
                self._conns.append(c)
            if self.mode == "blackhole":
                continue
            try:
                u = socket.create_connection(self.target, timeout=2)
                u.settimeout(None)
            except OSError:
                _reset(c)
                continue
            with self._lock:
                self._conns.append(u)
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                while self.mode == "blackhole" and not self._closed:
                    time.sleep(0.02)  # hold the bytes (TCP backs up) until healed, like a partition
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop accepting and reset every connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._lsock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _reset(s)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_loopback_port() -> int:
    """A port free on both 127.0.0.1 and 127.0.0.2 a moment ago (for same-port proxies); drawn the way
    l2fs.common.free_port draws (below the kernel's ephemeral range, where outgoing connections do not take it)."""
    while True:
        port = free_port("127.0.0.1")
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.2", port))
            except OSError:
                continue
            return port


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees a dropped connection, not a clean EOF."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        s.close()


# --------------------------------------------------------------------------------------------------
# Workloads and the plain-LRU baseline
# --------------------------------------------------------------------------------------------------


def zipf_trace(n_keys: int, length: int, s: float = 1.1, seed: int = 0) -> list[int]:
    """Key indices drawn from a Zipf(s) law over n_keys ranks (rank 0 hottest), reproducibly."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** s for r in range(n_keys)]
    perm = list(range(n_keys))
    rng.shuffle(perm)  # hot keys are not the low ids, so id order carries no hint
    ranks = rng.choices(range(n_keys), weights=weights, k=length)
    return [perm[r] for r in ranks]


def lru_hit_rate(trace: Sequence[int], capacity_bytes: int, size_of: Callable[[int], int], *,
                 fifo: bool = False) -> float:
    """Hit rate of a plain byte-capacity LRU cache on a cache-aside trace (miss -> insert); `fifo`: a hit does
    not refresh the entry (first in, first out), for scale."""
    cache: OrderedDict[int, int] = OrderedDict()
    used = hits = 0
    for k in trace:
        if k in cache:
            hits += 1
            if not fifo:
                cache.move_to_end(k)
            continue
        size = size_of(k)
        if size > capacity_bytes:
            continue
        cache[k] = size
        used += size
        while used > capacity_bytes:
            _, s = cache.popitem(last=False)
            used -= s
    return hits / len(trace) if trace else 0.0
