"""tests/rotation.py: one variant a day, all of them over consecutive days, every one with KVTIER_ROTATE=all."""

from __future__ import annotations

import pytest
import rotation

pytestmark = pytest.mark.unit


def _taken(params: list) -> list:
    return [p.values[0] for p in params if not any(m.name == "skip" for m in p.marks)]


def test_one_variant_a_day_and_all_over_consecutive_days(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_ROTATE", raising=False)
    seen = []
    for d in range(20_425, 20_428):
        monkeypatch.setattr(rotation, "day", lambda d=d: d)
        params = rotation.of_the_day(["a", "b", pytest.param("c", marks=pytest.mark.fuse, id="c")])
        assert len(params) == 3 and len(_taken(params)) == 1
        seen += _taken(params)
        assert any(m.name == "fuse" for m in params[2].marks)  # a param's own marks are kept
    assert sorted(seen) == ["a", "b", "c"]


def test_rotate_all_takes_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_ROTATE", "all")
    assert _taken(rotation.of_the_day([1, 2, 3])) == [1, 2, 3]
