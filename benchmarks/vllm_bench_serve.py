"""vLLM's own `bench serve --dataset-name prefix_repetition` through kvtier's router and vllm-router:
`python benchmarks/vllm_bench_serve.py [--reps 2] ...` (run it under `flock /tmp/kvtier-vllm.lock`).

A thin entry point; the code is kvtier.bench.vllm_serve (importable from an installed package).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from kvtier.bench.vllm_serve import main

if __name__ == "__main__":
    sys.exit(main())
