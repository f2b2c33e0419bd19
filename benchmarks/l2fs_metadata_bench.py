"""The l2fs master at cluster rates: a thin entry to `kvtier bench l2 --metadata` (kvtier/bench/l2_metadata.py).

    .venv/bin/python benchmarks/l2fs_metadata_bench.py                 # 10k and 100k files, shards, Redis
    .venv/bin/python benchmarks/l2fs_metadata_bench.py --files 10000 --shards '' --no-redis --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.bench.l2_metadata import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
