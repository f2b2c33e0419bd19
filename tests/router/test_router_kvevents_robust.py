"""A malformed KV event must not blind the router to a replica: real ZMQ PUB -> the router's subscriber."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq

from router.app import Router, RouterConfig
from router.index import KVIndex, block_keys
from router.kvevents import DROPPED, KVEventSubscriber

TOK = list(range(200, 264))  # 4 blocks of 16


def stored(hashes: list[int], parent: int | None, tokens: list[int] | None) -> dict:
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "block_size": 16,
          "lora_id": None, "medium": "GPU", "lora_name": None}
    if tokens is not None:
        ev["token_ids"] = tokens
    return ev


class Publisher:
    """vLLM's ZmqEventPublisher wire format on a real PUB socket: (topic, seq BE, msgpack batch)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a test's burst is never dropped on our side
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send(self, events: list[dict]) -> None:
        payload = msgpack.packb({"ts": time.time(), "events": events, "data_parallel_rank": 0})
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big", signed=True), payload))
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def until(cond, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_malformed_event_is_counted_and_later_events_are_indexed() -> None:
    async def main() -> None:
        pub = Publisher()
        router = Router(RouterConfig(replicas=["http://127.0.0.1:9"]))  # for its metrics and change hook
        idx = KVIndex()
        sub = KVEventSubscriber("r1", pub.endpoint, idx, on_change=router._kv_change)
        sub.start()
        try:
            await asyncio.wait_for(sub.ready.wait(), 10)
            keys = block_keys(TOK, 16)
            # PUB drops until the subscription lands: resend the malformed batch until the subscriber sees it
            deadline = time.monotonic() + 20
            while sub.stats.events.get(DROPPED, 0) == 0:
                assert time.monotonic() < deadline, "malformed event never counted (subscriber dead?)"
                pub.seq = 0  # seq 0 again reads as a publisher restart: purge + apply, never "already seen"
                pub.send([stored([1], None, None)])  # BlockStored without token_ids: KeyError in the index
                await asyncio.sleep(0.05)
            # the same batch's good events and every later batch are still applied
            pub.send([stored([999], None, None), stored([11, 12], None, TOK[:32])])
            pub.send([stored([13, 14], 12, TOK[32:])])
            await until(lambda: idx.match(keys).get("r1", (0, 0))[0] == 4, "valid events indexed")
            assert sub.stats.restarts == 0 and sub._task is not None and not sub._task.done()
            assert sub.stats.events[DROPPED] >= 2
            dropped = router.m.registry.get_sample_value("kvtier_router_kv_events_dropped_total", {"replica": "r1"})
            assert dropped == sub.stats.events[DROPPED]
        finally:
            await sub.stop()
            pub.close()

    asyncio.run(main())


def test_subscriber_that_dies_is_restarted_with_backoff() -> None:
    async def main() -> None:
        pub = Publisher()
        idx = KVIndex()
        boom = {"left": 1}

        def on_change(replica: str, what: str, n: int) -> None:
            if what == "BlockStored" and boom["left"]:
                boom["left"] -= 1
                raise RuntimeError("injected fault in the change hook")  # kills the subscriber loop

        sub = KVEventSubscriber("r1", pub.endpoint, idx, on_change=on_change, backoff=0.05)
        sub.start()
        try:
            keys = block_keys(TOK, 16)
            await until(lambda: sub.ready.is_set(), "subscriber ready")
            deadline = time.monotonic() + 20
            while sub.stats.restarts == 0:  # until the injected fault has killed the loop once
                assert time.monotonic() < deadline, "the injected fault never restarted the subscriber"
                pub.seq = 0
                pub.send([stored([11, 12], None, TOK[:32])])
                await asyncio.sleep(0.05)
            # restarted (and purged: what it knew may be incomplete); new events are indexed again
            deadline = time.monotonic() + 20
            while idx.match(keys).get("r1", (0, 0))[0] != 4:
                assert time.monotonic() < deadline, "restarted subscriber never indexed new events"
                pub.seq = 0
                pub.send([stored([11, 12], None, TOK[:32]), stored([13, 14], 12, TOK[32:])])
                await asyncio.sleep(0.05)
            assert sub.stats.restarts == 1 and sub.stats.purges >= 1 and not sub._task.done()
        finally:
            await sub.stop()
            pub.close()

    asyncio.run(main())


@pytest.mark.unit
def test_apply_events_skips_only_the_malformed_event() -> None:
    from router.kvevents import apply_events

    idx = KVIndex()
    counts = apply_events(idx, "r", [stored([1], None, None), {"type": "BlockRemoved"},
                                     stored([11, 12, 13, 14], None, TOK)])
    assert counts == {DROPPED: 2, "BlockStored": 1}
    assert idx.match(block_keys(TOK, 16))["r"][0] == 4


def test_a_backlog_of_events_shares_the_event_loop() -> None:
    """A backlog of queued batches is folded in slices, with the event loop's other work (requests) between them:
    zmq.asyncio returns a queued message without yielding, and a backlog used to block the loop for 45-115 ms."""
    async def main() -> None:
        pub = Publisher()
        idx = KVIndex()
        sub = KVEventSubscriber("r1", pub.endpoint, idx)
        sub.start()
        try:
            await asyncio.wait_for(sub.ready.wait(), 10)
            while sub.stats.batches == 0:  # the subscription has landed once one batch comes through
                pub.send([stored([1], None, TOK[:16])])
                await asyncio.sleep(0.05)
            b0, n = sub.stats.batches, 3000
            assert sub.stats.last_seq == pub.seq - 1
            for i in range(n):
                pub.send([stored([100 + i], 1, TOK[16:32])])
            time.sleep(0.5)  # loop blocked: ZMQ's I/O thread queues the whole burst before the subscriber runs
            seen: list[int] = []

            async def other_work() -> None:  # what a request handler gets of the loop meanwhile
                while sub.stats.batches < b0 + n:
                    seen.append(sub.stats.batches)
                    await asyncio.sleep(0)

            await asyncio.wait_for(other_work(), 30)
            assert sub.stats.batches == b0 + n and sub.stats.restarts == 0
            assert any(b0 < b < b0 + n for b in seen), f"no turn while {n} batches were folded: {sorted(set(seen))}"
        finally:
            await sub.stop()
            pub.close()

    asyncio.run(main())
