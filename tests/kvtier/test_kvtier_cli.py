"""`kvtier up` / `kvtier bench` refuse bad options with a clear message before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "0"], "--replicas and --workers must be >= 1"),
    (["--strategy", "fastest"], "unknown --strategy 'fastest'"),
    (["--model", "/nonexistent/model"], "no such directory"),
    (["--port", "70000"], "is not a TCP port"),
])
def test_up_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "up", "--dir", str(tmp_path), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert not (tmp_path / "up.json").exists() and not (tmp_path / "l2fs").exists()


def test_from_up_rejects_a_non_state_file(tmp_path: Path) -> None:
    bogus = tmp_path / "up.json"
    bogus.write_text('{"hello": 1}')
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "cross-pod", "--quick", "--from-up",
                        str(bogus)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "is not a kvtier up state file" in r.stderr
