"""Nodes for real on one machine: a cluster of Linux network namespaces joined by rate-shaped links.

Why: processes that share one loopback hide the bugs a cluster has (advertise vs bind address, ports bound on
the wrong interface, short-circuit chosen by node id, partitions that are TCP proxies, "cross-node" numbers
measured at memory speed). Here every node is a network namespace with its own address on a private subnet,
and its link to the others is a veth pair with token-bucket shapers on both ends.

    with NetnsCluster(nodes=2, link="200mbit") as c:
        c.ctl.addr, c.nodes[0].addr          # "10.231.7.1", "10.231.7.2"
        p = c.popen(c.nodes[0], ["python", "-m", "l2fs.cli", "worker", "--host", c.nodes[0].addr, ...])
        fwd = c.forward(8995)                # host 127.0.0.1:fwd.port -> control namespace :8995
        c.partition(c.nodes[0], c.nodes[1]); c.heal(c.nodes[0], c.nodes[1])
        c.set_rate(c.nodes[0], "50mbit"); c.link_down(c.nodes[0]); c.link_up(c.nodes[0])

Layout (prefix P = "kvt" + 6 hex digits, unique per launcher):
  P-ctl   control namespace: bridge br0 (the subnet's .1), the bridge ends vn1..vnN of the node veths
  P-nK    node K: eth0 (the subnet's .K+1), loopback
Nothing is ever created in the host's namespace, so the host gets no interfaces or routes and two launchers
cannot collide on names. Processes enter only the network namespace (nsenter --net), never a new mount
namespace, so a node's FUSE mount stays visible to every process on the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from l2fs import procs

NETNS_DIR = Path("/run/netns")
STATE_DIR = Path("/run/kvtier-netns")
NAME_RE = re.compile(r"^(kvt[0-9a-f]{6})-(ctl|n\d+)$")
PREFIX_RE = re.compile(r"^kvt[0-9a-f]{6}$")
# Each launcher takes one /24 out of this /16 (10.231.K.0/24, K = 0..255), skipping any that a live or
# leftover launcher of ours holds or that overlaps a route of the host.
SUPERNET = ipaddress.IPv4Network("10.231.0.0/16")
CLONE_NEWNET = 0x40000000
REQUIRED_TOOLS = ("ip", "tc", "nsenter")

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "kibit": 1024, "mibit": 1024**2, "gibit": 1024**3, "tibit": 1024**4,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
          "kibps": 8 * 1024, "mibps": 8 * 1024**2, "gibps": 8 * 1024**3, "tibps": 8 * 1024**4}


class NetnsError(RuntimeError):
    """The cluster cannot be built or changed (missing root/tools, bad input, a failed ip/tc command)."""


def parse_rate(rate: str | int | float) -> int:
    """A rate like tc's (`10gbit`, `2gbit`, `500mbit`, `100kbit`, `12mbps` = bytes/s; a bare number is
    bits/s) in bits per second."""
    if isinstance(rate, int | float):
        value = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _UNITS):
            raise NetnsError(f"bad rate {rate!r}: use a number with a tc unit such as 10gbit, 500mbit, 12mbps")
        value = float(m.group(1)) * _UNITS.get(unit, 1)
    if value < 8000:
        raise NetnsError(f"rate {rate!r} is below 8kbit")
    return int(value)


def check_host() -> None:
    """Refuse clearly when we cannot build namespaces: not root, or ip/tc/nsenter missing."""
    if os.geteuid() != 0:
        raise NetnsError("network-namespace clusters need root (creating namespaces, veths and tc shapers)")
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        raise NetnsError(f"network-namespace clusters need {', '.join(missing)} on PATH "
                         "(Debian: apt-get install iproute2 util-linux)")


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def _setns(path: str | os.PathLike[str]) -> None:
    """Move the calling thread (only it: network namespaces are per thread) into the namespace at path."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def socket_in(netns: str | os.PathLike[str], family: int = socket.AF_INET,
              kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in the given network namespace (a name under /run/netns or a path), made by a
    short-lived helper thread that enters it; the socket can then be used from any thread of ours."""
    path = Path(netns) if os.sep in str(netns) else NETNS_DIR / str(netns)
    out: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            _setns(path)
            out.append(socket.socket(family, kind))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out.append(e)

    t = threading.Thread(target=make, name="netns-socket", daemon=True)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


# ---------- state of launchers (for cleanup of crashed ones) ----------

def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _owner_alive(state: dict[str, Any]) -> bool:
    pid = int(state.get("pid", 0))
    return pid > 0 and _start_time(pid) == state.get("start")


def _read_state(prefix: str) -> dict[str, Any]:
    try:
        return json.loads((STATE_DIR / f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return {}


def _our_namespaces() -> dict[str, list[str]]:
    """Our namespaces by launcher prefix (names matching kvtXXXXXX-ctl / -nK only)."""
    found: dict[str, list[str]] = {}
    names = sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []
    for name in names:
        m = NAME_RE.match(name)
        if m:
            found.setdefault(m.group(1), []).append(name)
    return found


@contextlib.contextmanager
def _state_lock() -> Any:
    """Serialise subnet choice and creation between launchers on this machine."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


