"""`kvtier bench <name>`: every benchmark of the project (`kvtier bench --help` lists them).

Each benchmark prints raw numbers and ratios measured side by side in one run, and writes JSON/CSV
(and plots where useful) under --out. CI runs them only at a tiny size (--quick); it never times them.
"""

from __future__ import annotations

BENCHES: dict[str, tuple[str, str]] = {
    "cross-pod": ("kvtier.bench.cross_pod", "TTFT cold vs cross-pod L2 hit vs same-pod L1 hit, by prompt length"),
    "l2": ("kvtier.bench.l2", "L2 data path: l2fs client/mount vs local dir vs Redis, same bytes"),
    "routing": ("kvtier.bench.routing", "multi-round chat through each router strategy and vllm-router"),
    "workload": ("kvtier.bench.workload", "multi-turn load past L0+L1: a fleet without kvtier vs each tier/router"),
    "routing-sim": ("kvtier.bench.routing_sim",
                    "routers on fake test replicas: hit rate vs oracle, balance, --overhead at a fixed rate"),
    "vllm-serve": ("kvtier.bench.vllm_serve", "vLLM's own `bench serve` (prefix_repetition) through each router"),
    "connector": ("kvtier.bench.connector_tiers", "TTFT cold / L1 / cross-pod L2 on two replicas, no router"),
    "chunk-read": ("kvtier.bench.chunk_read", "per-chunk cost of the in-engine L2 read (l2fs -> LMCache MemoryObj)"),
    "l2-load": ("kvtier.bench.l2_load_profile",
                "one kv8b L2 load batch step by step: raw read, plugin, LMCache's layers, the paged-KV copy"),
    "gpu-path": ("kvtier.bench.gpu_path", "l2fs chunk reads into pinned host memory and on to the GPU"),
    "l2fs": ("kvtier.bench.l2fs_read", "l2fs client reads/writes vs hot local file and raw loopback TCP"),
    "local-put": ("kvtier.bench.local_put", "same-node puts by block size: sealed memfd vs loopback data plane vs a file"),
    "load": ("kvtier.bench.l2fs_load", "sustained mixed put/get/lookup load: latency, errors, memory growth"),
    "mount": ("kvtier.bench.mount", "FUSE mount vs native l2fs client vs local file, same bytes"),
    "native-tier": ("kvtier.bench.native_tier",
                    "vLLM native offloading: the l2fs tier vs vLLM's fs tier on an l2fs mount / a local dir"),
    "native-tier-gpu": ("kvtier.bench.native_tier_gpu",
                        "vLLM native offloading + the l2fs tier end to end on a CUDA GPU (cold vs cross-engine)"),
}


def main(argv: list[str] | None = None) -> int:
    from kvtier.cli import dispatch

    return dispatch("kvtier bench", BENCHES, argv, noun="benchmark")
