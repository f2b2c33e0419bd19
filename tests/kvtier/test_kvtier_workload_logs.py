"""`kvtier bench workload` keeps an earlier run's logs when a later run uses the same --dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.bench.workload import keep_logs

pytestmark = pytest.mark.unit


def test_an_earlier_runs_logs_are_moved_aside_not_overwritten(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    assert keep_logs(logs) is None  # nothing yet
    logs.mkdir()
    assert keep_logs(logs) is None and logs.is_dir()  # empty: left where it is
    (logs / "router-kvaware.log").write_text("run 1")
    os.utime(logs / "router-kvaware.log", (1_796_400_000, 1_796_400_000))
    first = keep_logs(logs)
    assert first is not None and first.name.startswith("logs-20261204T") and not logs.exists()
    assert (first / "router-kvaware.log").read_text() == "run 1"
    logs.mkdir()
    (logs / "router-kvaware.log").write_text("run 2")
    os.utime(logs / "router-kvaware.log", (1_796_400_000, 1_796_400_000))  # the same second: another name
    second = keep_logs(logs)
    assert second is not None and second != first and second.name.endswith("-2")
    assert (first / "router-kvaware.log").read_text() == "run 1"
    assert (second / "router-kvaware.log").read_text() == "run 2"
