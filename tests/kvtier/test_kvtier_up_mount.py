"""`kvtier up --mode mount` picks each node's mount: the read-write passthrough mount where a probe shows that
the kernel grants it (INIT's FUSE_PASSTHROUGH and a write's FUSE_DEV_IOC_BACKING_OPEN), the pyfuse3 mount
otherwise; `--mount-server` forces either. Real LocalCluster and `l2fs mount` processes; the fallback is
driven by a passthrough server told not to use passthrough (`--process-reads`: it answers INIT without it)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.up import Stack, build_parser, check_args, mount_node
from l2fs.fuse.main import mount_type
from l2fs.testing.cluster import LocalCluster

FUSE_OK = os.path.exists("/dev/fuse") and os.geteuid() == 0 and shutil.which("fusermount3") is not None


@pytest.mark.unit
def test_mount_server_flag() -> None:
    """--mount-server by kvtier up's own parser: auto by default, passthrough|pyfuse3 only with --mode mount."""
    p = build_parser()
    assert p.parse_args([]).mount_server == "auto" and check_args(p.parse_args(["--mode", "mount"])) is None
    for kind in ("passthrough", "pyfuse3"):
        assert check_args(p.parse_args(["--mode", "mount", "--mount-server", kind])) is None
        assert "needs --mode mount" in str(check_args(p.parse_args(["--mount-server", kind])))
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "mount", "--mount-server", "fuse"])
    with pytest.raises(ValueError, match="--mount-server"):
        Stack(Path("/nonexistent"), mode="mount", mount_server="fuse")


def _server(c: LocalCluster, i: int) -> str:
    """What node i's mount process is, by its own command line."""
    return "passthrough" if "--passthrough" in c.mounts[i][1].args else "pyfuse3"


@pytest.mark.fuse
@pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, root and fusermount3")
def test_mount_node_probes_passthrough_and_falls_back(tmp_path: Path,
                                                      make_cluster: Callable[..., LocalCluster]) -> None:
    c = make_cluster(2, capacity="256M")
    got = mount_node(c, 0, tmp_path / "m1", tmp_path / "cache-1", "auto")
    log1 = (c.base / "logs" / "mount-1.log").read_text()
    if "passthrough on" not in log1:
        assert got == "pyfuse3" and _server(c, 0) == "pyfuse3"  # this kernel grants none: the fallback
        pytest.skip("the kernel grants no FUSE passthrough (needs Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH)")
    assert got == "passthrough" and _server(c, 0) == "passthrough"
    assert list((tmp_path / "cache-1").glob("l2fs-pt-*"))  # its private dir of temp files in the cache dir
    (tmp_path / "m1" / "k.data").write_bytes(b"x" * 5000)
    with c.client() as cl:
        assert cl.get("/k.data") == b"x" * 5000 and not [p for p in cl.ls("/") if "probe" in p.path]
    # a passthrough server that answers INIT without passthrough: auto falls back, passthrough refuses
    with pytest.raises(RuntimeError, match="did not grant FUSE_PASSTHROUGH"):
        mount_node(c, 1, tmp_path / "m2", tmp_path / "cache-2", "passthrough", "--process-reads")
    assert mount_type(tmp_path / "m2") is None
    assert mount_node(c, 1, tmp_path / "m2", tmp_path / "cache-2", "auto", "--process-reads") == "pyfuse3"
    assert _server(c, 1) == "pyfuse3" and (tmp_path / "m2" / "k.data").read_bytes() == b"x" * 5000
    c.unmount(1)
    assert mount_node(c, 1, tmp_path / "m2", tmp_path / "cache-2", "pyfuse3") == "pyfuse3"
    assert _server(c, 1) == "pyfuse3"


@pytest.mark.unit
def test_bench_cross_pod_mount_server_flag() -> None:
    """`kvtier bench cross-pod --mount-server` by the bench's own parser: only for a mount-mode stack started here."""
    from kvtier.bench.cross_pod import _check_stack_args
    from kvtier.bench.cross_pod import build_parser as bench_parser

    p = bench_parser()
    assert _check_stack_args(p.parse_args(["--mode", "mount", "--mount-server", "pyfuse3"]), False) is None
    assert "needs --mode mount" in str(_check_stack_args(p.parse_args(["--mount-server", "passthrough"]), False))
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "mount", "--mount-server", "fast"])
