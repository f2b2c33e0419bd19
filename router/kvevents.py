"""vLLM KV-event ingestion: one ZMQ SUB per replica, both wire encodings, seq-gap replay or purge.

Wire (vllm/distributed/kv_events.py, ZmqEventPublisher): PUB multipart (topic, seq 8-byte BE, msgpack
payload). The batch is `[ts, events, dp_rank]` (array) or `{"ts":..,"events":..}` (map); each event is
`["BlockStored", field...]` (older array_like releases) or `{"type": "BlockStored", ...}` (newer). Replay:
DEALER sends (b"", start_seq BE) to the ROUTER replay socket and receives (b"", topic, seq, payload)
frames, ending with seq == -1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from router.index import KVIndex

log = logging.getLogger("kvtier.router.kvevents")

# Positional field order of the array_like events (vLLM BlockStored / BlockRemoved class bodies).
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                 "locality", "ownership", "session_id")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}
END_SEQ = -1


class DecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def decode_event(ev: Any) -> dict[str, Any]:
    """One event (array- or map-encoded) -> {"type": ..., field: value}."""
    if isinstance(ev, dict):
        kind = ev.get("type")
        if kind not in FIELDS:
            raise DecodeError(f"unknown event type {kind!r}")
        return ev
    if isinstance(ev, (list, tuple)) and ev and ev[0] in FIELDS:
        names = FIELDS[ev[0]]
        out: dict[str, Any] = {"type": ev[0]}
        out.update(zip(names, ev[1:], strict=False))
        return out
    raise DecodeError(f"not a KV event: {ev!r:.80}")


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A msgpack KVEventBatch -> (ts, events, data_parallel_rank)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:
        raise DecodeError(f"bad msgpack: {e}") from e
    if isinstance(obj, dict):
        ts, events, dp = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        dp = obj[2] if len(obj) > 2 else None
    else:
        raise DecodeError("batch is neither an array nor a map")
    if not isinstance(events, list):
        raise DecodeError("batch.events is not a list")
    return float(ts or 0.0), [decode_event(e) for e in events], dp


# The longest one subscriber works between two turns of the event loop. zmq.asyncio hands over a queued message
# without yielding, so a backlog (a catch-up replay, a burst at 400 req/s) was folded in one go: 45-115 ms of
# blocked loop, every request in flight waiting (docs/results/2026-12-04-router-gc.md).
LOOP_SLICE_S = 0.002

DROPPED = "dropped"  # count key of events that were skipped as malformed
# What a well-typed-but-malformed event raises in the index (missing field, wrong type or shape).
MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError)


def _apply_one(index: KVIndex, replica: str, ev: dict[str, Any]) -> None:
    kind = ev["type"]
    if kind == "BlockStored":
        spec = ev.get("kv_cache_spec_kind")
        if spec not in (None, "full_attention") or ev.get("kv_cache_spec_sliding_window"):
            return  # sliding-window / mamba groups do not make a reusable prefix
        index.stored(replica, ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"],
                     int(ev["block_size"]), ev.get("medium"), ev.get("lora_name"), ev.get("extra_keys"))
    elif kind == "BlockRemoved":
        index.removed(replica, ev["block_hashes"], ev.get("medium"))
    else:
        index.clear(replica)


def apply_events(index: KVIndex, replica: str, events: list[dict[str, Any]]) -> dict[str, int]:
    """Fold decoded events into the index; returns counts per event type (and DROPPED).

    One malformed event (e.g. BlockStored without token_ids) is skipped and counted: the rest of the batch
    and of the stream is still good, and dropping the subscriber for it would blind kvaware to the replica.
    """
    counts: dict[str, int] = {}
    for ev in events:
        try:
            _apply_one(index, replica, ev)
        except MALFORMED as e:
            counts[DROPPED] = counts.get(DROPPED, 0) + 1
            log.warning("replica %s: dropped malformed KV event %.120r: %r", replica, ev, e)
            continue
        counts[ev["type"]] = counts.get(ev["type"], 0) + 1
    return counts


@dataclass
class SubscriberStats:
    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    gaps: int = 0
    replays: int = 0
    purges: int = 0
    decode_errors: int = 0
    restarts: int = 0  # times the subscriber loop died and was restarted
    last_seq: int | None = None
    lag_s: list[float] = field(default_factory=list)  # recent event-to-index lags (ts -> applied)


class KVEventSubscriber:
    """Keeps `index` in sync with one replica's KV events (one asyncio task)."""

    def __init__(self, replica: str, endpoint: str, index: KVIndex, *, replay_endpoint: str | None = None,
                 topic: str = "", on_change: Callable[[str, str, int], None] | None = None,
                 replay_timeout: float = 2.0, backoff: float = 0.2, max_backoff: float = 10.0) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.index = index
        self.stats = SubscriberStats()
        self._on_change = on_change or (lambda replica, what, n: None)
        self._replay_timeout = replay_timeout
        self._backoff, self._max_backoff = backoff, max_backoff
        self._ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # set once connected and caught up
        self._slice_t0 = time.perf_counter()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name=f"kvevents:{self.replica}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def purge(self, why: str) -> None:
        self.index.clear(self.replica)
        self.stats.purges += 1
        self._on_change(self.replica, f"purge:{why}", 1)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            ts, events, _dp = decode_batch(payload)
        except DecodeError as e:
            self.stats.decode_errors += 1
            self._on_change(self.replica, "decode_error", 1)
            log.warning("replica %s: undecodable KV event batch seq=%s: %s; purging", self.replica, seq, e)
            self.purge("decode_error")  # we no longer know what the replica holds
            self.stats.last_seq = seq
            return
        for kind, n in apply_events(self.index, self.replica, events).items():
            self.stats.events[kind] = self.stats.events.get(kind, 0) + n
            self._on_change(self.replica, kind, n)
        self.stats.batches += 1
        self.stats.last_seq = seq
        if ts:
            lag = time.time() - ts
            self.stats.lag_s.append(lag)
            del self.stats.lag_s[:-1000]

    async def _share_loop(self) -> None:
        """Give the event loop a turn once this subscriber has worked LOOP_SLICE_S since its last one."""
        now = time.perf_counter()
        if now - self._slice_t0 >= LOOP_SLICE_S:
            await asyncio.sleep(0)
            self._slice_t0 = time.perf_counter()

    async def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches from `start` on, via the replay socket; None if it does not answer."""
        if not self.replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await sock.poll(self._replay_timeout * 1000):
                    return None
                frames = await sock.recv_multipart()
                if len(frames) < 4:
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append((seq, frames[3]))
        finally:
            sock.close(linger=0)

    async def _replay(self, start: int, upto: int) -> bool:
        """Fill the gap [start, upto); False if those batches are no longer buffered (caller purges)."""
        got = await self._fetch(start)
        if not got or got[0][0] != start:
            return False  # the publisher's buffer rolled over: the missing batches are gone
        for seq, payload in got:
            if seq >= upto:
                break
            if self.stats.last_seq is not None and seq == self.stats.last_seq + 1:
                self._apply(seq, payload)
                await self._share_loop()
        return self.stats.last_seq == upto - 1

    async def _catch_up(self) -> None:
        """On (re)connect: apply whatever the publisher still buffers, so a late-starting router is warm."""
        got = await self._fetch(0)
        if got:
            for seq, payload in got:
                if self.stats.last_seq is None or seq == self.stats.last_seq + 1:
                    self._apply(seq, payload)
                    await self._share_loop()
            self.stats.replays += 1
            self._on_change(self.replica, "replay", 1)

    async def _supervise(self) -> None:
        """Run the subscriber loop forever: if it dies, purge (we lost track), back off and reconnect."""
        delay = self._backoff
        while True:
            started = time.monotonic()
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:  # any bug or socket fault (logged with its traceback): restart, never stay blind
                log.exception("replica %s: KV event subscriber died; restarting in %.1fs", self.replica, delay)
            self.purge("subscriber_error")
            self.stats.restarts += 1
            self.stats.last_seq = None
            self._on_change(self.replica, "restart", 1)
            if time.monotonic() - started > 60:
                delay = self._backoff  # it ran fine for a while: this is a new fault, not a crash loop
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_backoff)

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await asyncio.sleep(0.2)  # let the subscription reach the publisher (PUB drops until then)
            with contextlib.suppress(Exception):
                await self._catch_up()
            self.ready.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.stats.decode_errors += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                last = self.stats.last_seq
                if last is not None and seq == 0:
                    # publisher restarted (its seq starts at 0 again): the replica's cache is new too
                    self.purge("restart")
                    self.stats.last_seq = None
                elif last is not None and seq <= last:
                    continue  # already applied through a replay
                elif last is not None and seq > last + 1:
                    self.stats.gaps += 1
                    self._on_change(self.replica, "gap", 1)
                    if await self._replay(last + 1, seq):
                        self.stats.replays += 1
                        self._on_change(self.replica, "replay", 1)
                    else:
                        self.purge("gap")
                self._apply(seq, frames[2])
                await self._share_loop()
        finally:
            self.ready.set()
            sub.close(linger=0)
