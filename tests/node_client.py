"""An l2fs client that runs as its own process inside a node of a network-namespace cluster, driven by the
test over a pipe (one JSON line per call, one per answer).

Why a process: the test process lives on the host, where no worker address is reachable, and gRPC makes
its sockets on its own threads, so a setns() of the calling thread cannot move a Client. A real client
process on the node sees exactly the node's network: a partition, a link down or a rate cut of that node
is what its calls meet. It times each call itself (the pipe adds nothing to the figure).

    with NodeClient(net, "node-3", cluster.master, timeout=2.0) as c:
        call = c.call("get", "/k")      # RemoteCall(op, seconds, result, error, l2fs_error)

Run as a script it is the agent: `python node_client.py MASTER NODE_ID TIMEOUT`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _enc(v: Any) -> Any:
    """JSON form of a call's argument or result: bytes as {"b64": ...}, dataclasses as dicts."""
    if isinstance(v, bytes | bytearray | memoryview):
        return {"b64": base64.b64encode(bytes(v)).decode()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _enc(dataclasses.asdict(v))
    if isinstance(v, dict):
        return {k: _enc(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_enc(x) for x in v]
    return v


def _dec(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"b64"}:
        return base64.b64decode(v["b64"])
    if isinstance(v, dict):
        return {k: _dec(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


@dataclasses.dataclass
class RemoteCall:
    """One client call made on the node: its outcome and how long the node's client took."""

    op: str
    seconds: float
    result: Any = None
    error: str | None = None      # exception class name, None when the call returned
    l2fs_error: bool = False      # the exception was an l2fs error (the promised failure mode)
    message: str = ""


class NodeClient:
    """The agent process in `where` (a node of `net`), an l2fs Client on `master` with node id = the node's."""

    def __init__(self, net: Any, where: Any, master: str, *, timeout: float = 2.0,
                 node_id: str | None = None) -> None:
        ns = net.ns(where)
        env = {**os.environ, "L2FS_TOKEN": "", "PYTHONPATH": str(ROOT)}
        self.proc = net.popen(ns, [sys.executable, __file__, master, node_id or ns.name, str(timeout)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def call(self, op: str, *args: Any, wait: float = 60.0) -> RemoteCall:
        """Make the call on the node; an agent that answers nothing within `wait` s fails the test."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": _enc(list(args))}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], wait)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"node client gave no answer to {op} within {wait}s (rc={self.proc.poll()})")
        out = json.loads(line)
        return RemoteCall(op, out["seconds"], _dec(out.get("result")), out.get("error"), out.get("l2fs", False),
                          out.get("msg", ""))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _agent(master: str, node_id: str, timeout: float) -> None:
    """Serve calls from stdin until it closes: `{"op", "args"}` -> `{"seconds", "result"|"error"}`."""
    from l2fs.client import Client, L2fsError

    client = Client(master, node_id=node_id, timeout=timeout)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.monotonic()
        try:
            out: dict[str, Any] = {"result": _enc(getattr(client, req["op"])(*_dec(req["args"])))}
        except Exception as e:  # noqa: BLE001 - every outcome goes back to the test, which judges it
            out = {"error": type(e).__name__, "l2fs": isinstance(e, L2fsError), "msg": str(e)[:500]}
        out["seconds"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
    client.close()


if __name__ == "__main__":
    _agent(sys.argv[1], sys.argv[2], float(sys.argv[3]))
