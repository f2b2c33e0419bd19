"""K8sIdentity admission (issue 13, authenticate before spending): reviews of tokens no cache knows are bounded
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
