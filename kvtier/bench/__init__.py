"""`kvtier bench cross-pod|l2|routing`: benchmarks that run the real stack and print tables.

Each benchmark prints raw numbers and ratios measured side by side in one run, and writes JSON/CSV
(and plots where useful) under --out. CI runs them only at a tiny size (--quick); it never times them.
"""

from __future__ import annotations

import importlib
import sys

BENCHES: dict[str, tuple[str, str]] = {
    "cross-pod": ("kvtier.bench.cross_pod", "TTFT cold vs cross-pod L2 hit vs same-pod L1 hit, by prompt length"),
    "l2": ("kvtier.bench.l2", "L2 data path: l2fs client/mount vs local dir vs Redis, same bytes"),
    "routing": ("kvtier.bench.routing", "multi-round chat through each router strategy and vllm-router"),
}


def _usage() -> str:
    lines = ["usage: kvtier bench <name> [args...]", "", "benchmarks:"]
    lines += [f"  {n:<10} {h}" for n, (_, h) in BENCHES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] not in BENCHES:
        print(f"kvtier bench: unknown benchmark {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    rc = importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])
    return int(rc or 0)
