"""Variants of an expensive check that a suite run takes one of, rotating by UTC day.

Some parametrized tests run the same path over variants that each cost a vLLM stack or an LMCache import
(tens of seconds to minutes): netns cross-pod in plugin and mount mode, LMCache's MP server in both transfer
modes, the chunk hash under several PYTHONHASHSEEDs, the router's tokenizer fallbacks. A default suite run
takes one variant of each, chosen by the day (days since the epoch mod the number of variants), so CI on
consecutive days covers every variant and the suite stays within its time budget; the others are reported as
skipped with the reason. KVTIER_ROTATE=all takes every variant (the one-box modes have their own switch,
KVTIER_ONEBOX).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import pytest


def day() -> int:
    return int(time.time() // 86400)


def of_the_day(values: Sequence[Any], ids: Sequence[str] | None = None) -> list[Any]:
    """`values` as pytest params, all but the day's one marked skip (every one with KVTIER_ROTATE=all). A value
    that is already a pytest.param keeps its own marks and id."""
    take_all = os.environ.get("KVTIER_ROTATE", "").strip() == "all"
    chosen = day() % len(values)
    out = []
    for i, v in enumerate(values):
        p = v if isinstance(v, type(pytest.param(None))) else pytest.param(v, id=ids[i] if ids else None)
        if not take_all and i != chosen:
            name = p.id or str(p.values[0])
            p = pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.skip(
                reason=f"variant {name} not in this run (one of {len(values)} a day; KVTIER_ROTATE=all takes all)")])
        out.append(p)
    return out
