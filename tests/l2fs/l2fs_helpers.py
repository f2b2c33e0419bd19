"""Helpers shared by the l2fs tests (a uniquely named module: `conftest` names clash across areas)."""

from __future__ import annotations

from polling import wait_until  # noqa: F401  (the suite's one poller, re-exported for the l2fs tests)

from l2fs.testing.cluster import LocalCluster


def block_files(cluster: LocalCluster, i: int) -> list:
    """Block files on worker i's disk (what it really stores)."""
    return sorted(p for p in (cluster.workers[i].data_dir / "blocks").glob("*/*") if p.is_file())


def master_rpcs(cluster: LocalCluster) -> dict[str, float]:
    """Master RPCs served so far, by method (l2fs_master_rpc_seconds_count from its Prometheus endpoint)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.master_metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^l2fs_master_rpc_seconds_count\{method="(\w+)"\} (\S+)$', text, re.M)}
