"""The `l2fs` command: file commands against a running cluster, and `l2fs local` in the foreground."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from l2fs.testing.cluster import LocalCluster

L2FS = [sys.executable, "-m", "l2fs.cli"]


def _run(args: list[str], master: str, **kw: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, L2FS_MASTER=master)
    return subprocess.run([*L2FS, *args], env=env, capture_output=True, timeout=60, **kw)


def test_file_commands(cluster: LocalCluster, tmp_path: Path) -> None:
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(200_000))
    m = cluster.master
    r = _run(["put", str(src), "/cli/a.bin"], m)
    assert r.returncode == 0 and b"published" in r.stdout, r.stderr
    r = _run(["put", str(src), "/cli/a.bin"], m)
    assert r.returncode == 0 and b"already exists" in r.stdout
    r = _run(["put", "-", "/cli/stdin.txt"], m, input=b"from stdin")
    assert r.returncode == 0
    assert _run(["cat", "/cli/stdin.txt"], m).stdout == b"from stdin"
    out = tmp_path / "out.bin"
    assert _run(["get", "/cli/a.bin", str(out)], m).returncode == 0
    assert out.read_bytes() == src.read_bytes()
    r = _run(["ls", "/cli", "--json"], m)
    assert {e["path"] for e in json.loads(r.stdout)} == {"/cli/a.bin", "/cli/stdin.txt"}
    r = _run(["stat", "/cli/a.bin", "--json"], m)
    assert json.loads(r.stdout)["size"] == 200_000
    assert _run(["mv", "/cli/stdin.txt", "/cli/moved.txt"], m).returncode == 0
    assert _run(["rm", "/cli/moved.txt"], m).returncode == 0
    assert _run(["rm", "/cli/moved.txt"], m).returncode == 1
    r = _run(["cat", "/cli/none"], m)
    assert r.returncode == 1 and b"not found" in r.stderr
    r = _run(["stat", "/cli/../x"], m)
    assert r.returncode == 1 and b"InvalidPath" in r.stderr
    r = _run(["report", "--json"], m)
    rep = json.loads(r.stdout)
    assert len(rep["workers"]) == 2 and rep["files"] >= 1
    assert b"alive" in _run(["report"], m).stdout
    r = subprocess.run([*L2FS, "ls"], env={k: v for k, v in os.environ.items() if k != "L2FS_MASTER"},
                       capture_output=True, timeout=60)
    assert r.returncode == 2 and b"L2FS_MASTER" in r.stderr


def test_l2fs_local_foreground(tmp_path: Path) -> None:
    p = subprocess.Popen([*L2FS, "local", "--workers", "2", "--dir", str(tmp_path / "l"), "--capacity", "64M"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        master = None
        deadline = time.monotonic() + 60
        while master is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if line.startswith("export L2FS_MASTER="):
                master = line.split("=", 1)[1].split()[0]
        assert master, "l2fs local never printed its master address"
        r = _run(["put", "-", "/local/x"], master, input=b"hi")
        assert r.returncode == 0
        assert _run(["cat", "/local/x"], master).stdout == b"hi"
        assert len(json.loads(_run(["report", "--json"], master).stdout)["workers"]) == 2
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    assert rc == 0
    from l2fs.client import Client, Unavailable

    try:  # Ctrl-C took the master (and its workers) down with it
        Client(master, timeout=0.5).report()
        raise AssertionError("master still answering after Ctrl-C")
    except Unavailable:
        pass
