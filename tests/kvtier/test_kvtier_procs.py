"""l2fs.procs, the one process helper every launcher uses: readiness, failure reports, group stop."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from polling import wait_until

from l2fs import procs

pytestmark = pytest.mark.unit


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"  # a zombie has exited


def test_ready_by_log_line_then_stop_reaches_grandchildren(tmp_path: Path) -> None:
    """The child starts a grandchild and ignores SIGTERM; stop() must still leave neither behind."""
    log = tmp_path / "child.log"
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            "print(f'grandchild {g.pid} up', flush=True); time.sleep(600)")
    proc = procs.spawn([sys.executable, "-c", code], log, header="test start")
    pid = int(procs.wait_ready(proc, procs.log_match(log, r"grandchild (\d+) up"), timeout=30, what="child",
                               log_path=log))
    assert os.getpgid(proc.pid) == proc.pid  # its own group, so the terminal's Ctrl-C does not reach it
    assert _alive(pid)
    rc = procs.stop(proc, grace=1)
    assert rc == -signal.SIGKILL  # SIGTERM ignored, so SIGKILL after the grace period
    wait_until(lambda: not _alive(pid), 5)
    assert log.read_text().startswith("\n=== test start\n")
    assert procs.stop(proc) == rc  # idempotent


def test_exit_before_ready_reports_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    proc = procs.spawn([sys.executable, "-c", "print('bad flag --x'); raise SystemExit(3)"], log)
    with pytest.raises(procs.ProcessError, match=r"(?s)exited with 3.*bad flag --x"):
        procs.wait_ready(proc, procs.port_file(tmp_path / "never.port"), timeout=30, what="server", log_path=log)


def test_not_ready_in_time_is_a_timeout_and_leaves_it_to_the_caller(tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    proc = procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"], log)
    try:
        with pytest.raises(TimeoutError):
            procs.wait_ready(proc, lambda: procs.http_ok("http://127.0.0.1:9/health"), timeout=0.5, what="slow")
        assert proc.poll() is None
    finally:
        procs.stop(proc, grace=5)
    assert proc.poll() is not None


def test_port_file_readiness_returns_its_contents(tmp_path: Path) -> None:
    pf = tmp_path / "x.port"
    code = f"import json, time; time.sleep(0.3); open({str(pf)!r}, 'w').write(json.dumps({{'port': 1234}}));" \
           "time.sleep(600)"
    proc = procs.spawn([sys.executable, "-c", code], tmp_path / "x.log")
    try:
        assert procs.wait_ready(proc, procs.port_file(pf), timeout=30, what="x") == {"port": 1234}
    finally:
        procs.stop(proc)