Nets = list[ipaddress.IPv4Network | ipaddress.IPv6Network]


def _used_subnets() -> tuple[Nets, Nets]:
    """(subnets held by our launchers: state files and addresses in our control namespaces, the host's
    IPv4 routes). Ours must never be reused; the host's are only avoided when possible (our subnets live
    in our own namespaces, so an overlap with the host is harmless, just confusing to read)."""
    ours: Nets = []
    for f in STATE_DIR.glob("kvt*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            ours.append(ipaddress.ip_network(json.loads(f.read_text())["subnet"]))
    for prefix in _our_namespaces():
        r = _run(["ip", "-n", f"{prefix}-ctl", "-o", "-4", "addr", "show"], check=False)
        for m in re.finditer(r"inet (\S+)", r.stdout):
            iface = ipaddress.ip_interface(m.group(1))
            if not iface.ip.is_loopback:
                ours.append(iface.network)
    host: Nets = []
    for line in _run(["ip", "-o", "-4", "route", "show", "table", "all"], check=False).stdout.splitlines():
        tok = line.split()
        dst = tok[1] if tok and tok[0] in ("local", "broadcast", "unicast", "blackhole", "prohibit") else (
            tok[0] if tok else "")
        with contextlib.suppress(ValueError):
            if dst and dst != "default":
                host.append(ipaddress.ip_network(dst, strict=False))
    return ours, host


def _pick_subnet() -> ipaddress.IPv4Network:
    """The first /24 of SUPERNET that no launcher of ours holds, preferring one clear of the host's routes."""
    ours, host = _used_subnets()
    free = [n for n in SUPERNET.subnets(new_prefix=24) if not any(n.overlaps(u) for u in ours)]
    for net in free:
        if not any(net.overlaps(h) for h in host):
            return net
    if free:
        return free[0]
    raise NetnsError(f"no free /24 left in {SUPERNET} (run `l2fs netns cleanup`?)")


def _mounted(path: str) -> bool:
    """Whether something is mounted exactly at path (from /proc/self/mounts, octal escapes decoded)."""
    with open("/proc/self/mounts") as f:
        targets = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split(" ")[1]) for line in f]
    return path in targets


def _remove_prefix(prefix: str, namespaces: Sequence[str]) -> list[str]:
    """Kill every process in the launcher's namespaces, delete them (their veths and bridge go with them),
    unmount its registered mounts and drop its state file. Returns what was removed."""
    assert PREFIX_RE.match(prefix), prefix
    removed: list[str] = []
    state = _read_state(prefix)
    for name in namespaces:
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for mnt in state.get("mounts", []):
        if _mounted(mnt):  # a dead FUSE daemon's mount still counts (ismount would fail with ENOTCONN)
            _run(["umount", "-l", mnt], check=False)
            if _mounted(mnt) and shutil.which("fusermount3"):
                _run(["fusermount3", "-u", "-z", mnt], check=False)
            removed.append(f"mount {mnt}")
    for name in namespaces:
        r = _run(["ip", "netns", "del", name], check=False)
        if r.returncode == 0:
            removed.append(name)
    # Never created there by us, but a kernel or tool quirk could leave one: only names of our exact form.
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        m = re.match(r"\d+: ([^:@]+)", line)
        if m and m.group(1).startswith(prefix):
            _run(["ip", "link", "del", m.group(1)], check=False)
            removed.append(m.group(1))
    (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)
    return removed


