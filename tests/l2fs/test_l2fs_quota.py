"""Per-prefix L2 quotas (tenant isolation): a prefix at its quota gets failed puts (a write miss,
`RESOURCE_EXHAUSTED`/EDQUOT), never evicts another prefix's blocks and never blocks its writes."""

from __future__ import annotations

import errno
import subprocess
import sys
from collections.abc import Callable

import pytest

from l2fs.client import QuotaExceeded, Unavailable
from l2fs.testing.cluster import LocalCluster

OBJ = 256 * 1024


def test_full_prefix_cannot_evict_or_block_another(make_cluster: Callable[..., LocalCluster]) -> None:
    # 6 MiB worker (evicts above 5.4 MiB): without the quota, 5 MiB into /q/a would evict /q/b's objects
    cluster = make_cluster(1, capacity="6M", master_args=["--prefix-quota", "/q/a=1MiB", "--prefix-quota", "/q/b=3M"])
    c = cluster.client()
    b_data = {f"/q/b/{i}": bytes([i]) * OBJ for i in range(3)}
    for k, v in b_data.items():
        assert c.put(k, v) is True
    results = c.put_many([(f"/q/a/{i}", bytes([100 + i]) * OBJ) for i in range(20)], return_exceptions=True)
    assert results[:4] == [True] * 4, results[:4]  # 1 MiB: exactly the quota
    refused = results[4:]
    # a refusal, not an outage: callers' circuit breakers (the LMCache plugin's) must not open on it
    assert all(isinstance(r, QuotaExceeded) and not isinstance(r, Unavailable) and r.errno == errno.EDQUOT
               for r in refused), refused[:2]
    with pytest.raises(QuotaExceeded, match="quota"):
        c.put("/q/a/one-more", b"x" * OBJ)
    # the other prefix: nothing evicted, writes still go through, up to its own quota
    for k, v in b_data.items():
        assert c.get(k) == v, f"{k} lost while /q/a was full"
    assert c.put("/q/b/late", b"L" * OBJ) is True and c.get("/q/b/late") == b"L" * OBJ
    assert c.put("/elsewhere/x", b"e" * OBJ) is True  # no quota there
    # moving bytes into a full prefix is a write too
    with pytest.raises(QuotaExceeded, match="quota"):
        c.rename("/q/b/0", "/q/a/moved")
    assert c.get("/q/b/0") == b_data["/q/b/0"] and not c.exists("/q/a/moved")
    # freeing room under the quota lets the prefix write again; an overwrite counts only its growth
    assert c.rm("/q/a/0") is True
    assert c.put("/q/a/again", b"a" * OBJ) is True
    assert c.put("/q/a/again", b"b" * OBJ, if_absent=False) is True
    assert c.report().files == 3 + 1 + 1 + 4


@pytest.mark.parametrize("spec", ["/q/a", "/q/a=lots", "=1G"])
def test_bad_prefix_quota_exits_2(spec: str) -> None:
    r = subprocess.run([sys.executable, "-m", "l2fs.cli", "master", "--port", "0", "--prefix-quota", spec],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--prefix-quota" in r.stderr, (r.returncode, r.stderr[-300:])
