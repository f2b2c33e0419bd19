"""`kvtier bench cross-pod|l2|routing`: benchmarks that run the real stack and print tables.

Each benchmark prints raw numbers and ratios measured side by side in one run, and writes JSON/CSV
(and plots where useful) under --out. CI runs them only at a tiny size (--quick); it never times them.
"""

from __future__ import annotations

BENCHES: dict[str, tuple[str, str]] = {
    "cross-pod": ("kvtier.bench.cross_pod", "TTFT cold vs cross-pod L2 hit vs same-pod L1 hit, by prompt length"),
    "l2": ("kvtier.bench.l2", "L2 data path: l2fs client/mount vs local dir vs Redis, same bytes"),
    "routing": ("kvtier.bench.routing", "multi-round chat through each router strategy and vllm-router"),
}


def main(argv: list[str] | None = None) -> int:
    from kvtier.cli import dispatch

    return dispatch("kvtier bench", BENCHES, argv, noun="benchmark")
