"""Helpers for the mount tests: real `l2fs mount` processes (via l2fs.fuse.spawn/stop) and metrics."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from l2fs import fuse


class Mount:
    """One `l2fs mount` process; `path` is the mountpoint."""

    def __init__(self, path: Path, proc: subprocess.Popen, log: Path) -> None:
        self.path, self.proc, self.log = path, proc, log

    def __truediv__(self, other: str) -> Path:
        return self.path / other

    def __fspath__(self) -> str:
        return str(self.path)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal the daemon and wait for it to unmount and exit; force-unmount if it does not."""
        return fuse.stop(self.proc, self.path, sig, timeout)


def start_mount(mp: Path, master: str, *args: str, timeout: float = 20.0) -> Mount:
    """Start `l2fs mount MP --master ...` (log next to MP) and wait until the kernel shows the mount."""
    log = mp.parent / f"{mp.name}.log"
    return Mount(mp, fuse.spawn(mp, master, *args, log=log, timeout=timeout), log)


def metric(port: int | None, name: str, **labels: str) -> float:
    """Sum of the samples of one Prometheus metric (matching labels) from 127.0.0.1:port/metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    assert port, "the cluster was started without metrics ports"
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_cannot_replace(path: Path, mine: Path, moved: Path) -> None:
    """Through a mount: a truncate, an overwrite, a rename of `mine` (a fresh file this mount writes, allowed)
    over `path` (LMCache's publish onto an existing key), a rename of `path` to `moved` and an unlink of it all
    fail with EACCES (the mount role may replace only files its own credential wrote)."""
    def overwrite() -> None:
        with open(path, "r+b") as f:
            f.write(b"poison")

    mine.write_bytes(b"poison" * 1000)
    for attempt in (lambda: os.truncate(path, 0), overwrite, lambda: os.replace(mine, path),
                    lambda: os.rename(path, moved), lambda: os.unlink(path)):
        with pytest.raises(PermissionError):
            attempt()
