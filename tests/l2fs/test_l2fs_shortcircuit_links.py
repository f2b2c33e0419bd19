"""Short-circuit writes never go through a link planted at the reserved temp name (client side):
in plugin mode pods share the worker's data dir, so another pod can put a symlink at `tmp/<id>.part`
between the worker's reservation and the client's open."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import l2fs.client.write as client_mod  # the put path (its module-level helpers are patched)
from l2fs.testing.cluster import LocalCluster


def test_planted_symlink_at_reserved_temp_path_is_not_written_through(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outside = tmp_path / "outside-the-data-dir"
    outside.write_bytes(b"precious")
    real = client_mod._write_file
    planted: list[str] = []

    def attacker_first(tmp: str, mv: memoryview) -> Any:  # the attacker wins the race to the temp name
        os.symlink(outside, tmp)
        planted.append(tmp)
        return real(tmp, mv)

    monkeypatch.setattr(client_mod, "_write_file", attacker_first)
    c = cluster.client(node_id=cluster.workers[0].node_id, fd_passing=False,  # the path-based short-circuit
                       local_writes=True)
    data = os.urandom(100_000)
    assert c.put("/sc/links/a", data) is True  # fell back to the data plane with a fresh block id
    assert planted and all(Path(p).is_relative_to(cluster.workers[0].data_dir) for p in planted)
    assert outside.read_bytes() == b"precious", "the short-circuit write went through the planted symlink"
    assert c.get("/sc/links/a") == data
    st = c.stat("/sc/links/a")
    assert st is not None and st.size == len(data)
    c.close()
