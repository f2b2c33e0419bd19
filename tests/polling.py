"""Polling for the whole suite: one `wait_until` (a uniquely named module: `conftest` names clash across areas).

Servers here are real processes, so a test waits for what they do (a worker declared dead, a block evicted, a
router seeing a replica) by polling, never by sleeping a fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, *,
               message: str | Callable[[], str] = "") -> T:
    """Poll cond() until it returns something truthy, and return that.

    A poll that raises counts as "not yet" (a process in the middle of a fault may refuse a call); after
    `timeout` seconds the test fails with `message` (or what a function given as `message` returns then) and
    the last value or exception.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = cond()
        except Exception as exc:  # noqa: BLE001 - a poll that raises is "not yet"; kept for the failure text
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            what = message() if callable(message) else message
            raise AssertionError(f"{what + ': ' if what else ''}condition not met within {timeout:.1f}s "
                                 f"(last: {last!r})") from (last if isinstance(last, BaseException) else None)
        time.sleep(interval)


def waited(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, *,
           message: str | Callable[[], str] = "") -> float:
    """wait_until, returning the seconds it took (what a detection-time check measures)."""
    t0 = time.monotonic()
    wait_until(cond, timeout, interval, message=message)
    return time.monotonic() - t0
