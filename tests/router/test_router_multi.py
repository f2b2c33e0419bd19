"""Several router processes with one view: no shared state, yet the same replica for the same prefix."""

from __future__ import annotations

from router_helpers import complete


def test_two_routers_with_prefix_affinity_agree_on_new_prefixes(cluster):
    reps = [cluster.replica(kv=False) for _ in range(4)]
    # No load scraping here: a scrape by b that lands while a's request runs on the home makes that home look
    # loaded to b, and affinity yields to load by design (a CI run saw exactly that for doc 7). The property
    # tested is agreement from the same view; yielding to load is tested in test_router_unit.
    flags = ("--strategy", "prefixaware", "--prefix-affinity", "--load-scrape-interval", "0")
    a = cluster.router(reps, *flags)
    b = cluster.router(reps, *flags)
    homes = set()
    for doc in range(8):  # without affinity both would pick independently: all 8 agree by chance 1 in 4^8
        prompt = f"doc {doc} shared system prompt, long enough for several blocks " * 2
        ra = complete(a, prompt + "question from a user of router a")
        rb = complete(b, prompt + "another question, sent to router b")
        assert ra.status_code == rb.status_code == 200
        assert ra.headers["x-kvtier-replica"] == rb.headers["x-kvtier-replica"], doc
        assert ra.headers["x-kvtier-route"] == rb.headers["x-kvtier-route"] == "affinity"
        # b never saw the prefix, yet it lands where a sent it: the engine reports the shared prefix cached
        assert rb.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 16
        homes.add(ra.headers["x-kvtier-replica"])
        # the next request on a, which now holds the prefix in its tree, is a cache hit on the same replica
        again = complete(a, prompt + "a follow-up")
        assert again.headers["x-kvtier-route"] == "cache_hit"
        assert again.headers["x-kvtier-replica"] == ra.headers["x-kvtier-replica"]
    assert len(homes) > 1  # homes are spread by the hash, not one replica for everything
