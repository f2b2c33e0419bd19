"""Routing benchmark on test replicas: `python benchmarks/routing_bench.py [--overhead] ...`.

A thin entry point; the code is kvtier.bench.routing_sim (importable from an installed package).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from kvtier.bench.routing_sim import main

if __name__ == "__main__":
    sys.exit(main())