def cleanup(*, force: bool = False, prefix: str | None = None) -> list[str]:
    """Remove leftovers of crashed launchers: namespaces named kvtXXXXXX-* (with their veths and bridges and
    the processes inside), their registered mounts and state files. A launcher whose process is still alive
    is left alone unless force. prefix: only that launcher's. Returns the names removed."""
    check_host()
    removed: list[str] = []
    with _state_lock():
        found = _our_namespaces()
        for f in STATE_DIR.glob("kvt*.json"):
            found.setdefault(f.stem, [])
        for p, names in sorted(found.items()):
            if prefix is not None and p != prefix:
                continue
            if not PREFIX_RE.match(p) or (not force and _owner_alive(_read_state(p))):
                continue
            removed += _remove_prefix(p, names)
    return removed


def clusters() -> dict[str, bool]:
    """Our clusters on this machine by prefix, and whether each one's launcher is still alive."""
    return {p: _owner_alive(_read_state(p)) for p in _our_namespaces()}


def netem_available(netns: str) -> bool:
    """Whether the kernel has the netem qdisc (per-packet delay/loss), probed on the namespace's loopback."""
    r = _run(["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
    if r.returncode == 0:
        _run(["tc", "-n", netns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return r.returncode == 0


def tbf_args(rate: str | int | float) -> list[str]:
    """tc tbf parameters for a rate: a burst of ~4 ms of traffic (>= 64 KiB, so a GSO segment passes
    whole) and 50 ms of queue."""
    bits = parse_rate(rate)
    burst = max(64 * 1024, bits // 8 // 250)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]


# ---------- the cluster ----------

@dataclass
class Namespace:
    """One network namespace of ours: the control one or a node."""

    name: str            # "ctl" or "node-K"
    netns: str           # the namespace's name under /run/netns, e.g. "kvt1a2b3c-n1"
    addr: str            # its address on the cluster subnet
    iface: str = ""      # node: its end of the veth ("eth0"); control: the bridge
    peer: str = ""       # node: the bridge end of its veth in the control namespace ("vnK")
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def path(self) -> str:
        return str(NETNS_DIR / self.netns)


class Forwarder:
    """Host 127.0.0.1:port -> addr:port inside a namespace: a small TCP relay (accept thread + two pump
    threads per connection). The namespace side socket is made by a thread that entered the namespace."""

    def __init__(self, netns: str, addr: str, port: int, *, listen_port: int = 0,
                 connect_timeout: float = 5.0) -> None:
        self.netns, self.target = netns, (addr, port)
        self.connect_timeout = connect_timeout
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"netns-fwd-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            s = socket_in(self.netns)
            s.settimeout(self.connect_timeout)
            s.connect(self.target)
            s.settimeout(None)
        except OSError:
            c.close()
            return
        with self._lock:
            self._conns.update((c, s))
        t = threading.Thread(target=self._pump, args=(s, c), daemon=True)
        t.start()
        self._pump(c, s)
        t.join()
        for x in (c, s):
            with self._lock:
                self._conns.discard(x)
            x.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for x in list(self._conns):
                with contextlib.suppress(OSError):
                    x.shutdown(socket.SHUT_RDWR)


Where = Namespace | int | str


class NetnsCluster:
    """A control namespace with a bridge and `nodes` node namespaces, each linked to the bridge by a veth.

    link: rate of every node's link, e.g. "10gbit" (both directions; None = unshaped).
    delay / loss: per-packet delay ("5ms") and loss ("1%"); need the kernel's netem and are refused with a
    NetnsError where it is absent.
    Everything is removed by close() (also on `with` exit, SIGTERM when no other handler is set, and at
    interpreter exit); `cleanup()` removes what a crashed launcher left.
    """

    def __init__(self, nodes: int = 2, *, link: str | None = None, delay: str | None = None,
                 loss: str | None = None) -> None:
        check_host()
        if nodes < 1 or nodes > 200:
            raise NetnsError(f"nodes must be 1..200, got {nodes}")
        self.link = link
        if link is not None:
            parse_rate(link)  # refuse a bad rate before creating anything
        self.delay, self.loss = delay, loss
        self._init(f"kvt{secrets.token_hex(3)}", range(1, nodes + 1))

    def _init(self, prefix: str, node_numbers: Sequence[int]) -> None:
        self.prefix = prefix
        self.subnet: ipaddress.IPv4Network | None = None
        self.ctl = Namespace("ctl", f"{prefix}-ctl", "", iface="br0")
        self.nodes = [Namespace(f"node-{k}", f"{prefix}-n{k}", "", iface="eth0", peer=f"vn{k}")
                      for k in node_numbers]
        self.rates: dict[str, str | None] = {n.name: self.link for n in self.nodes}
        self.forwarders: list[Forwarder] = []
        self._created = False
        self._closed = False
        self._old_sigterm: Any = None

    @classmethod
    def attach(cls, prefix: str) -> NetnsCluster:
        """A handle on a running cluster (another launcher's, by prefix) for faults, exec and forwarders.
        It never removes the cluster: its close() stops only what this handle started."""
        check_host()
        names = _our_namespaces().get(prefix, []) if PREFIX_RE.match(prefix) else []
        if f"{prefix}-ctl" not in names:
            raise NetnsError(f"no cluster of ours with prefix {prefix!r} (see `l2fs netns list`)")
        self = cls.__new__(cls)
        self.link, self.delay, self.loss = None, None, None
        self._init(prefix, sorted(int(m.group(2)[1:]) for n in names
                                  if (m := NAME_RE.match(n)) and m.group(2) != "ctl"))
        for ns in self.namespaces:
            out = _run(["ip", "-n", ns.netns, "-o", "-4", "addr", "show", "dev", ns.iface]).stdout
            m = re.search(r"inet (\S+)", out)
            if not m:
                raise NetnsError(f"{ns.netns} has no address on {ns.iface}: not a cluster of ours, or broken")
            iface = ipaddress.IPv4Interface(m.group(1))
            ns.addr, self.subnet = str(iface.ip), iface.network
        for n in self.nodes:
            m = re.search(r"\btbf\b.*?\brate (\S+)", _run(["tc", "-n", n.netns, "qdisc", "show", "dev",
                                                             n.iface]).stdout)
            self.rates[n.name] = m.group(1).lower() if m else None
        return self

    # ---------- lifecycle ----------

    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[Namespace]:
        return [self.ctl, *self.nodes]

    def start(self) -> None:
        """Create the namespaces, bridge, veths, addresses and shapers."""
        if self.prefix in _our_namespaces():
            raise NetnsError(f"namespaces of prefix {self.prefix} exist already")
        with _state_lock():
            self.subnet = _pick_subnet()
            hosts = list(self.subnet.hosts())
            self.ctl.addr = str(hosts[0])
            for k, n in enumerate(self.nodes, start=1):
                n.addr = str(hosts[k])
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            self._write_state()
            self._created = True
            _LIVE.add(self)
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns.netns])
        c = self.ctl.netns
        self._ip(c, "link", "set", "lo", "up")
        self._ip(c, "link", "add", "br0", "type", "bridge")
        self._ip(c, "addr", "add", f"{self.ctl.addr}/{self.subnet.prefixlen}", "dev", "br0")
        self._ip(c, "link", "set", "br0", "up")
        for n in self.nodes:
            self._ip(c, "link", "add", n.peer, "type", "veth", "peer", "name", n.iface, "netns", n.netns)
            self._ip(c, "link", "set", n.peer, "master", "br0", "up")
            self._ip(n.netns, "link", "set", "lo", "up")
            self._ip(n.netns, "addr", "add", f"{n.addr}/{self.subnet.prefixlen}", "dev", n.iface)
            self._ip(n.netns, "link", "set", n.iface, "up")
        if (self.delay or self.loss) and not netem_available(c):
            raise NetnsError("per-packet delay/loss needs the kernel's netem qdisc (sch_netem), which this "
                             "kernel does not have; only rate shaping (--link RATE, tbf) is available here")
        for n in self.nodes:
            self._shape(n)

    def close(self) -> None:
        """Stop our processes and forwarders, then remove every namespace (veths and bridge go with them)."""
        if self._closed:
            return
        self._closed = True
        for f in self.forwarders:
            f.close()
        for ns in self.namespaces:
            for p in ns.procs:
                procs.stop(p, sig=signal.SIGTERM, grace=5)
        if self._created:
            with _state_lock():
                _remove_prefix(self.prefix, [ns.netns for ns in self.namespaces])
        _LIVE.discard(self)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)

    def _write_state(self) -> None:
        state = {"pid": os.getpid(), "start": _start_time(os.getpid()), "subnet": str(self.subnet),
                 "mounts": getattr(self, "_mounts", [])}
        tmp = STATE_DIR / f".{self.prefix}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(STATE_DIR / f"{self.prefix}.json")

    def register_mount(self, path: str | os.PathLike[str]) -> None:
        """A (FUSE) mount that `cleanup()` must unmount if this launcher crashes."""
        self._mounts = [*getattr(self, "_mounts", []), str(Path(path).resolve())]
        self._write_state()

    @staticmethod
    def _ip(netns: str, *args: str) -> None:
        _run(["ip", "-n", netns, *args])

    # ---------- running things inside ----------

    def ns(self, where: Where) -> Namespace:
        """A namespace by object, 1-based node index, "ctl" or node name ("node-2")."""
        if isinstance(where, Namespace):
            return where
        if isinstance(where, int) and 1 <= where <= len(self.nodes):
            return self.nodes[where - 1]
        for n in self.namespaces:
            if where in (n.name, n.netns):
                return n
        raise NetnsError(f"no namespace {where!r} (ctl, node-1..node-{len(self.nodes)})")

    def wrap(self, where: Where, argv: Sequence[str]) -> list[str]:
        """argv run inside the namespace's network only (`nsenter --net=...`, so mounts stay shared)."""
        return ["nsenter", f"--net={self.ns(where).path}", "--", *argv]

    def popen(self, where: Where, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv in the namespace (subprocess.Popen kwargs); it is stopped by close()."""
        p: subprocess.Popen[Any] = subprocess.Popen(self.wrap(where, argv), **kwargs)
        self.ns(where).procs.append(p)
        return p

    def spawn(self, where: Where, argv: Sequence[str], log_path: str | os.PathLike[str],
              **kwargs: Any) -> subprocess.Popen[bytes]:
        """procs.spawn (own process group, output to log_path) inside the namespace; stopped by close()."""
        p = procs.spawn(self.wrap(where, argv), log_path, **kwargs)
        self.ns(where).procs.append(p)
        return p

    def run(self, where: Where, argv: Sequence[str], *, check: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run argv to completion in the namespace (subprocess.run kwargs)."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.wrap(where, argv), check=check, **kwargs)

    def socket(self, where: Where, family: int = socket.AF_INET,
               kind: int = socket.SOCK_STREAM) -> socket.socket:
        """A socket of ours that lives in the namespace."""
        return socket_in(self.ns(where).path, family, kind)

    def forward(self, port: int, *, where: Where = "ctl", addr: str | None = None,
                listen_port: int = 0) -> Forwarder:
        """Reach addr:port in the namespace (default its own address) from the host's 127.0.0.1."""
        ns = self.ns(where)
        f = Forwarder(ns.path, addr or ns.addr, port, listen_port=listen_port)
        self.forwarders.append(f)
        return f

    # ---------- links and faults ----------

    def _shape(self, n: Namespace) -> None:
        rate = self.rates[n.name]
        for netns, dev in ((n.netns, n.iface), (self.ctl.netns, n.peer)):  # egress of both ends = both ways
            if rate is None:
                _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate)])

    def set_rate(self, where: Where, rate: str | None) -> None:
        """Change a node's link rate live (both directions); None removes the shaper."""
        n = self._node(where)
        if rate is not None:
            parse_rate(rate)
        self.rates[n.name] = rate
        self._shape(n)

    def link_down(self, where: Where) -> None:
        """Cut a node's link (its veth goes down: no carrier on either end)."""
        n = self._node(where)
        self._ip(n.netns, "link", "set", n.iface, "down")

    def link_up(self, where: Where) -> None:
        n = self._node(where)
        self._ip(n.netns, "link", "set", n.iface, "up")

    def partition(self, a: Where, b: Where, *, kind: str = "blackhole") -> None:
        """Cut a and b off from each other only (both keep the bridge and every other node): a route of
        `kind` (blackhole: packets silently dropped, like a real partition; prohibit: fail at once) for the
        other's address inside each of the two namespaces."""
        if kind not in ("blackhole", "prohibit", "unreachable"):
            raise NetnsError(f"partition kind must be blackhole, prohibit or unreachable, got {kind!r}")
        na, nb = self.ns(a), self.ns(b)
        if na is nb:
            raise NetnsError("cannot partition a namespace from itself")
        for x, y in ((na, nb), (nb, na)):
            self._ip(x.netns, "route", "replace", kind, f"{y.addr}/32")

    def heal(self, a: Where, b: Where) -> None:
        """Undo partition(a, b)."""
        na, nb = self.ns(a), self.ns(b)
        for x, y in ((na, nb), (nb, na)):
            _run(["ip", "-n", x.netns, "route", "del", f"{y.addr}/32"], check=False)

    def fault_state(self) -> dict[str, dict[str, Any]]:
        """What is cut right now, per namespace: its address, and for a node its rate and whether its link is
        up; `cut_from`: the namespaces it holds a partition route to (works on an attached handle too)."""
        by_addr = {ns.addr: ns.name for ns in self.namespaces}
        out: dict[str, dict[str, Any]] = {}
        for ns in self.namespaces:
            st: dict[str, Any] = {"addr": ns.addr}
            if ns is not self.ctl:
                link = json.loads(_run(["ip", "-n", ns.netns, "-j", "link", "show", "dev", ns.iface]).stdout)[0]
                st.update(rate=self.rates[ns.name], link="up" if "UP" in link.get("flags", []) else "down")
            cut = []
            for kind in ("blackhole", "prohibit", "unreachable"):
                for line in _run(["ip", "-n", ns.netns, "route", "show", "type", kind]).stdout.splitlines():
                    addr = line.split()[1].removesuffix("/32") if len(line.split()) > 1 else ""
                    cut.append(f"{by_addr.get(addr, addr)} ({kind})")
            st["cut_from"] = cut
            out[ns.name] = st
        return out

    def link_stats(self, where: Where) -> dict[str, int]:
        """Byte/packet counters of a node's eth0 (rx = received by the node), from `ip -s -j link`."""
        n = self._node(where)
        r = _run(["ip", "-n", n.netns, "-s", "-j", "link", "show", "dev", n.iface])
        st = json.loads(r.stdout)[0]["stats64"]
        return {"rx_bytes": st["rx"]["bytes"], "tx_bytes": st["tx"]["bytes"],
                "rx_packets": st["rx"]["packets"], "tx_packets": st["tx"]["packets"]}

    def tcp_throughput(self, src: Where, dst: Where, nbytes: int = 50_000_000) -> float:
        """Plain TCP throughput in bits/s of one connection from src to dst's address (sockets of this
        process in the two namespaces; from the first byte sent to the receiver's acknowledgement of the
        last). Benchmarks report it next to their own numbers to show whether the shaper was the bound."""
        srv = self.socket(dst)
        srv.bind((self.ns(dst).addr, 0))
        srv.listen(1)
        got: list[int] = []

        def sink() -> None:
            conn, _ = srv.accept()
            with conn:
                n = 0
                while data := conn.recv(1 << 20):
                    n += len(data)
                got.append(n)
                conn.sendall(b"k")

        t = threading.Thread(target=sink, name="netns-sink", daemon=True)
        t.start()
        try:
            with self.socket(src) as cl:
                cl.settimeout(120)
                cl.connect(srv.getsockname())
                chunk = memoryview(bytes(1 << 20))
                t0 = time.monotonic()
                left = nbytes
                while left > 0:
                    cl.sendall(chunk[:left])
                    left -= min(left, len(chunk))
                cl.shutdown(socket.SHUT_WR)
                ack = cl.recv(1)
                elapsed = time.monotonic() - t0
            t.join(10)
        finally:
            srv.close()
        if ack != b"k" or got != [nbytes]:
            raise NetnsError(f"throughput probe {self.ns(src).name} -> {self.ns(dst).name} lost data: {got}")
        return nbytes * 8 / elapsed

    def _node(self, where: Where) -> Namespace:
        n = self.ns(where)
        if n is self.ctl:
            raise NetnsError("the control namespace has no link of its own; name a node")
        return n

    # process-level faults (for processes started by popen/spawn, or any Popen)

    def pids(self, where: Where, match: str | None = None) -> list[int]:
        """Processes in the namespace (`ip netns pids`), optionally only those whose command line contains
        match (e.g. "l2fs.cli worker"): how a chaos command finds another launcher's node worker."""
        out = _run(["ip", "netns", "pids", self.ns(where).netns]).stdout.split()
        found = []
        for pid in map(int, out):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if match is None or match in cmd:
                found.append(pid)
        return found

    def signal_pids(self, where: Where, sig: int, match: str | None = None, *, group: bool = False) -> list[int]:
        """Send sig to the namespace's processes (see pids()); returns the pids signalled. group: also every
        process of the namespace in the process group that a matched process leads (a vLLM replica's engine
        core and workers come with its API server, so the whole replica dies or freezes)."""
        pids = self.pids(where, match)
        if group and match is not None:
            leaders = {p for p in pids if _pgid(p) == p}
            pids += [p for p in self.pids(where) if p not in pids and _pgid(p) in leaders]
        sent = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                sent.append(pid)
        return sent

    @staticmethod
    def signal(p: subprocess.Popen[Any], sig: int) -> None:
        """Send sig to the process (to its whole group when it leads one, as procs.spawn makes)."""
        if p.poll() is not None:
            return
        try:
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, sig)
            else:
                p.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill(self, p: subprocess.Popen[Any]) -> int | None:
        """SIGKILL and reap."""
        self.signal(p, signal.SIGKILL)
        return p.wait(timeout=10)

    def pause(self, p: subprocess.Popen[Any]) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing (a hung node)."""
        self.signal(p, signal.SIGSTOP)

    def resume(self, p: subprocess.Popen[Any]) -> None:
        self.signal(p, signal.SIGCONT)

    def describe(self) -> dict[str, Any]:
        """Names and addresses, for printing and for launchers that pass them on."""
        return {"prefix": self.prefix, "subnet": str(self.subnet),
                "ctl": {"netns": self.ctl.netns, "addr": self.ctl.addr},
                "nodes": [{"name": n.name, "netns": n.netns, "addr": n.addr, "rate": self.rates[n.name]}
                          for n in self.nodes],
                "forwards": {f.address: f"{f.target[0]}:{f.target[1]}" for f in self.forwarders}}


def _sigterm_to_exit(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so `with NetnsCluster(...)` removes everything."""
    raise SystemExit(128 + signum)


