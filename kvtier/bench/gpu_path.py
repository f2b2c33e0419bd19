"""GPU data path check: l2fs chunk reads into pinned host memory and on to GPU memory, against a
local-file read + the same copy of the same bytes (a benchmark, not a test).

What a replica does on an L2 hit on a GPU node, minus vLLM/LMCache: read a KV chunk from l2fs into a pinned
host buffer, then `.to('cuda', non_blocking=True)` + synchronize. Needs only torch and the l2fs client. Arms,
same bytes, same run, one batch = N chunks of one size (1 MiB ~ one LMCache chunk of a small model, 32 MiB ~
one chunk of a 70B-class model):

  local file           os.readinto of plain files holding the same bytes (page cache): the floor
  l2fs short-circuit   Client.locate_many + get_into, reader on the block's node (reads the worker's block file, CRC checked)
  l2fs data plane      Client.locate_many + get_into, reader on no worker's node (raw-TCP data plane from the worker)

Each arm: host read ms, then host->device copy ms, per batch (median over --reps); GB/s of each phase and of
the whole path, and the ratio of each arm's whole path to the local-file arm's.

    .venv/bin/kvtier bench gpu-path                      # CUDA if torch sees one, else host only
    .venv/bin/kvtier bench gpu-path --master H:P --node-id NODE   # an existing l2fs cluster
    .venv/bin/kvtier bench gpu-path --device cpu --quick # what CI runs (no GPU)

Without CUDA it says so and measures the host part only (the copy columns are '-'; buffers are not pinned,
since pinning needs a CUDA driver).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from l2fs.client import Client

MIB = 1 << 20
SIZES = {1 * MIB: 32, 32 * MIB: 8}  # chunk size -> chunks per batch
QUICK_SIZES = {1 * MIB: 4, 32 * MIB: 2}
ARMS = ("local file", "l2fs short-circuit", "l2fs data plane")


def pick_device(want: str) -> tuple[str, str]:
    """(device, note): 'cuda' only when torch really has one; 'auto' falls back to cpu and says why."""
    has = torch.cuda.is_available()
    if want == "cuda" and not has:
        raise SystemExit("gpu_path: --device cuda but torch sees no CUDA device "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    if want == "cpu" or not has:
        why = "asked for --device cpu" if want == "cpu" else (
            f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda})")
        return "cpu", f"NO CUDA: {why}; host part only, buffers not pinned"
    name = torch.cuda.get_device_name(0)
    return "cuda", f"CUDA device 0: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def host_buffers(n: int, size: int, device: str) -> list[torch.Tensor]:
    """One uint8 host buffer per chunk of the batch; pinned when a GPU is the destination."""
    return [torch.empty(size, dtype=torch.uint8, pin_memory=(device == "cuda")) for _ in range(n)]


def to_device(bufs: list[torch.Tensor], device: str) -> float:
    """Seconds to copy every buffer to the device (async copies, one synchronize); 0 on cpu."""
    if device != "cuda":
        return 0.0
    t0 = time.perf_counter()
    outs = [b.to(device, non_blocking=True) for b in bufs]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del outs
    return dt


def read_local(paths: list[Path], bufs: list[torch.Tensor]) -> None:
    for p, b in zip(paths, bufs, strict=True):
        mv = memoryview(b.numpy()).cast("B")
        with open(p, "rb", buffering=0) as f:
            got = 0
            while got < len(mv):
                n = f.readinto(mv[got:])
                if not n:
                    raise RuntimeError(f"{p}: short read")
                got += n


def read_l2fs(client: Client, paths: list[str], bufs: list[torch.Tensor]) -> None:
    """One batch as the connector reads it: one StatMany for the locations, then a get_into per chunk."""
    client.locate_many(paths)
    for p, b in zip(paths, bufs, strict=True):
        if client.get_into(p, memoryview(b.numpy())) != b.numel():
            raise RuntimeError(f"l2fs miss on {p} (a fault is a miss; nothing to time)")


def run(master: str, node_id: str, device: str, sizes: dict[int, int], reps: int, workdir: Path
        ) -> list[dict[str, Any]]:
    """Write the chunks once (local files + l2fs), then time every arm per chunk size; raw rows."""
    writer = Client(master, node_id=node_id, timeout=60)
    near = Client(master, node_id=node_id, timeout=60)
    far = Client(master, node_id=f"gpu-path-reader-{uuid.uuid4().hex[:6]}", timeout=60)  # on no worker's node
    run_dir = f"/gpu-path-bench/{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []
    try:
        for size, n in sizes.items():
            datas = [os.urandom(size) for _ in range(n)]
            local = [workdir / f"{size}-{i}" for i in range(n)]
            remote = [f"{run_dir}/{size}/{i}" for i in range(n)]
            for d, lp, rp in zip(datas, local, remote, strict=True):
                lp.write_bytes(d)
                writer.put(rp, d)
            bufs = host_buffers(n, size, device)
            arms = {"local file": lambda lp=local, b=bufs: read_local(lp, b),
                    "l2fs short-circuit": lambda rp=remote, b=bufs: read_l2fs(near, rp, b),
                    "l2fs data plane": lambda rp=remote, b=bufs: read_l2fs(far, rp, b)}
            for fn in arms.values():  # warm-up: page cache, connections, CUDA context
                fn()
                to_device(bufs, device)
            if not all(bytes(b.numpy()) == d for b, d in zip(bufs, datas, strict=True)):
                raise RuntimeError("bytes read back differ from bytes written")
            for rep in range(reps):
                for arm, fn in arms.items():  # interleaved so that drift hits every arm alike
                    t0 = time.perf_counter()
                    fn()
                    read_s = time.perf_counter() - t0
                    copy_s = to_device(bufs, device)
                    rows.append({"chunk_bytes": size, "chunks": n, "rep": rep, "arm": arm, "device": device,
                                 "read_ms": read_s * 1e3, "copy_ms": copy_s * 1e3 if device == "cuda" else None})
            for rp in remote:
                writer.rm(rp)
    finally:
        for c in (writer, near, far):
            c.close()
    return rows


def summarize(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for size in dict.fromkeys(r["chunk_bytes"] for r in raw):
        base_total = None
        for arm in ARMS:
            rs = [r for r in raw if r["chunk_bytes"] == size and r["arm"] == arm]
            batch = size * rs[0]["chunks"]
            read = statistics.median(r["read_ms"] for r in rs)
            copy = statistics.median(r["copy_ms"] for r in rs) if rs[0]["copy_ms"] is not None else None
            total = read + (copy or 0.0)
            base_total = base_total or total
            out.append({"chunk_bytes": size, "chunks": rs[0]["chunks"], "arm": arm, "reps": len(rs),
                        "read_ms": read, "copy_ms": copy, "total_ms": total,
                        "read_gbps": batch / read / 1e6, "copy_gbps": batch / copy / 1e6 if copy else None,
                        "total_gbps": batch / total / 1e6, "total_vs_local": total / base_total})
    return out


def render(rows: list[dict[str, Any]], device: str) -> str:
    def f(v: float | None, nd: int = 2) -> str:
        return "-" if v is None else f"{v:.{nd}f}"

    head = ["chunk", "chunks", "arm", "read ms", "read GB/s", f"->{device} ms", f"->{device} GB/s", "total ms",
            "total GB/s", "total / local file"]
    cells = [[f"{r['chunk_bytes'] // MIB} MiB", str(r["chunks"]), r["arm"], f(r["read_ms"]), f(r["read_gbps"]),
              f(r["copy_ms"]), f(r["copy_gbps"]), f(r["total_ms"]), f(r["total_gbps"]),
              f(r["total_vs_local"]) + "x"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *cells, strict=True)]
    line = lambda c: "| " + " | ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench gpu-path", description=__doc__.split("\n")[0])
    p.add_argument("--master", help="an existing l2fs master host:port (default: start master + 1 worker here)")
    p.add_argument("--node-id", default="node-1", help="node of the writer and the short-circuit reader; with "
                   "--master, run this on a node that has a worker and give that worker's node id")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--reps", type=int, default=15, help="timed batches per arm and size (median reported)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: fewer chunks, 3 reps")
    p.add_argument("--dir", type=Path, default=None, help="scratch dir for the local files (and local cluster)")
    p.add_argument("--json", type=Path, default=None, help="also write summary + raw rows here")
    a = p.parse_args(argv)
    device, note = pick_device(a.device)
    print(note, flush=True)
    sizes, reps = (QUICK_SIZES, 3) if a.quick else (SIZES, a.reps)
    with tempfile.TemporaryDirectory(prefix="gpu-path-", dir=a.dir) as tmp:
        work = Path(tmp) / "local"
        work.mkdir()
        if a.master:
            raw = run(a.master, a.node_id, device, sizes, reps, work)
        else:
            from l2fs.testing.cluster import LocalCluster

            with LocalCluster(Path(tmp) / "l2fs", workers=1, metrics=False) as cluster:
                raw = run(cluster.master, cluster.workers[0].node_id, device, sizes, reps, work)
    rows = summarize(raw)
    print(f"l2fs chunk -> {'pinned host -> GPU' if device == 'cuda' else 'host memory (no GPU copy)'}; "
          f"median of {reps} batches; same bytes in every arm; page cache warm")
    print(render(rows, device))
    if a.json:
        a.json.write_text(json.dumps({"device": device, "note": note, "rows": rows, "raw": raw}, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
