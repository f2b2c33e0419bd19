"""Several router processes see one load: each derives the others' requests from the replicas' own metrics."""

from __future__ import annotations

import httpx
from router_helpers import complete, metric, wait_until


def _external(router, replica: str) -> float:
    return metric(router, "kvtier_router_replica_external_requests", replica=replica)


def test_load_sent_through_one_router_steers_the_other(cluster):
    reps = [cluster.replica("--decode-ms-per-token", "50", kv=False) for _ in range(4)]
    # a: a huge load cap, so its streams pile onto the replica holding their prefix (x)
    a = cluster.router(reps, "--strategy", "prefixaware", "--load-epsilon", "100", "--load-scrape-interval", "0.2")
    b = cluster.router(reps, "--strategy", "prefixaware", "--load-scrape-interval", "0.2")
    prompt = "one long shared document that router a keeps sending, many blocks of it " * 3
    client = httpx.Client(timeout=30)
    streams, bodies, held, routes = [], [], set(), []
    try:
        for i in range(6):  # streaming: past the first byte they count as decode, x stays a's cheapest
            cm = client.stream("POST", a.url + "/v1/completions", json={
                "model": "test-model", "prompt": prompt + str(i), "max_tokens": 400, "stream": True})
            resp = cm.__enter__()
            streams.append(cm)
            assert resp.status_code == 200
            # wait for the first token: until it comes the request is in-flight prefill on x, which costs as
            # much as the hit saves, and the next one would go elsewhere (least_cost) on a loaded box
            body = resp.iter_raw()
            assert next(body, b"")
            bodies.append(body)  # held: a dropped iterator closes the stream
            held.add(resp.headers["x-kvtier-replica"])
            routes.append((resp.headers["x-kvtier-replica"], resp.headers.get("x-kvtier-route")))
        assert len(held) == 1, routes
        x = held.pop()
        # b never routed any of them, yet reads them off x's vllm:num_requests_running
        wait_until(lambda: _external(b, x) >= 6, timeout=15)
        assert _external(a, x) == 0  # a subtracts its own requests: none of x's load is someone else's
        others = {r.url for r in reps} - {x}
        for d in range(12):  # new prefixes, all costs equal but load: by chance none on x only (3/4)^12 = 3 %
            r = complete(b, f"fresh prompt {d} for router b that nobody has sent before", max_tokens=1)
            assert r.status_code == 200
            assert r.headers["x-kvtier-replica"] in others, (d, r.headers["x-kvtier-route"])
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)  # closing the client side aborts the request at the replica
        client.close()
    wait_until(lambda: _external(b, x) == 0, timeout=15)  # the load is gone from b's view once it ends
