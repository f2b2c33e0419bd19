"""Start one `lmcache server` (LMCache multiprocess mode) with kvtier's l2fs L2 adapter: the sidecar of a replica.

    srv = start_mp_server(master, "node-1", log_path, prefix="/kvtier/mp")
    srv.port           # where vLLM's LMCache MP connector connects (tcp://127.0.0.1:PORT)
    mp_transfer_config(srv.port)   # the vLLM --kv-transfer-config for it
    srv.stop()

Why these flags: LMCache's CPU client talks engine_driven (worker-side gather/scatter), whose handlers the
server registers only with --supported-transfer-mode engine_driven|auto, and `lmcache server` refuses to start
with --l1-size-gb but no --eviction-policy. Used by `kvtier up --lmcache-mode mp` and the MP tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier import contract
from l2fs import procs
from l2fs.common import free_port

MP_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"  # LMCache's own; vLLM's needs CUDA
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class MPServer:
    proc: subprocess.Popen
    port: int
    http_port: int
    log_path: Path

    def stop(self) -> None:
        procs.stop(self.proc)


def mp_transfer_config(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """vLLM --kv-transfer-config: LMCache's MP connector to the server at host:port, engine_driven."""
    return {"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": MP_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port,
                                          "lmcache.mp.mp_transfer_mode": "engine_driven"}}


def start_mp_server(master: str, node_id: str, log_path: str | Path, *, prefix: str = contract.MP_PREFIX,
                    l1_gb: float = 0.5, chunk_size: int = contract.CHUNK_SIZE,
                    env: dict[str, str] | None = None, timeout: float = 300.0,
                    transfer_mode: str = "engine_driven") -> MPServer:
    """Launch the server, wait for its HTTP /status; raises (with the log tail) if it exits first.
    transfer_mode: what the server accepts (lmcache_driven = its shared-memory path, CUDA IPC or CPU SHM)."""
    port, http = free_port(), free_port()
    adapter = {"type": "plugin", "module_path": "connector.mp_l2fs", "class_name": "L2fsL2Adapter",
               "adapter_params": {"master": master, "node_id": node_id, "prefix": prefix}}
    e = dict(os.environ if env is None else env)
    e.setdefault("PYTHONPATH", str(ROOT))
    e.update(LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED=contract.HASH_SEED, LMCACHE_DISABLE_BANNER="1")
    log_path = Path(log_path)
    p = procs.spawn([sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
                     "--chunk-size", str(chunk_size), "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU",
                     "--supported-transfer-mode", transfer_mode, "--http-host", "127.0.0.1",
                     "--http-port", str(http), "--l2-adapter", json.dumps(adapter)], log_path, env=e)
    try:
        procs.wait_ready(p, lambda: procs.http_ok(f"http://127.0.0.1:{http}/status") or None, timeout=timeout,
                         what=f"lmcache server {node_id}", log_path=log_path)
    except BaseException:
        procs.stop(p)
        raise
    return MPServer(p, port, http, log_path)
