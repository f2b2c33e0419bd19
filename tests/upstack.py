"""A whole `kvtier up` stack for a test module (a uniquely named module, like polling.py: two areas use it).

    with up_stack(d, ["--model", str(tiny_model), ...]) as u:   # u.proc, u.state (up.json), u.dir
        ...

`kvtier up` runs in its own process group, as from a terminal, so a test can SIGTERM only it; whatever is
still running when the block ends (a test failed before the shutdown test) is killed tree and all.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from l2fs import procs

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    state: dict[str, Any]
    dir: Path


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """`kvtier up` starts each child in its own group, so a group kill would miss them: walk the tree."""
    try:
        for c in psutil.Process(proc.pid).children(recursive=True):
            c.kill()
    except psutil.NoSuchProcess:
        pass
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def up_stack(d: Path, args: list[str], timeout: float = 600) -> Iterator[Up]:
    """Start `kvtier up --dir d --port 0 *args`, wait for its state file and "Ctrl-C stops everything"."""
    out = d / "up.out"
    proc = procs.spawn([sys.executable, "-m", "kvtier.cli", "up", "--dir", str(d), "--port", "0", *args], out,
                       cwd=ROOT)
    state_file = d / "up.json"
    try:
        procs.wait_ready(proc, lambda: state_file.exists() and "Ctrl-C stops everything" in out.read_text(),
                         timeout=timeout, what="kvtier up", log_path=out, interval=1)
    except procs.ProcessError as e:
        kill_tree(proc)
        pytest.fail(str(e))
    try:
        yield Up(proc, json.loads(state_file.read_text()), d)
    finally:
        if proc.poll() is None:  # a test failed before the shutdown test: do not leave engines behind
            kill_tree(proc)
