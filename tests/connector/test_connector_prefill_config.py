"""The load gate's prefill figure as configuration: `kvtier lmcache-config --prefill-tokens-per-s`, the
re-read figure file (what `kvtier bench cross-pod --prefill-tokens-per-s auto` writes), `kvtier up`'s env,
and the plugin following the file while it runs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from polling import wait_until

from connector.config import PREFILL_ENV, lmcache_config, main, read_prefill_file, watch_prefill_file
from kvtier.up import build_parser, check_args, prefill_env

KEY = "remote_storage_plugin.l2fs.prefill_tokens_per_s"


@pytest.mark.unit
def test_lmcache_config_writes_the_prefill_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert lmcache_config(l2fs_master="m:1", prefill_tokens_per_s=4300)["extra_config"][KEY] == 4300.0
    assert KEY not in lmcache_config(l2fs_master="m:1")["extra_config"]  # unset: the gate stays off
    out = tmp_path / "lmc.yaml"
    assert main(["--l2fs-master", "m:1", "--prefill-tokens-per-s", "900", "--out", str(out), "--format",
                 "yaml"]) == 0
    assert yaml.safe_load(out.read_text())["extra_config"][KEY] == 900.0
    capsys.readouterr()
    assert main(["--l2fs-master", "m:1", "--prefill-tokens-per-s", "900", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["lmcache"]["extra_config"][KEY] == 900.0
    # stock fs:// on a mount has no gate: a figure there would silently do nothing, so it is refused
    assert main(["--mount", "/mnt/l2fs", "--prefill-tokens-per-s", "900"]) == 2
    assert "needs --l2fs-master" in capsys.readouterr().err
    with pytest.raises(ValueError):
        lmcache_config(l2fs_master="m:1", prefill_tokens_per_s=-1)


@pytest.mark.unit
def test_prefill_file_is_followed(tmp_path: Path) -> None:
    f = tmp_path / "prefill"
    assert read_prefill_file(f) == 0.0  # missing: off
    seen: list[float] = []
    stop = threading.Event()
    watch_prefill_file(f, seen.append, interval=0.05, stop=stop)
    try:
        f.write_text("4300.5\n")
        deadline = time.monotonic() + 10  # for both waits
        wait_until(lambda: seen[-1] == 4300.5, 10, 0.02, message=lambda: str(seen))
        f.write_text("not a number")
        wait_until(lambda: seen[-1] == 0.0, deadline - time.monotonic(), 0.02, message=lambda: str(seen))
    finally:
        stop.set()
    assert seen[0] == 0.0


@pytest.mark.unit
def test_kvtier_up_passes_the_prefill_rate() -> None:
    assert prefill_env(4300) == {PREFILL_ENV: "4300"}
    assert prefill_env(None) == {}
    p = build_parser()
    assert check_args(p.parse_args(["--prefill-tokens-per-s", "4300"])) is None
    assert "plugin mode" in str(check_args(p.parse_args(["--prefill-tokens-per-s", "4300", "--mode", "mount"])))


def test_plugin_follows_the_prefill_file(tmp_path: Path, make_cluster: Callable[..., Any]) -> None:
    """A real LMCache StorageManager with our plugin: the gate's figure is the file's, re-read while running;
    the fixed figure is the fallback while the file holds none."""
    from test_connector_l2fs_plugin import _conn, _manager


    f = tmp_path / "prefill"
    cluster = make_cluster(1)
    sm = _manager(cluster.master, "node-1", extra={KEY: 1000,
                                                   "remote_storage_plugin.l2fs.prefill_tokens_per_s_file": str(f)})
    try:
        gate = _conn(sm).gate
        assert gate.prefill_tps == 1000.0
        f.write_text("4300")
        deadline = time.monotonic() + 15  # for both waits
        wait_until(lambda: gate.prefill_tps == 4300.0, 15, 0.1, message=lambda: str(gate.prefill_tps))
        f.unlink()
        wait_until(lambda: gate.prefill_tps == 1000.0, deadline - time.monotonic(), 0.1,
                   message=lambda: str(gate.prefill_tps))
    finally:
        sm.close()
