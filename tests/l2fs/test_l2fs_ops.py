"""Operations: Prometheus /metrics and /healthz on every role, bearer token, TLS, proto regeneration."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from polling import wait_until

from l2fs.client import PermissionDenied
from l2fs.testing.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


def _http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(text: str, name: str) -> float:
    vals = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
            or line.startswith(name + "{")]
    assert vals, f"{name} not exported"
    return sum(vals)


def test_metrics_and_health(cluster: LocalCluster) -> None:
    c = cluster.client(node_id="elsewhere")
    w = cluster.workers[0]
    c1 = cluster.client(node_id=w.node_id)
    data = b"m" * 100_000
    c1.put("/metrics/a", data)
    wtext0 = _http(w.metrics_port, "/metrics")[1]
    assert c.get("/metrics/a") == data  # gRPC read from worker 0
    assert c.get("/metrics/none") is None
    code, body = _http(cluster.master_metrics_port, "/healthz")
    assert code == 200 and json.loads(body)["workers_alive"] == 2
    code, mtext = _http(cluster.master_metrics_port, "/metrics")
    assert code == 200
    assert _metric(mtext, "l2fs_master_lookup_misses_total") >= 1
    assert _metric(mtext, "l2fs_master_workers_alive") == 2
    assert _metric(mtext, "l2fs_master_rpc_seconds_count") > 0
    code, wtext = _http(w.metrics_port, "/metrics")
    assert code == 200
    assert _metric(wtext, "l2fs_worker_read_hits_total") == _metric(wtext0, "l2fs_worker_read_hits_total") + 1
    assert _metric(wtext, "l2fs_worker_bytes_read_total") >= len(data)
    assert _metric(wtext, "l2fs_worker_capacity_bytes") == 1 << 30
    assert _metric(wtext, "l2fs_worker_used_bytes") >= len(data)
    assert "l2fs_worker_evictions_total" in wtext
    code, body = _http(w.metrics_port, "/healthz")
    assert code == 200 and json.loads(body)["registered"] is True
    assert _http(w.metrics_port, "/readyz")[0] == 200
    assert _http(cluster.master_metrics_port, "/readyz")[0] == 200
    assert _http(w.metrics_port, "/nope")[0] == 404


def test_token_required(make_cluster: Callable[..., LocalCluster]) -> None:
    cl = make_cluster(1, token="s3cret")
    good = cl.client(node_id="node-1")
    assert good.put("/t/a", b"x") is True and good.get("/t/a") == b"x"
    bad = cl.client(token="wrong")
    with pytest.raises(PermissionDenied, match="token"):
        bad.stat("/t/a")
    assert bad.get("/t/a") is None  # reads stay fail-as-miss
    none = cl.client(token="")
    with pytest.raises(PermissionDenied):
        none.put("/t/b", b"y")


def test_tls(tmp_path: Path, make_cluster: Callable[..., LocalCluster]) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_pem, cert_pem, key_pem = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    cl = make_cluster(1, tls_cert=str(cert_pem), tls_key=str(key_pem), tls_ca=str(ca_pem))
    c = cl.client(node_id="remote")
    assert c.put("/tls/a", b"secure") is True
    assert c.get("/tls/a") == b"secure"
    from l2fs.client import Client, Unavailable
    plain = Client(cl.master, tls_ca="", timeout=1.0)
    with pytest.raises(Unavailable):
        plain.stat("/tls/a")


def test_proto_regenerates_identically(tmp_path: Path) -> None:
    src = ROOT / "l2fs" / "proto"
    dst = tmp_path / "proto"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', sys.argv[1]);"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); sys.exit(m.main())")
    subprocess.run([sys.executable, "-c", code, str(dst / "build.py")], check=True)
    for name in ("l2fs_pb2.py", "l2fs_pb2_grpc.py", "l2fs_pb2.pyi"):
        assert (dst / name).read_text() == (src / name).read_text(), f"{name} is stale: run python -m l2fs.proto.build"


def test_worker_not_ready_without_master(make_cluster: Callable[..., LocalCluster]) -> None:
    cl = make_cluster(1, heartbeat_interval=0.2)
    w = cl.workers[0]
    # the master lists the worker a moment before the worker's registration call returns and marks it ready
    wait_until(lambda: _http(w.metrics_port, "/readyz")[0] == 200, 10, 0.1,
               message="worker never ready with its master up")
    cl.kill_master()
    wait_until(lambda: _http(w.metrics_port, "/readyz")[0] == 503, 10, 0.1,
               message="worker still ready with its master gone")
    assert _http(w.metrics_port, "/healthz")[0] == 200  # alive, just not ready
    cl.start_master()
    cl.wait_workers(1)
    wait_until(lambda: _http(w.metrics_port, "/readyz")[0] == 200, 10, 0.1,
               message="worker not ready again after the master came back")