_LIVE: weakref.WeakSet[NetnsCluster] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Never leave namespaces behind when the launcher exits without close()."""
    for c in list(_LIVE):
        with contextlib.suppress(Exception):
            c.close()


# ---------- `l2fs netns ...` ----------

def main(argv: Sequence[str] | None = None) -> int:
    """`l2fs netns up|down|cleanup|exec|list|chaos`: hold a cluster in the foreground, remove one or the
    leftovers, run in a node, inject a fault into a running cluster."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="l2fs netns", description="Network-namespace cluster of nodes.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a cluster and hold it until Ctrl-C/SIGTERM (then remove it)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--link", default=None, help="rate of each node's link, e.g. 10gbit, 500mbit")
    up.add_argument("--delay", default=None, help="per-packet delay (needs netem)")
    up.add_argument("--loss", default=None, help="per-packet loss (needs netem)")
    up.add_argument("--forward", type=int, action="append", default=[], metavar="PORT",
                    help="forward host 127.0.0.1:PORT to the control namespace's PORT")
    cl = sub.add_parser("cleanup", help="remove leftovers of crashed launchers")
    cl.add_argument("--force", action="store_true", help="also clusters whose launcher is alive")
    ex = sub.add_parser("exec", help="run a command in a namespace of a running cluster (network only)")
    ex.add_argument("netns", help="namespace name, e.g. kvt1a2b3c-n1")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="our namespaces and their launchers")
    dn = sub.add_parser("down", help="remove one cluster by prefix, even if its launcher is alive")
    dn.add_argument("prefix")
    ch = sub.add_parser("chaos", help="inject a fault into a running cluster")
    ch.add_argument("prefix", help="the cluster's prefix, e.g. kvt1a2b3c (see `l2fs netns list`)")
    ch.add_argument("fault", choices=CHAOS_FAULTS)
    ch.add_argument("node", help="node-K (or K)")
    ch.add_argument("arg", nargs="?", help="rate: RATE or none; partition/heal: the other node")
    ch.add_argument("--kind", default="blackhole", help="partition: blackhole (drop) or prohibit (refuse)")
    ch.add_argument("--match", default=None,
                    help="kill/stop/cont: only processes whose command line contains this (default: all)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "down":
            removed = cleanup(force=True, prefix=args.prefix)
            for name in removed:
                print(f"removed {name}")
            return 0 if removed else 1
        if args.cmd == "chaos":
            return _chaos(args)
        if args.cmd == "cleanup":
            for name in cleanup(force=args.force):
                print(f"removed {name}")
            return 0
        if args.cmd == "list":
            for prefix, names in sorted(_our_namespaces().items()):
                state = _read_state(prefix)
                alive = "alive" if _owner_alive(state) else "LEFTOVER"
                print(f"{prefix} pid={state.get('pid', '?')} {alive} subnet={state.get('subnet', '?')}"
                      f" {' '.join(names)}")
            return 0
        if args.cmd == "exec":
            check_host()
            if not NAME_RE.match(args.netns) or not (NETNS_DIR / args.netns).exists():
                raise NetnsError(f"no namespace of ours named {args.netns!r} (see `l2fs netns list`)")
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            os.execvp("nsenter", ["nsenter", f"--net={NETNS_DIR / args.netns}", "--", *cmd])
        with NetnsCluster(args.nodes, link=args.link, delay=args.delay, loss=args.loss) as c:
            for port in args.forward:
                c.forward(port, listen_port=port)
            print(json.dumps(c.describe(), indent=1), flush=True)
            signal.signal(signal.SIGINT, _sigterm_to_exit)
            while True:
                time.sleep(3600)
    except NetnsError as e:
        print(f"l2fs netns: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # SIGTERM/SIGINT: `with` already removed everything
        return 0 if e.code in (128 + signal.SIGTERM, 128 + signal.SIGINT) else int(e.code or 0)
    return 0


CHAOS_FAULTS = ("link-down", "link-up", "rate", "partition", "heal", "kill", "stop", "cont")


def chaos(c: NetnsCluster, fault: str, node: str, arg: str | None = None, *, kind: str = "blackhole",
          match: str | None = None, group: bool = False) -> tuple[bool, str]:
    """One fault on a (usually attached) cluster: the code behind `l2fs netns chaos` and `kvtier chaos`.

    node: node-K, K, or ctl where it makes sense (partition/heal: the control namespace = master, router);
    arg: rate: RATE or none; partition/heal: the other namespace. kill/stop/cont signal the node's processes
    whose command line contains match (all of them when None; group: with their process groups, see
    signal_pids). Returns (something was done, message)."""
    def ns(text: str | None) -> Namespace:
        if text is None:
            raise NetnsError(f"{fault} needs a second node (node-K or ctl)")
        return c.ns(int(text) if text.isdigit() else text)

    if fault not in CHAOS_FAULTS:
        raise NetnsError(f"unknown fault {fault!r}; one of {', '.join(CHAOS_FAULTS)}")
    n = ns(node)
    if fault == "link-down":
        c.link_down(n)
    elif fault == "link-up":
        c.link_up(n)
    elif fault == "rate":
        if arg is None:
            raise NetnsError("rate needs RATE (e.g. 50mbit) or none")
        c.set_rate(n, None if arg == "none" else arg)
    elif fault == "partition":
        c.partition(n, ns(arg), kind=kind)
    elif fault == "heal":
        c.heal(n, ns(arg))
    else:
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}[fault]
        pids = c.signal_pids(n, sig, match, group=group)
        return bool(pids), f"{fault} {n.name}: {' '.join(map(str, pids)) or 'no process matched'}"
    return True, f"{fault} {n.name}{' ' + arg if arg else ''}: done"


def _chaos(args: Any) -> int:
    """`l2fs netns chaos PREFIX FAULT NODE [ARG]` on a cluster held by another launcher."""
    done, message = chaos(NetnsCluster.attach(args.prefix), args.fault, args.node, args.arg, kind=args.kind,
                          match=args.match)
    print(message)
    return 0 if done else 1
