"""Which one-box modes a suite run takes (test_operator_onebox.onebox_modes): one per run by default, rotating by
UTC day so that CI on consecutive days covers mount, plugin and mp mode; any set on request."""

from __future__ import annotations

import pytest
from test_operator_onebox import ONEBOX_MODES, onebox_modes

pytestmark = pytest.mark.unit


def test_default_takes_one_mode_a_day_and_three_days_take_all() -> None:
    for env in (None, "", "day"):
        for start in (0, 20_425, 20_790):
            days = [onebox_modes(env, start + i) for i in range(3)]
            assert all(len(d) == 1 for d in days), days
            assert sorted(m for d in days for m in d) == sorted(ONEBOX_MODES)


def test_all_none_and_lists() -> None:
    assert onebox_modes("all", 7) == ONEBOX_MODES
    assert onebox_modes("0", 7) == onebox_modes("none", 7) == ()
    assert onebox_modes("plugin, mp", 7) == ("plugin", "mp")


def test_an_unknown_mode_is_an_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown mode.*'plugn'.*mount, plugin, mp"):
        onebox_modes("mount,plugn", 0)
