"""procs.stop leaves nothing of the group behind, even when the leader exits before its children (a vLLM API
server that returns on SIGTERM while an engine process is still shutting down)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from reliability_faults import alive, wait_until

from l2fs import procs

pytestmark = pytest.mark.unit

# The leader starts a child that ignores SIGTERM, prints its pid, and exits at once on SIGTERM.
_LEADER = r"""
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(600)
"""


def test_stop_kills_children_that_outlive_the_leader(tmp_path) -> None:
    log = tmp_path / "leader.log"
    proc = procs.spawn([sys.executable, "-c", _LEADER], log)
    wait_until(lambda: log.read_text().strip(), 30)
    child = int(log.read_text().split()[0])
    assert alive(child)
    t0 = time.monotonic()
    assert procs.stop(proc, grace=1.0) == 0  # the leader itself exits cleanly on SIGTERM
    waited = time.monotonic() - t0
    end = time.monotonic() + 5
    while alive(child) and time.monotonic() < end:  # reaped by init once killed
        time.sleep(0.05)
    assert not alive(child), "a child that ignores SIGTERM outlived procs.stop"
    assert waited < 12, waited
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
