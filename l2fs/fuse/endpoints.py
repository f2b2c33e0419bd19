"""`l2fs mount --endpoints DIR BASE`: one FUSE mount per endpoint, each with that endpoint's own credential.

Why: one node-wide mount held one credential whose prefixes covered every endpoint's KV, and every vLLM pod on
the node used it, so a pod of endpoint A could write /kvtier/kv/<B>/<key> (keys are deterministic): B's put
then answered "exists" and B's engine loaded the planted bytes. Here each endpoint has a mount-role token whose
only prefix is its own (`kvtier tokens generate`: entry mount-<endpoint>, Secret l2fs-endpoint-mounts), and
its mount shows only that prefix (`--root`); the webhook gives the endpoint's pods that mount alone. The master
refuses the token anything outside the prefix, so neither the pod nor the mount process can reach another
endpoint's directory. The node stays the unit of trust for this daemon: it holds the tokens of every endpoint
in DIR.

Layout: BASE/<endpoint> is a plain directory (root, 0755) and the endpoint's FUSE mount is at
BASE/<endpoint>/<endpoint>. A pod's volume is the plain directory (hostPath, mountPropagation HostToContainer,
read-only), never the FUSE mount itself: a bind of the mount would be a copy of it, dead with its daemon, and
neither the lazy unmount of the dead mount nor the new mount of a restarted daemon would reach that copy
(mounts propagate to copies of their parent), so a running pod got ENOTCONN until it was restarted. With
the parent bound, both propagate into the running pod (the known FUSE-CSI "mount pod restart" fix). Before a
(re)mount the bare mount point is emptied of whatever was left in it while nothing was mounted (never through
a symlink) and made root's, 0755.

DIR holds one file per endpoint, named by the endpoint, each `{"root": "<l2fs prefix>", "token": "<token>"}`
(a Secret volume: the kubelet updates it in place, dot-names are its bookkeeping). DIR is re-read every
`--endpoints-poll` seconds: a new endpoint gets its mount, a removed one is unmounted, a changed one (token
rotated) remounted, a crashed one restarted after a backoff; the others are left alone. Each mount is a child
`l2fs mount BASE/<endpoint>/<endpoint> --root <root>` with the token in its environment (not on its command
line)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from l2fs.common.paths import norm_path
from l2fs.fuse.main import mount_type, stop

log = logging.getLogger("l2fs.fuse.endpoints")

NAME = re.compile(r"[A-Za-z0-9][-._A-Za-z0-9]{0,252}")  # = kvtier.credentials.ENDPOINT_NAME (a Secret key)
BACKOFF_MAX = 30.0


def _die_hard_with_parent() -> None:
    """preexec_fn: SIGKILL the child mount when this daemon dies unclean (killed, OOM): its mount then stays,
    dead (ENOTCONN: pods' reads and writes fail, misses) until the next daemon peels and remounts it, as a
    killed single mount did; an unmount would let the pods write onto the node's disk under the mount point."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    root: str
    token: str
    proc: subprocess.Popen[bytes]
    failures: int = 0
    retry_at: float = 0.0
    reported: bool = field(default=False)


def read_endpoints(source: str) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """({endpoint: (root, token)}, problems) from the files of `source`. A bad entry is skipped with its
    problem (the others keep their mounts); a missing `source` is no endpoints."""
    out: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    try:
        names = sorted(os.listdir(source))
    except FileNotFoundError:
        return out, [f"{source}: no such directory (Secret l2fs-endpoint-mounts not mounted?)"]
    for name in names:
        if name.startswith("."):
            continue
        where = f"{source}/{name}"
        if not NAME.fullmatch(name):
            problems.append(f"{where}: not an endpoint name (letters, digits, '-', '.', '_')")
            continue
        try:
            entry = json.loads(open(where).read())
            root, token = entry["root"], entry["token"]
            if not isinstance(root, str) or not isinstance(token, str) or not token.strip():
                raise ValueError("want string root and non-empty token")
            root = norm_path(root)
            if root == "/":
                raise ValueError("root / would show every endpoint")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{where}: want {{\"root\": \"/kvtier/kv/<endpoint>\", \"token\": ...}} ({e})")
            continue
        out[name] = (root, token.strip())
    return out, problems


class EndpointMounts:
    """Keeps one child mount per endpoint of `source` under `base` (see the module docstring)."""

    def __init__(self, base: str, source: str, child_args: list[str], *, poll: float = 5.0,
                 status_file: str | None = None) -> None:
        self.base = os.path.abspath(base)
        self.source = source
        self.child_args = child_args
        self.poll = poll
        self.status_file = status_file
        self.children: dict[str, Child] = {}
        self.stopping = threading.Event()
        self._problems: set[str] = set()

    def node_dir(self, name: str) -> str:
        """The endpoint's node directory, a plain one: what its pods' hostPath volume binds."""
        return os.path.join(self.base, name)

    def path(self, name: str) -> str:
        """The endpoint's FUSE mount point, inside its node directory (see the module docstring)."""
        return os.path.join(self.base, name, name)

    def _peel(self, mp: str) -> None:
        """Lazily unmount a dead FUSE mount a crashed child (or predecessor) left at mp."""
        for _ in range(4):
            if not (mount_type(mp) or "").startswith("fuse"):
                return
            subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True)

    def _prepare(self, name: str) -> None:
        """The endpoint's node directory and its mount point as plain directories of root's, 0755, the mount
        point empty. Dead FUSE mounts at either (a killed child's, or a node directory that was the mount point
        itself before) are peeled first; a mount point that is still a mount of any kind is left as it is.
        Nothing is followed: a symlink or a file where a directory belongs is removed, and the mount point's
        contents (what reached the node's disk while nothing was mounted there) are removed without following
        symlinks; owner and mode are set on descriptors opened with O_NOFOLLOW."""
        home, mp = self.node_dir(name), self.path(name)
        self._peel(home)
        self._peel(mp)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = _plain_dir(self.base, name, flags)
        try:
            _own(fd)
            if mount_type(mp) is not None:
                return  # live (not ours to touch), or a volume someone mounted there
            sub = _plain_dir(fd, name, flags)
            try:
                with os.scandir(sub) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.name, dir_fd=sub)  # fd-based: never follows a symlink
                        else:
                            os.unlink(entry.name, dir_fd=sub)
                _own(sub)
            finally:
                os.close(sub)
        finally:
            os.close(fd)

    def _start(self, name: str, root: str, token: str) -> subprocess.Popen[bytes]:
        mp = self.path(name)
        try:
            self._prepare(name)
        except OSError as e:  # mounted anyway: a child that cannot mount there exits and is retried
            log.error("endpoint %s: cannot prepare %s: %s", name, mp, e)
        env = {k: v for k, v in os.environ.items() if k not in ("L2FS_TOKEN_FILE", "L2FS_TOKEN")}
        env["L2FS_TOKEN"] = token  # a worker knows it (verifier file): same-node writes stay local
        cmd = [sys.executable, "-m", "l2fs.cli", "mount", mp, "--root", root, *self.child_args]
        log.info("endpoint %s: mounting %s at %s", name, root, mp)
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_hard_with_parent)

    def _stop(self, name: str) -> None:
        child = self.children.pop(name)
        log.info("endpoint %s: unmounting %s", name, self.path(name))
        stop(child.proc, self.path(name))

    def step(self) -> bool:
        """One pass: read the source, start/stop/restart children; True when every endpoint's mount is live."""
        want, problems = read_endpoints(self.source)
        for p in set(problems) - self._problems:
            log.error("%s", p)
        self._problems = set(problems)
        for name in [n for n in self.children if n not in want]:
            self._stop(name)
        now = time.monotonic()
        for name, (root, token) in want.items():
            child = self.children.get(name)
            if child is not None and (child.root, child.token) != (root, token):
                self._stop(name)  # rotated token or moved root: remount with the new one
                child = None
            if child is None:
                self.children[name] = Child(root, token, self._start(name, root, token))
                continue
            rc = child.proc.poll()
            if rc is None:
                if mount_type(self.path(name)) == "fuse.l2fs":
                    child.failures, child.reported = 0, False
                continue
            if not child.reported:
                child.failures += 1
                child.retry_at = now + min(BACKOFF_MAX, 2.0 ** child.failures)
                child.reported = True
                log.warning("endpoint %s: mount exited %s; restarting in %.0f s", name, rc, child.retry_at - now)
                self._peel(self.path(name))
            if now >= child.retry_at:
                child.proc = self._start(name, root, token)
                child.reported = False
        states = {n: ("live" if c.proc.poll() is None and mount_type(self.path(n)) == "fuse.l2fs" else "down")
                  for n, c in self.children.items()}
        ready = all(s == "live" for s in states.values())
        self._write_status(ready, states)
        return ready

    def _write_status(self, ready: bool, states: dict[str, str]) -> None:
        """First line ready|waiting (the readiness probe), then one `endpoint state` line each; rewritten every
        pass (the liveness probe checks that it is fresh)."""
        if not self.status_file:
            return
        tmp = f"{self.status_file}.tmp"
        with open(tmp, "w") as f:
            f.write(("ready" if ready else "waiting") + "\n" + "".join(f"{n} {s}\n" for n, s in states.items()))
        os.replace(tmp, self.status_file)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT/SIGHUP, then unmount every endpoint."""
        os.makedirs(self.base, exist_ok=True)
        for name in os.listdir(self.base):  # dead mounts a killed predecessor left (also of the older layout)
            self._peel(self.node_dir(name))
            self._peel(self.path(name))

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("signal %d: unmounting every endpoint", signum)
            self.stopping.set()

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, on_signal)
        try:
            while not self.stopping.is_set():
                self.step()
                self.stopping.wait(self.poll)
        finally:
            for name in list(self.children):
                self._stop(name)
            if self.status_file:
                try:
                    os.unlink(self.status_file)
                except FileNotFoundError:
                    pass
        return 0


def _plain_dir(parent: str | int, name: str, flags: int) -> int:
    """An fd of the directory `name` in `parent` (a path or a directory fd), made if missing; a symlink or any
    other non-directory there is removed first (never followed)."""
    at = parent if isinstance(parent, int) else os.open(parent, flags & ~os.O_NOFOLLOW)  # BASE: the operator's
    try:
        for _ in range(3):
            try:
                st = os.stat(name, dir_fd=at, follow_symlinks=False)
            except FileNotFoundError:
                os.mkdir(name, 0o755, dir_fd=at)
                continue
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=at)
                continue
            return os.open(name, flags, dir_fd=at)
        raise OSError(f"{name}: not a directory after 3 tries")
    finally:
        if not isinstance(parent, int):
            os.close(at)


def _own(fd: int) -> None:
    """root:root (when we are root) and 0755: only root writes there, e.g. no non-root pod."""
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0)
    os.fchmod(fd, 0o755)


def child_args(a: Any) -> list[str]:
    """The flags each endpoint's child mount gets: the supervisor's own, minus what is per endpoint."""
    out = ["--master", a.master, "--cache-timeout", str(a.cache_timeout), "--threads", str(a.threads),
           "--max-file-size", str(a.max_file_size), "--write-buffer", str(a.write_buffer),
           "--read-cache", str(a.read_cache), "--umask", f"{a.umask:o}"]
    if a.node_id:
        out += ["--node-id", a.node_id]
    if a.tls_ca:
        out += ["--tls-ca", a.tls_ca]
    if getattr(a, "timeout", None) is not None:
        out += ["--timeout", str(a.timeout)]
    for flag, on in (("--read-only", a.read_only), ("--page-cache", a.page_cache), ("--allow-other", a.allow_other),
                     ("--debug", a.debug)):
        if on:
            out.append(flag)
    if a.uid is not None:
        out += ["--uid", str(a.uid)]
    if a.gid is not None:
        out += ["--gid", str(a.gid)]
    for o in a.options:
        out += ["-o", o]
    if getattr(a, "passthrough", False):  # each child a passthrough server; its own private dir under cache_dir
        out.append("--passthrough")
        if a.cache_dir:
            out += ["--cache-dir", a.cache_dir]
        if a.cache_size:
            out += ["--cache-size", a.cache_size]
    return out
