"""K8sIdentity admission (authenticate before spending): reviews of tokens no cache knows are bounded
in concurrency and rate, and a refused token is not asked about again for a while, so a stranger sending made-up
bearer tokens to the master's worker methods can neither hold its handler threads for the API round trip nor
make it flood the API server. The API server is stood in for by `_ask` (its reply objects are the official
client's models); the master's own code paths are the real ones."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client

from l2fs.master import identity
from l2fs.master.identity import K8sIdentity

pytestmark = pytest.mark.unit

SA = "kvtier:l2fs-worker"
GOOD = "good-token-of-node-1"


class _Api(K8sIdentity):
    """A K8sIdentity whose API server answers from a table after `delay` s, counting concurrent calls."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(SA, "l2fs")
        self.delay, self.now_in, self.max_in = delay, 0, 0
        self._count = threading.Lock()

    def _ask(self, token: str) -> Any:
        with self._count:
            self.reviews += 1
            self.now_in += 1
            self.max_in = max(self.max_in, self.now_in)
        try:
            time.sleep(self.delay)
            if token == GOOD:
                user = client.V1UserInfo(username=f"system:serviceaccount:{SA}",
                                         extra={identity.NODE_KEY: ["node-1"]})
                return client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token), status=client.V1TokenReviewStatus(
                    authenticated=True, user=user, audiences=["l2fs"]))
            return client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token),
                                        status=client.V1TokenReviewStatus(authenticated=False, error="unknown"))
        finally:
            with self._count:
                self.now_in -= 1


def test_concurrent_made_up_tokens_hold_at_most_a_few_threads() -> None:
    api = _Api(delay=0.5)
    with ThreadPoolExecutor(40) as pool:
        t0 = time.monotonic()
        got = list(pool.map(lambda i: (api.review(f"made-up-{i}"), time.monotonic() - t0), range(40)))
    assert all(cred is None for cred, _ in got)
    assert api.max_in <= identity.REVIEWS_IN_FLIGHT
    assert api.reviews <= identity.REVIEWS_IN_FLIGHT * 2 and api.shed >= 40 - api.reviews
    fast = [t for _, t in got if t < 0.4]
    assert len(fast) >= 40 - api.reviews  # the shed ones were refused at once, not after the round trip


def test_a_refused_token_is_asked_about_once_and_the_rate_is_bounded() -> None:
    api = _Api()
    for _ in range(30):
        assert api.review("made-up-again") is None
    assert api.reviews == 1 and api.shed == 29
    many = _Api()
    for i in range(int(identity.REVIEW_BURST) + 100):
        many.review(f"fresh-{i}")
    assert many.reviews <= identity.REVIEW_BURST + 10  # the burst, plus what refilled meanwhile (20/s)
    assert many.shed >= 80


def test_a_real_worker_token_is_still_reviewed_and_cached() -> None:
    api = _Api()
    for i in range(10):
        api.review(f"made-up-{i}")
    cred = api.review(GOOD)
    assert cred is not None and cred.node == "node-1" and "worker" in cred.roles
    for _ in range(5):
        assert api.review(GOOD) == cred
    assert api.reviews == 11  # cached after its one review


class _Clock:
    """identity's `time`, moved by the test (deterministic cache and bucket times)."""

    def __init__(self) -> None:
        self.t = 1_000_000.0

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t


class _Flaky(_Api):
    """_Api with a 60 s cache and an API server that can be made to fail or to refuse GOOD."""

    def __init__(self) -> None:
        super().__init__()
        self.down = self.revoked = False

    def _ask(self, token: str) -> Any:
        if self.down:
            self.reviews += 1
            raise ConnectionError("API server unreachable")
        return super()._ask("revoked" if self.revoked else token)


def test_known_tokens_are_renewed_on_their_own_budget_and_the_cached_review_stands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached review is renewed after 2/3 of its time; when the renewal cannot be made the cached one
    answers until it expires (then refused); a renewal the API server refuses drops it at once. Strangers
    who emptied the review budget do not stop a known token's re-review."""
    clock = _Clock()
    monkeypatch.setattr(identity, "time", clock)
    api = _Flaky()
    assert api.review(GOOD) is not None and api.reviews == 1
    made_up = iter(range(1 << 30))

    def drain() -> None:  # strangers empty the shared budget (what a flood does all the time)
        shed = api.shed
        for _ in range(int(identity.REVIEW_BURST) + 50):
            api.review(f"made-up-{next(made_up)}")
        assert api.shed - shed >= 50 and api.review(f"made-up-{next(made_up)}") is None

    clock.t += 30
    before = api.reviews
    assert api.review(GOOD) is not None and api.reviews == before  # within 2/3 of 60 s: the cache answers
    clock.t += 15  # 45 s: due for renewal, made on the known tokens' budget
    drain()
    before = api.reviews
    assert api.review(GOOD) is not None and api.reviews == before + 1 and api.renewed == 1
    clock.t += 45  # 45 s after the renewal
    api.down = True  # the renewal fails: the cached review (60 s from the renewal) still answers
    assert api.review(GOOD) is not None
    clock.t += 20  # past its expiry: a re-review is needed and cannot be made
    assert api.review(GOOD) is None
    api.down = False
    drain()
    assert api.review(GOOD) is not None  # known: re-reviewed although strangers keep the budget empty
    clock.t += 45
    api.revoked = True  # the API server no longer accepts it: refused at the renewal, not at expiry
    assert api.review(GOOD) is None
    api.revoked = False
    assert api.review(GOOD) is None  # and remembered as refused for a while
