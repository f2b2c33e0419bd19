"""Child processes for local clusters, dev stacks, benchmarks and tests: spawn, wait until ready, stop.

The one copy of the pattern every launcher needs (l2fs local, `kvtier up`, the vLLM replica launcher,
the benchmarks and the test helpers):

    proc = spawn([sys.executable, "-m", "l2fs.cli", "master", ...], log_path)
    info = wait_ready(proc, port_file(path), timeout=30, what="l2fs master", log_path=log_path)
    stop(proc)          # SIGTERM to its process group, SIGKILL after the grace period

Each child runs in its own session (process group), so that stopping it also stops what it started
(vLLM's engine core and workers) and a Ctrl-C in the terminal reaches only the launcher, which then stops
its children in order. It lives in l2fs because l2fs imports nothing of the other packages.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

T = TypeVar("T")


class ProcessError(RuntimeError):
    """A child exited before it was ready; the message carries its log tail."""


class ProcessTimeout(ProcessError, TimeoutError):
    """A child was not ready in time (also a TimeoutError, as the launchers raised before)."""


class Started:
    """Base for a set of processes used as a context manager (a local cluster, a dev stack).

    `with X(...) as x:` calls start(); if start() fails part-way (Ctrl-C included) what did start is stopped
    before the error propagates, so subclasses' stop() must be idempotent and safe after a partial start.
    """

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if its launcher dies without cleaning up (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(cmd: Sequence[str], log_path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike[str] | None = None, append: bool = True, header: str | None = None,
          die_with_parent: bool = False) -> subprocess.Popen[bytes]:
    """Start cmd in its own process group with stdout+stderr to log_path (stdin closed, output unbuffered).

    env: the child's whole environment (default: ours). header: a line written to the log first, so that
    appended logs show where each start begins. die_with_parent: SIGTERM the child if we die (see above).
    """
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(path, "ab" if append else "wb", buffering=0) as log:  # the child keeps its own descriptor
        if header:
            log.write(f"\n=== {header}\n".encode())
        return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, cwd=cwd, start_new_session=True,
                                preexec_fn=_die_with_parent if die_with_parent else None)


def tail(log_path: str | os.PathLike[str] | None, lines: int = 40) -> str:
    """The last lines of a log (for error messages and progress), "(no log)" if unreadable."""
    if log_path is None:
        return "(no log)"
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    all_lines = text.splitlines()
    out = all_lines[-lines:]
    # a multiprocess server (vLLM) prints the root cause first and a generic error last: name the root cause
    # too when the tail has scrolled past it
    causes = list(dict.fromkeys(ln for ln in all_lines[:-lines] if _EXCEPTION_LINE.match(ln)))
    if causes:
        out = [f"(earlier in the log: {c})" for c in causes[:3]] + out
    return "\n".join(out)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: .*)?$")


def wait_ready(proc: subprocess.Popen[Any], ready: Callable[[], T | None], *, timeout: float, what: str,
               log_path: str | os.PathLike[str] | None = None, interval: float = 0.1,
               progress: Callable[[float], None] | None = None, progress_every: float = 15.0) -> T:
    """Poll ready() until it returns a value other than None/False and return that value.

    Raises ProcessError (with the log tail) as soon as proc exits, ProcessTimeout after timeout s; the process
    is left running on timeout (the caller stops it, usually in its own cleanup). progress(elapsed) is
    called every progress_every seconds while waiting (for slow starts such as vLLM engines).
    """
    t0 = time.monotonic()
    last = 0.0
    while True:
        if proc.poll() is not None:
            raise ProcessError(f"{what} exited with {proc.returncode}; log {log_path}:\n{tail(log_path)}")
        value = ready()
        if value is not None and value is not False:
            return value
        elapsed = time.monotonic() - t0
        if elapsed > timeout:
            raise ProcessTimeout(f"{what} not ready after {timeout:.0f}s; log {log_path}:\n{tail(log_path)}")
        if progress is not None and elapsed - last >= progress_every:
            last = elapsed
            progress(elapsed)
        time.sleep(interval)


def port_file(path: str | os.PathLike[str]) -> Callable[[], dict[str, Any] | None]:
    """Readiness check: the JSON a server writes to path once it listens (l2fs --port-file)."""
    p = Path(path)

    def check() -> dict[str, Any] | None:
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):  # not there yet, or caught half-written
            return None

    return check


def log_match(log_path: str | os.PathLike[str], pattern: str) -> Callable[[], str | None]:
    """Readiness check: group 1 of the first match of pattern in the log (e.g. "listening on (\\S+)")."""
    rx = re.compile(pattern)

    def check() -> str | None:
        try:
            m = rx.search(Path(log_path).read_text(errors="replace"))
        except OSError:
            return None
        return m.group(1) if m else None

    return check


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET url answers 200 (a readiness check: `lambda: http_ok(base + "/health")`)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop(proc: subprocess.Popen[Any] | None, *, sig: int = signal.SIGTERM, grace: float = 15.0) -> int | None:
    """Send sig (to the whole group when the child leads its own), SIGKILL after grace s; idempotent.

    Returns the exit status (None if there was no process). Waits for the exit, so nothing is left behind.
    """
    if proc is None:
        return None
    if proc.poll() is not None:
        return proc.returncode
    try:
        own_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        own_group = False

    def send(s: int) -> None:
        try:
            if own_group:
                os.killpg(proc.pid, s)
            else:
                proc.send_signal(s)
        except ProcessLookupError:
            pass

    deadline = time.monotonic() + grace
    send(sig)
    try:
        rc = proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        rc = proc.wait(timeout=10)
    if own_group and not _group_gone(proc.pid, deadline):
        # The leader is gone but members of its group are not (a vLLM API server exits before an engine core or
        # worker that is still shutting down; on a loaded box that took > 30 s): kill the rest, or they outlive us.
        _killpg(proc.pid, signal.SIGKILL)
        _group_gone(proc.pid, time.monotonic() + 10)
    return rc


def _killpg(pgid: int, sig: int) -> bool:
    """killpg that says whether any process of the group was there to signal."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still counts as alive
        return True
    return True


def _group_gone(pgid: int, deadline: float) -> bool:
    """Wait until no process is left in group pgid (zombies of other parents count as alive) or the deadline."""
    while _killpg(pgid, 0):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
