"""Router test helpers: real test-replica and router processes on loopback (imported by the tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from polling import wait_until  # noqa: F401  (the suite's one poller, re-exported for the router tests)

from l2fs import procs
from l2fs.common import free_port

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    p: subprocess.Popen
    url: str
    log: Path
    kv: str | None = None
    replay: str | None = None
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        procs.stop(self.p, grace=5)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, **kw)


def _spawn(args: list[str], log: Path, pattern: str, timeout: float = 60.0,
           pythonpath: str = str(ROOT)) -> tuple[subprocess.Popen, str]:
    """Start a replica or router and return it with the URL it prints once it listens."""
    p = procs.spawn(args, log, env=dict(os.environ, PYTHONPATH=pythonpath), cwd=ROOT, append=False)
    try:
        return p, procs.wait_ready(p, procs.log_match(log, pattern), timeout=timeout, what=" ".join(args[:4]),
                                   log_path=log)
    except BaseException:
        procs.stop(p, grace=5)
        raise


class Cluster:
    """Starts replicas and routers; stops everything at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.n = 0

    def replica(self, *args: str, kv: bool = True, replay: bool = True) -> Proc:
        self.n += 1
        cmd = [PY, "-m", "kvtier.devstack.testreplica", "--port", "0", *args]
        kv_ep = replay_ep = None
        if kv:
            kv_ep = f"tcp://127.0.0.1:{free_port()}"
            cmd += ["--kv-events", kv_ep]
            if replay:
                replay_ep = f"tcp://127.0.0.1:{free_port()}"
                cmd += ["--kv-replay", replay_ep]
        log = self.tmp / f"replica{self.n}.log"
        p, url = _spawn(cmd, log, r"listening on (http://\S+)")
        proc = Proc(p, url, log, kv_ep, replay_ep)
        self.procs.append(proc)
        return proc

    def router(self, replicas: list[Proc], *args: str, kv: bool = False) -> Proc:
        self.n += 1
        cmd = [PY, "-m", "router.cli", "--port", "0", "--replicas", ",".join(r.url for r in replicas),
               "--health-interval", "0.5", *args]
        if kv:
            cmd += ["--kv-events", ",".join(r.kv or "" for r in replicas),
                    "--kv-replay", ",".join(r.replay or "" for r in replicas)]
        log = self.tmp / f"router{self.n}.log"
        p, url = _spawn(cmd, log, r"listening on (http://\S+)")
        proc = Proc(p, url, log)
        self.procs.append(proc)
        proc.get("/health")  # answered only after startup (event subscribers connected and caught up)
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def complete(router: Proc, prompt: str, *, headers: dict | None = None, **body) -> httpx.Response:
    payload = {"model": "test-model", "prompt": prompt, "max_tokens": 2, **body}
    return router.post("/v1/completions", json=payload, headers=headers or {})


def metric(router: Proc, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample (matching the given labels) from the router's /metrics."""
    total = 0.0
    for line in router.get("/metrics").text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total




def spawn_router(args: list[str], log: Path, pythonpath: str = str(ROOT)) -> Proc:
    """A router process (`router.cli` + args) on its own PYTHONPATH (a sitecustomize dir first: an image with
    another or no LMCache, tests/import_patch.py); the caller stops it."""
    p, url = _spawn([PY, "-m", "router.cli", *args], log, r"listening on (http://\S+)", timeout=120,
                    pythonpath=pythonpath)
    return Proc(p, url, log)


def l2_key_state(router: Proc) -> str | None:
    """The state the router's kvtier_router_l2_key_check gauge shows (the one at 1)."""
    on = re.findall(r'^kvtier_router_l2_key_check\{state="(\w+)"\} 1\.0$', router.get("/metrics").text, re.M)
    return on[0] if on else None
