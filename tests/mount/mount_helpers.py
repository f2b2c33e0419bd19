"""Helpers shared by the mount tests and the mount benchmark: start/stop real `l2fs mount` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        return self.proc.returncode


def start_mount(mp: Path, master: str, *args: str, timeout: float = 20.0) -> Mount:
    """Start `python -m l2fs.cli mount MP --master ...` and wait until the kernel shows the mount."""
    mp.mkdir(parents=True, exist_ok=True)
    log = mp.parent / f"{mp.name}.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "l2fs.cli", "mount", str(mp), "--master", master, *args],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mp):
            return Mount(mp, proc, log)
        if proc.poll() is not None:
            raise RuntimeError(f"l2fs mount exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"l2fs mount did not come up in {timeout}s: {log.read_text()[-2000:]}")


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
