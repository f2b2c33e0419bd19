"""The router's HTTP side: an OpenAI-compatible proxy in front of the replica set.

Streaming bodies are passed through chunk by chunk (no buffering); non-streaming answers arrive from
vLLM in one piece anyway, so we read them whole, which lets us reject garbage and read the engine's
cached-token count. A client that goes away cancels the upstream request in both cases: while we wait
for upstream headers we race the send against the client's disconnect, afterwards closing our stream
closes the upstream connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect

from kvtier.contract import KEY_STATES
from router.accounting import CacheAccounting, TierCostCalibrator
from router.admission import AdmissionConfig, Gate, Ticket
from router.gcpause import GCPauses, freeze_startup_heap
from router.kvevents import DROPPED, KVEventSubscriber
from router.metrics import Metrics
from router.policy import STRATEGIES, Decision, Plan, Policy, UnknownStrategy
from router.replicas import Replica, ReplicaSet
from router.tokens import INLINE_BYTES, RemoteTokenizeFailed, TokenizeError, Tokenizer

log = logging.getLogger("kvtier.router")

HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length", "authorization", "date", "server"}
STRATEGY_HEADER = "x-kvtier-strategy"
TIER_COST = {"L1": 0.2, "L2": 0.5}  # defaults: the CPU medium weight 0.8 and the L2 credit 0.5 of before


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)
    strategy: str = "prefixaware"
    tokenizer: str = "bytes"
    block_size: int = 16
    api_key: str | None = None
    upstream_api_key: str | None = None
    max_body_bytes: int = 8 << 20
    health_interval: float = 2.0
    health_timeout: float = 1.0
    load_scrape_interval: float = 1.0  # read each replica's vLLM load gauges this often (0: off); replicas.py
    connect_timeout: float = 2.0
    upstream_timeout: float = 600.0  # max wait for the first byte / between bytes
    retries: int = 2
    load_epsilon: float = 0.25
    prefix_affinity: bool = False  # several router processes: unseen prefixes go to a hash-chosen home
    decode_beta: float = 0.1
    request_cost: float = 0.0  # Policy.request_cost
    # per-token cost of a cached token, relative to recomputing it (1.0): L0 (the replica's GPU cache) is free;
    # L1 = blocks its KV events place on CPU, L2 = chunks only in l2fs (any replica can load them)
    tier_cost: dict[str, float] = field(default_factory=lambda: dict(TIER_COST))
    calibrate_l2: bool = False  # fit the L2 cost from measured prefill times (TierCostCalibrator); tier_cost starts it
    session_header: str = "x-session-id"
    kv_endpoints: list[str | None] = field(default_factory=list)  # aligned with replicas
    kv_replay_endpoints: list[str | None] = field(default_factory=list)
    # (tokens, model, kv prefix or None for the default) -> L2 hit tokens
    l2_lookup: Callable[[list[int], str, str | None, tuple[str, int] | None], Awaitable[int]] | None = None
    l2_timeout: float = 0.05  # an L2 lookup slower than this counts as a miss
    l2_min_tokens: int = 0  # prompts shorter than this get no L2 lookup (kvaware routes them by L0/L1 and load)
    # "needed": look up L2 only when some answer could change kvaware's pick (Plan.l2_can_change); "always":
    # every request (complete L2 accounting and headers, one master RPC per request). --tier-cost L2=auto looks always.
    l2_lookup_when: str = "needed"
    tokenize_timeout: float = 2.0  # a replica /tokenize slower than this: route this request by bytes
    tokenize_inline_bytes: int = INLINE_BYTES  # bodies up to this size are tokenized on the event loop (tokens.py)
    discovery: Any = None  # object with async start(replicas) / stop()
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # --workers N: this process is worker `worker_id`; every worker writes `<id>.port` (its private loopback
    # listener) into peers_dir, so /metrics can merge all workers' series (one scrape target, any worker)
    peers_dir: str | None = None
    worker_id: int = 0
    peers_tls: bool = False
    freeze_heap: bool = False  # freeze the start-up heap once serving (router.gcpause; `kvtier router` sets it)


def _err(status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers or None)


class _Admission:
    """The router's load accounting for one request on one replica; every release happens exactly once."""

    def __init__(self, r: Replica, d: Decision, n_tokens: int, m: Metrics) -> None:
        self.r, self.uncached, self.n, self.m = r, d.uncached, n_tokens, m
        self.state = 0
        self.t0 = time.perf_counter()
        self.first_s: float | None = None  # send -> first byte (for a stream: the prefill), tier calibration
        r.inflight += 1
        r.prefill_tokens += self.uncached
        self._gauges()

    def _gauges(self) -> None:
        inflight, prefill = self.m.replica_load(self.r.url)
        inflight.set(self.r.inflight)
        prefill.set(self.r.prefill_tokens)

    def first_byte(self) -> None:
        if self.state == 0:
            self.state = 1
            self.first_s = time.perf_counter() - self.t0
            self.r.prefill_tokens -= self.uncached
            self.r.decode_tokens += self.n
            self._gauges()

    def finish(self) -> None:
        if self.state == 2:
            return
        if self.state == 0:
            self.r.prefill_tokens -= self.uncached
        else:
            self.r.decode_tokens -= self.n
        self.state = 2
        self.r.inflight -= 1
        self.r.served += 1
        self._gauges()


class _Clock:
    """The router's own time for one request: since the body was read, minus tokenization and minus every
    wait on a replica (from handing the request to aiohttp until its answer is in: headers, and the whole
    body when not streaming). Sent back as X-Kvtier-Router-Ms (and X-Kvtier-Tokenize-Ms)."""

    __slots__ = ("t_in", "tok", "upstream")

    def __init__(self, t_in: float) -> None:
        self.t_in, self.tok, self.upstream = t_in, 0.0, 0.0

    def own_ms(self) -> float:
        return (time.perf_counter() - self.t_in - self.tok - self.upstream) * 1e3


@dataclass
class _Call:
    """One proxied request as parsed and validated, plus what routing adds (tokens, L2 hit)."""

    rid: str
    path: str
    kind: str
    body: bytes
    payload: dict[str, Any]
    model: str
    strategy: str
    stream: bool
    session: str | None
    salt: str | None
    headers: dict[str, str]
    clock: _Clock
    tokens: list[int] = field(default_factory=list)
    l2: dict[str | None, int] = field(default_factory=dict)  # L2 hit per kv-prefix (None: --l2fs-prefix)
    l2_due: bool = False  # kvaware with an L2 lookup configured and a prompt long enough: not yet looked up


@dataclass
class Picked:
    """Router.pick's result: a decision (with the slot and in-flight count it holds), or an answer to send."""

    rid: str
    answer: Response | None = None
    call: _Call | None = None
    decision: Decision | None = None
    adm: _Admission | None = None
    ticket: Ticket | None = None


@dataclass
class _Retry:
    """An attempt that failed before anything reached the client: try another replica, else answer this."""

    error: JSONResponse


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        Policy.check_strategy(cfg.strategy)
        if cfg.kv_endpoints and len(cfg.kv_endpoints) != len(cfg.replicas):
            raise ValueError("--kv-events needs one endpoint per replica (same order as --replicas)")
        self.cfg = cfg
        self.pid = str(os.getpid())  # X-Kvtier-Router-Pid: which of several router processes answered
        self.m = Metrics()
        self.acct = CacheAccounting(self.m.registry)
        cost = {**TIER_COST, **cfg.tier_cost}
        if not all(0.0 <= v <= 1.0 for v in cost.values()) or set(cost) != set(TIER_COST):
            raise ValueError(f"tier costs are L1/L2 in [0, 1], got {cfg.tier_cost}")
        if min(cfg.decode_beta, cfg.request_cost, cfg.load_epsilon) < 0:
            raise ValueError("--decode-beta, --request-cost and --load-epsilon are >= 0")
        if cfg.l2_lookup_when not in ("needed", "always"):
            raise ValueError(f"L2 lookups are 'needed' or 'always', got {cfg.l2_lookup_when!r}")
        self.policy = Policy(block_size=cfg.block_size, load_epsilon=cfg.load_epsilon, decode_beta=cfg.decode_beta,
                             request_cost=cfg.request_cost, affinity=cfg.prefix_affinity, l2_credit=1.0 - cost["L2"])
        # the event index weighs a block by its medium when it is stored (set before any event arrives)
        self.policy.kv.medium_weight["CPU"] = self.policy.kv.medium_weight["cpu"] = 1.0 - cost["L1"]
        for tier, v in (("L0", 0.0), *cost.items()):
            self.m.tier_cost.labels(tier).set(v)
        self.calibrator = TierCostCalibrator() if cfg.calibrate_l2 else None
        self.tok = Tokenizer(cfg.tokenizer, fallback_replica=True, inline_bytes=cfg.tokenize_inline_bytes)
        self.tok.remote = self._remote_tokenize
        self._tok_next = 0  # round-robin over the replicas for /tokenize
        self._tok_headers = {"authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}
        self.replicas = ReplicaSet(health_interval=cfg.health_interval, health_timeout=cfg.health_timeout,
                                   api_key=cfg.upstream_api_key, scrape_interval=cfg.load_scrape_interval)
        self.subs: dict[str, KVEventSubscriber] = {}
        self.client: aiohttp.ClientSession | None = None
        self.replicas.on_added.append(self._added)
        self.replicas.on_removed.append(self._removed)
        self.replicas.on_down.append(self._down)
        self.gate = Gate(cfg.admission, lambda: len(self.replicas.available()))
        self.m.queue_depth.set_function(lambda: self.gate.queued)
        self.m.queue_depth_max.set_function(lambda: self.gate.queue_max_seen)
        self.m.admitted.set_function(lambda: self.gate.active)
        self.gc_pauses = GCPauses()  # kvtier_router_gc_pause_seconds
        self.m.registry.register(self.gc_pauses)

    # -- membership -------------------------------------------------------------------------------
    def _kv_change(self, replica: str, what: str, n: int) -> None:
        if what == DROPPED:
            self.m.kv_dropped.labels(replica).inc(n)
        else:
            self.m.kv_events.labels(replica, what).inc(n)

    def _added(self, r: Replica) -> None:
        self.m.healthy.labels(r.url).set(1)
        if r.kv_endpoint:
            self.policy.kv.add(r.url)
            sub = KVEventSubscriber(r.url, r.kv_endpoint, self.policy.kv, replay_endpoint=r.kv_replay_endpoint,
                                    on_change=self._kv_change)
            self.subs[r.url] = sub
            with contextlib.suppress(RuntimeError):  # no loop yet: started in lifespan
                sub.start()

    def _removed(self, r: Replica) -> None:
        self.policy.forget(r.url)
        self.m.healthy.labels(r.url).set(0)
        sub = self.subs.pop(r.url, None)
        if sub is not None:
            asyncio.get_running_loop().create_task(sub.stop())

    def _down(self, r: Replica) -> None:
        # A replica that failed may come back empty (restart): drop our beliefs about its cache.
        self.policy.forget(r.url)
        self.m.healthy.labels(r.url).set(0)

    async def start(self) -> None:
        self.gc_pauses.start()
        # One pooled session for every upstream call (created here, inside the running loop). connect covers
        # the wait for a pool slot too; sock_read bounds the wait for the first byte and between bytes. No
        # Content-Type of our own: the client's passes through, or none (as sent). trust_env: proxy env vars
        # apply as they did with httpx, but only when one is set: with trust_env aiohttp reads the environment
        # and parses ~/.netrc on every request (a thread hop each; ~10 % of the router's CPU in a profile at
        # 200 req/s). Idle connections are dropped after 4 s, before uvicorn's (vLLM's) 5 s keep-alive closes
        # them under us.
        conn = aiohttp.TCPConnector(limit=1000, limit_per_host=0, keepalive_timeout=4.0)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout,
                                        sock_connect=self.cfg.connect_timeout, sock_read=self.cfg.upstream_timeout)
        self.client = aiohttp.ClientSession(connector=conn, timeout=timeout, skip_auto_headers=("Content-Type",),
                                            trust_env=_proxy_env())
        for i, url in enumerate(self.cfg.replicas):
            kv = self.cfg.kv_endpoints[i] if self.cfg.kv_endpoints else None
            rp = self.cfg.kv_replay_endpoints[i] if i < len(self.cfg.kv_replay_endpoints) else None
            self.replicas.add(url, kv_endpoint=kv or None, kv_replay_endpoint=rp or None)
        for sub in self.subs.values():
            if sub._task is None:
                sub.start()
        if self.subs:  # serve only once the event streams are connected and caught up (bounded wait)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in self.subs.values())), 3.0)
        warm = getattr(self.cfg.l2_lookup, "warm", None)
        if warm is not None:
            await warm()
        self.replicas.start()
        if self.cfg.discovery is not None:
            await self.cfg.discovery.start(self.replicas)

    async def stop(self) -> None:
        if self.cfg.discovery is not None:
            await self.cfg.discovery.stop()
        for sub in list(self.subs.values()):
            await sub.stop()
        await self.replicas.stop()
        if self.client:
            await self.client.close()
        self.tok.close()
        self.gc_pauses.stop()

    # -- proxy ------------------------------------------------------------------------------------
    def _upstream_headers(self, headers: Mapping[str, str], rid: str) -> dict[str, str]:
        h = {k: v for k, v in headers.items() if k.lower() not in HOP and not k.lower().startswith("x-kvtier")}
        h["x-request-id"] = rid
        if self.cfg.upstream_api_key:
            h["authorization"] = f"Bearer {self.cfg.upstream_api_key}"
        return h

    def _down_headers(self, resp: aiohttp.ClientResponse, rid: str, r: Replica, d: Decision, decoded: bool,
                      clock: _Clock) -> dict[str, str]:
        h = {k.lower(): v for k, v in resp.headers.items() if k.lower() not in HOP}
        if decoded:
            h.pop("content-encoding", None)
        h["x-request-id"] = rid
        h["x-kvtier-replica"] = r.url
        h["x-kvtier-route"] = d.reason
        h["x-kvtier-router-pid"] = self.pid
        h["x-kvtier-data-path"] = "python"  # haproxy's fast path says "haproxy" (router.haproxy)
        if d.l2_tokens:
            h["x-kvtier-l2-tokens"] = str(d.l2_tokens)
        h["x-kvtier-router-ms"] = f"{clock.own_ms():.3f}"
        h["x-kvtier-tokenize-ms"] = f"{clock.tok * 1e3:.3f}"
        return h

    async def _read_body(self, request: Request) -> bytes | JSONResponse:
        limit = self.cfg.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                if int(cl) > limit:
                    return self._too_large()
            except ValueError:
                return _err(400, "invalid Content-Length")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                return self._too_large()
        return bytes(buf)

    def _too_large(self) -> JSONResponse:
        self.m.rejected.labels("too_large").inc()
        return _err(413, f"request body exceeds {self.cfg.max_body_bytes} bytes")

    def _auth(self, headers: Mapping[str, str]) -> JSONResponse | None:
        if not self.cfg.api_key:
            return None
        got = headers.get("authorization") or ""
        if not hmac.compare_digest(got.encode(), f"Bearer {self.cfg.api_key}".encode()):
            self.m.rejected.labels("unauthorized").inc()
            return _err(401, "missing or invalid API key", "authentication_error")
        return None

    async def proxy(self, request: Request, path: str, kind: str) -> Response:
        """auth -> admission (before the body is read) -> parse/validate -> route inputs (tokens, L2) -> forward
        with retry -> finish (plain or stream). The gate comes before the body read and the JSON parse, so an
        overloaded router answers its 429 without doing any per-request work first."""
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if (denied := self._auth(request.headers)) is not None:
            return denied
        t_gate = time.perf_counter()
        ticket = await self._admit(rid, request.headers.get(STRATEGY_HEADER) or self.cfg.strategy)
        if isinstance(ticket, Response):
            return ticket
        waited = time.perf_counter() - t_gate
        try:
            call = await self._parse(request, path, kind, rid)
            if isinstance(call, Response):
                ticket.release()
                return call
            call.clock.t_in -= waited  # the router's own time includes the wait at the gate, as before
            resp = await self._route_inputs(call) or await self._forward(request, call)
        except BaseException:
            ticket.release()
            raise
        if isinstance(resp, StreamingResponse):  # the slot is held until the stream has been sent
            return _Held(resp, ticket)
        ticket.release()
        return resp

    def _reject(self, rid: str, strategy: str, status: int, reason: str, message: str) -> JSONResponse:
        """A fast 429/503 with Retry-After: no body read (at the gate), no tokenization, no upstream call."""
        self.m.rejected.labels(reason).inc()
        self.m.requests.labels("none", strategy if strategy in STRATEGIES else "invalid", str(status)).inc()
        kind = "rate_limit_exceeded" if status == 429 else "service_unavailable"
        return _err(status, message, kind, **{"x-request-id": rid, "x-kvtier-router-pid": self.pid,
                                               "retry-after": str(max(1, self.cfg.admission.retry_after))})

    async def _admit(self, rid: str, strategy: str) -> Ticket | JSONResponse:
        """The admission gate, before any per-request work: 503 with no replica up, else a slot, a bounded wait
        for one, or 429 (queue full now, or no slot within the queue timeout)."""
        if not self.replicas.available():
            return self._reject(rid, strategy, 503, "no_replica", "no healthy replica available")
        self.gate.kick()
        got = await self.gate.enter()
        if isinstance(got, Ticket):
            return got
        return self._reject(rid, strategy, 429, got, f"router overloaded ({got.replace('_', ' ')}); retry later")

    async def _parse(self, request: Request, path: str, kind: str, rid: str) -> _Call | Response:
        """Body, JSON, model and strategy; an error response for anything the client got wrong."""
        try:
            body = await self._read_body(request)
        except ClientDisconnect:
            self.m.cancelled.labels("reading_body").inc()
            return Response(status_code=499)
        if isinstance(body, JSONResponse):
            return body
        return self._call(body, request.headers, path, kind, rid, self._upstream_headers(request.headers, rid))

    def _call(self, body: bytes, headers: Mapping[str, str], path: str, kind: str, rid: str,
              upstream: dict[str, str]) -> _Call | JSONResponse:
        """JSON, model and strategy of a read body; an error response for anything the client got wrong."""
        t_in = time.perf_counter()  # overhead = our work, not the client's upload time
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            self.m.rejected.labels("bad_json").inc()
            return _err(400, f"request body is not valid JSON: {e}")
        if not isinstance(payload, dict):
            self.m.rejected.labels("bad_json").inc()
            return _err(400, "request body must be a JSON object")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            self.m.rejected.labels("no_model").inc()
            return _err(400, "missing required field 'model'")
        strategy = headers.get(STRATEGY_HEADER) or self.cfg.strategy
        try:
            Policy.check_strategy(strategy)
        except UnknownStrategy as e:
            self.m.rejected.labels("bad_strategy").inc()
            return _err(400, str(e))
        session = headers.get(self.cfg.session_header)
        if session is None and isinstance(payload.get("user"), str):
            session = payload["user"]
        salt = payload.get("cache_salt") if isinstance(payload.get("cache_salt"), str) else None
        return _Call(rid=rid, path=path, kind=kind, body=body, payload=payload, model=model, strategy=strategy,
                     stream=bool(payload.get("stream")), session=session, salt=salt,
                     headers=upstream, clock=_Clock(t_in))

    async def _remote_tokenize(self, kind: str, req: dict[str, Any]) -> list[int]:
        """Token ids from a replica's vLLM /tokenize (the router has no tokenizer of its own); raises on failure."""
        ups = self.replicas.available()
        if not ups or self.client is None:
            raise RuntimeError("no replica up to tokenize")
        r = ups[self._tok_next % len(ups)]
        self._tok_next += 1
        timeout = aiohttp.ClientTimeout(total=self.cfg.tokenize_timeout)
        async with self.client.post(r.url + "/tokenize", json=req, headers=self._tok_headers,
                                    timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{r.url}/tokenize answered {resp.status}")
            got = (await resp.json(content_type=None)).get("tokens")
        if not isinstance(got, list) or not all(type(t) is int for t in got):
            raise RuntimeError(f"{r.url}/tokenize: no token list in the answer")
        return got

    async def _route_inputs(self, call: _Call) -> Response | None:
        """Token ids (all but roundrobin) and whether kvaware may look up L2; a 400 for a prompt we cannot
        tokenize. The lookup itself waits for the candidates (_forward): only then is it known to matter."""
        if call.strategy != "roundrobin":
            t0 = time.perf_counter()
            try:
                call.tokens = await self.tok.aencode(call.kind, call.payload, len(call.body))
            except RemoteTokenizeFailed as e:  # routed by bytes this time; the request itself goes on
                call.tokens = e.ids
                self.m.tokenize_fallback.inc()
            except TokenizeError as e:
                self.m.rejected.labels("bad_prompt").inc()
                return _err(400, str(e))
            call.clock.tok = time.perf_counter() - t0
            self.m.tokenize.observe(call.clock.tok)
        call.l2_due = (call.strategy == "kvaware" and self.cfg.l2_lookup is not None and bool(call.tokens)
                       and len(call.tokens) >= self.cfg.l2_min_tokens)
        return None

    async def _lookup_l2(self, call: _Call) -> None:
        """call.l2: one lookup per distinct kv-prefix among the replicas (each revision's chunks are its own;
        an endpoint revision's replicas share one key layout, dtype and world size: the first one's is used)."""
        call.l2_due = False
        layouts: dict[str | None, tuple[str, int] | None] = {}
        for r in self.replicas.available():
            layouts.setdefault(r.kv_prefix, r.kv_layout)
        prefixes = sorted(layouts, key=lambda p: p or "")
        got = await asyncio.gather(*(self._l2(call, p, layouts[p]) for p in prefixes))
        call.l2 = dict(zip(prefixes, got, strict=True))

    async def _l2(self, call: _Call, prefix: str | None, layout: tuple[str, int] | None = None) -> int:
        """L2 hit under one kv-prefix; trouble or a slow answer is a miss, never an error."""
        assert self.cfg.l2_lookup is not None
        try:
            got = await asyncio.wait_for(self.cfg.l2_lookup(call.tokens, call.model, prefix, layout),
                                         self.cfg.l2_timeout)
        except Exception:  # noqa: BLE001
            self.m.l2_lookups.labels("failed").inc()
            return 0
        self.m.l2_lookups.labels("hit" if got else "miss").inc()
        return got

    def _plan(self, call: _Call, cands: list[Replica]) -> Plan:
        return self.policy.plan(call.strategy, cands, call.tokens, session=call.session, model=call.model,
                                cache_salt=call.salt)

    def _skip_l2(self, call: _Call, cands: list[Replica]) -> Plan | None:
        """The plan to route by at once when no L2 answer could change it (counted as skipped); None when the
        lookup is worth its wait (or configured for every request)."""
        if self.cfg.l2_lookup_when == "always" or self.calibrator is not None:
            return None
        plan = self._plan(call, cands)
        if plan.l2_can_change():
            return None
        call.l2_due = False
        self.m.l2_lookups.labels("skipped").inc()
        return plan

    def _route(self, call: _Call, cands: list[Replica], plan: Plan | None = None) -> Decision:
        d = (plan or self._plan(call, cands)).decide(call.l2)
        self.policy.record(call.strategy, d)
        self.m.decisions.labels(call.strategy, d.reason).inc()
        return d

    async def _choose(self, call: _Call, tried: set[str]) -> Decision | bool:
        """The replica for one attempt (an L2 lookup first when its answer may change the pick); else True when
        replicas are up but all at their in-flight bound, False when none is left."""
        cap = self.cfg.admission.max_inflight_per_replica or 1 << 62
        avail = [r for r in self.replicas.available() if r.url not in tried]
        cands = [r for r in avail if r.inflight < cap]  # a replica at its bound is not a candidate
        plan = None
        if call.l2_due and cands and (plan := self._skip_l2(call, cands)) is None:
            await self._lookup_l2(call)  # then the candidates again: loads moved while we waited
            avail = [r for r in self.replicas.available() if r.url not in tried]
            cands = [r for r in avail if r.inflight < cap]
        if not cands:
            return bool(avail)
        return self._route(call, cands, plan)  # a skip's plan: nothing awaited since it read the loads

    # -- pick only: the bytes go through another proxy (router.haproxy) ---------------------------------
    async def pick(self, path: str, kind: str, headers: Mapping[str, str], body: bytes, declared: int) -> Picked:
        """The router's decision without its data path: auth, body bound, admission, parse, route inputs, one
        pick. A Picked with a decision holds its admission slot and the replica's in-flight count until
        `picked_done`; one with an answer (an error to send instead) holds nothing. There is no retry on
        another replica: the proxy carries the request; a replica that fails it is marked down for the next."""
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        strategy = headers.get(STRATEGY_HEADER) or self.cfg.strategy
        if (denied := self._auth(headers)) is not None:
            return Picked(rid, answer=denied)
        if len(body) > self.cfg.max_body_bytes or declared > len(body):  # over the bound, or more than haproxy buffered
            return Picked(rid, answer=self._too_large())
        t_gate = time.perf_counter()
        ticket = await self._admit(rid, strategy)
        if isinstance(ticket, Response):
            return Picked(rid, answer=ticket)
        waited = time.perf_counter() - t_gate
        try:
            call = self._call(body, headers, path, kind, rid, {})
            if isinstance(call, Response):
                ticket.release()
                return Picked(rid, answer=call)
            call.clock.t_in -= waited
            if (bad := await self._route_inputs(call)) is not None:
                ticket.release()
                return Picked(rid, answer=bad)
            d = await self._choose(call, set())
        except BaseException:
            ticket.release()
            raise
        if not isinstance(d, Decision):
            ticket.release()
            return Picked(rid, answer=self._reject(rid, strategy, 429, "replica_full", "every replica is at its "
                                                   "in-flight bound") if d else
                          self._reject(rid, strategy, 503, "no_replica", "no healthy replica available"))
        self.m.overhead.observe(call.clock.own_ms() / 1e3)
        return Picked(rid, call=call, decision=d, adm=_Admission(d.replica, d, len(call.tokens), self.m),
                      ticket=ticket)

    def picked_done(self, p: Picked, status: int, ttfb_s: float | None, fault: str | None) -> None:
        """The proxy finished a picked request (its log line): release the slot, count it, and tell the replica
        set what the replica did (fault: 'connect' refused/reset before an answer, 'timeout' no answer)."""
        assert p.decision is not None and p.adm is not None and p.ticket is not None and p.call is not None
        r = p.decision.replica
        if ttfb_s is not None:
            p.adm.first_byte()
            self.m.ttfb.observe(ttfb_s)
        p.adm.finish()
        p.ticket.release()
        if fault == "connect":
            self.replicas.mark_down(r, "connection failed (haproxy)")
        elif fault == "timeout":
            self.replicas.soft_fail(r, "timeout")
        elif status >= 500:
            self.replicas.mark_down(r, f"HTTP {status}")
        elif status > 0:
            self.replicas.ok(r)
        self.m.requests.labels(r.url, p.call.strategy, str(status)).inc()

    async def _forward(self, request: Request, call: _Call) -> Response:
        """Try replicas (best first) until one answers; retry only what never reached the client."""
        tried: set[str] = set()
        last_err: JSONResponse | None = None
        for attempt in range(self.cfg.retries + 1):
            d = await self._choose(call, tried)
            if not isinstance(d, Decision):
                if d and last_err is None:
                    return self._reject(call.rid, call.strategy, 429, "replica_full",
                                        "every replica is at its in-flight bound")
                break
            tried.add(d.replica.url)
            adm = _Admission(d.replica, d, len(call.tokens), self.m)
            if attempt == 0:
                self.m.overhead.observe(call.clock.own_ms() / 1e3)
            out = await self._attempt(request, call, d, adm)
            if isinstance(out, _Retry):
                last_err = out.error
                continue
            return out
        if last_err is not None:
            last_err.headers["x-request-id"] = call.rid
            self.m.requests.labels("none", call.strategy, str(last_err.status_code)).inc()
            return last_err
        return self._reject(call.rid, call.strategy, 503, "no_replica", "no healthy replica available")

    async def _attempt(self, request: Request, call: _Call, d: Decision, adm: _Admission) -> Response | _Retry:
        """One upstream try on d.replica, raced against the client's disconnect."""
        r, strategy = d.replica, call.strategy
        t_send = time.perf_counter()
        send = asyncio.ensure_future(self._send(r.url + call.path, call.body, call.headers, call.stream))
        disc = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({send, disc}, return_when=asyncio.FIRST_COMPLETED)
            call.clock.upstream += time.perf_counter() - t_send
        except asyncio.CancelledError:
            send.cancel()
            disc.cancel()
            adm.finish()
            raise
        if not send.done():
            # the client left while the replica was still working: closing our side aborts it there
            send.cancel()
            with contextlib.suppress(BaseException):
                await send
            adm.finish()
            self.m.cancelled.labels("before_response").inc()
            self.m.requests.labels(r.url, strategy, "499").inc()
            return Response(status_code=499)
        disc.cancel()
        try:
            resp, content = send.result()
        except (TimeoutError, aiohttp.ClientError) as e:
            adm.finish()
            if not isinstance(e, TimeoutError) or isinstance(e, aiohttp.ConnectionTimeoutError):
                # not connected (refused, pool or connect timeout) or the connection broke before an answer
                # (disconnect, bad HTTP, payload error): retry on another replica, nothing reached the client
                if isinstance(e, aiohttp.ClientConnectorError):
                    self.replicas.mark_down(r, f"{type(e).__name__}: {e}")  # refused: nobody listens
                else:
                    self.replicas.soft_fail(r, type(e).__name__)
                self.m.retries.labels("connect").inc()
                return _Retry(_err(502, f"replica {r.url} failed: {type(e).__name__}", "upstream_error"))
            # no byte within upstream_timeout (headers, or the body when not streaming)
            self.replicas.soft_fail(r, "timeout")
            self.m.requests.labels(r.url, strategy, "504").inc()
            return _err(504, f"replica {r.url} did not answer within {self.cfg.upstream_timeout}s",
                        "upstream_timeout", **{"x-request-id": call.rid})
        self.m.ttfb.observe(time.perf_counter() - t_send)
        code = resp.status
        if code < 500:
            self.replicas.ok(r)
        if code == 429 or code >= 500:
            try:
                err_body = await resp.read() if call.stream else content
            except (TimeoutError, aiohttp.ClientError):
                err_body = b""
            resp.close()
            adm.finish()
            if code >= 500:
                self.replicas.mark_down(r, f"HTTP {code}")
            self.m.retries.labels(str(code)).inc()
            return _Retry(JSONResponse(_safe_json(err_body, code), status_code=code))
        if not call.stream:
            return self._finish_plain(resp, content, adm, call, d)
        return self._finish_stream(resp, adm, call, d)

    def _finish_stream(self, resp: aiohttp.ClientResponse, adm: _Admission, call: _Call,
                       d: Decision) -> Response | _Retry:
        r, code = d.replica, resp.status
        ctype = resp.headers.get("content-type", "")
        if code == 200 and "text/event-stream" not in ctype:
            resp.close()
            adm.finish()
            self.replicas.mark_down(r, f"stream answered with {ctype!r}")
            return _Retry(_err(502, f"replica {r.url} answered a stream with {ctype or 'no content type'}",
                               "upstream_error"))
        self.m.requests.labels(r.url, call.strategy, str(code)).inc()
        return StreamingResponse(self._pump(resp, adm, lambda tail: self._stream_usage(tail, d, call, adm.first_s)),
                                 status_code=code,
                                 headers=self._down_headers(resp, call.rid, r, d, decoded=False, clock=call.clock))

    async def _send(self, url: str, body: bytes, headers: dict[str, str],
                    stream: bool) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST upstream; returns at the headers when streaming (body left to _pump, undecoded), else with the
        whole body read (content-encoding decoded). Cancelling it closes the connection, aborting the request."""
        assert self.client is not None
        resp = await self.client.post(url, data=body, headers=headers, auto_decompress=not stream)
        if stream:
            return resp, b""
        try:
            return resp, await resp.read()
        finally:
            resp.close()  # after a full read the connection is already back in the pool: no-op then

    def _finish_plain(self, resp: aiohttp.ClientResponse, content: bytes, adm: _Admission, call: _Call,
                      d: Decision) -> Response:
        r, rid, strategy, clock = d.replica, call.rid, call.strategy, call.clock
        adm.first_byte()
        adm.finish()
        code = resp.status
        if code == 200:
            try:
                obj = json.loads(content)
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
            except ValueError:
                self.replicas.mark_down(r, "invalid JSON")
                self.m.requests.labels(r.url, strategy, "502").inc()
                return _err(502, f"replica {r.url} returned an invalid response", "upstream_error",
                            **{"x-request-id": rid})
            self._count_usage(obj, d, call)
        self.m.requests.labels(r.url, strategy, str(code)).inc()
        return Response(content, status_code=code, headers=self._down_headers(resp, rid, r, d, decoded=True, clock=clock))

    def _count_usage(self, obj: dict[str, Any], d: Decision, call: _Call, prefill_s: float | None = None) -> None:
        """Predicted vs engine-reported cached tokens (router/accounting.py); roundrobin predicts nothing.
        prefill_s (streams: send to first chunk) feeds the L2 cost calibration when it is on."""
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            self.m.actual_cached.inc(cached)
            self.m.predicted_cached.inc(d.hit_tokens)
            n = usage.get("prompt_tokens")
            if isinstance(n, int):
                self.m.prompt_tokens.inc(n)
            if call.tokens:
                bs = self.policy.kv.block_size(d.replica.url) or self.cfg.block_size
                n = n if isinstance(n, int) else len(call.tokens)
                self.acct.record(d.hit_tokens, d.l2_tokens, cached, n, bs)
                if self.calibrator is not None and prefill_s is not None:
                    self._calibrate(prefill_s, n - cached, self.acct.last_matched_l2)

    def _calibrate(self, prefill_s: float, computed: int, loaded: int) -> None:
        """--tier-cost L2=auto: refit every 64 samples; until the fit exists the configured start value holds."""
        cal = self.calibrator
        assert cal is not None
        cal.add(prefill_s, computed, loaded)
        if cal.n % 64 == 0 and (cost := cal.l2_cost()) is not None:
            self.policy.l2_credit = 1.0 - cost
            self.m.tier_cost.labels("L2").set(cost)

    def _stream_usage(self, tail: bytes, d: Decision, call: _Call, prefill_s: float | None) -> None:
        """The usage block of a finished stream (its last chunk, sent with stream_options.include_usage)."""
        i = tail.rfind(b'"usage"')
        if i < 0:
            return
        j, k = tail.rfind(b"data:", 0, i), tail.find(b"\n", i)
        try:
            obj = json.loads(tail[j + 5:k if k >= 0 else len(tail)])
        except ValueError:
            return
        if isinstance(obj, dict):
            self._count_usage(obj, d, call, prefill_s)

    async def _pump(self, resp: aiohttp.ClientResponse, adm: _Admission,
                    on_end: Callable[[bytes], None]) -> AsyncIterator[bytes]:
        """Zero-buffer SSE passthrough; returning early (client gone) closes the upstream connection. The last
        16 KiB are kept for on_end (the usage chunk) once the stream has ended normally."""
        tail = bytearray()
        try:
            async for chunk in resp.content.iter_any():
                adm.first_byte()
                tail += chunk
                if len(tail) > 16384:
                    del tail[:-16384]
                yield chunk
            on_end(bytes(tail))
        except (TimeoutError, aiohttp.ClientError) as e:  # upstream died mid-stream: end the stream
            log.warning("upstream %s broke mid-stream: %s", adm.r.url, e)
        except (asyncio.CancelledError, GeneratorExit):
            self.m.cancelled.labels("streaming").inc()
            raise
        finally:
            resp.close()  # no-op once the body was read to the end (the connection is back in the pool)
            adm.finish()

    async def models(self, request: Request) -> Response:
        if (denied := self._auth(request.headers)) is not None:
            return denied
        assert self.client is not None
        for r in self.replicas.available():
            try:
                async with self.client.get(r.url + "/v1/models", headers=self._upstream_headers(request.headers, "models"),
                                           timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout * 5)) as resp:
                    if resp.status == 200:
                        return Response(await resp.read(), media_type="application/json")
            except (TimeoutError, aiohttp.ClientError):
                self.replicas.mark_down(r, "models failed")
        return _err(503, "no healthy replica available", "service_unavailable")

    def health(self) -> JSONResponse:
        reps = [{"url": r.url, "up": r.available, "inflight": r.inflight, "prefill_tokens": r.prefill_tokens,
                 "served": r.served, "external_running": r.ext_running, "external_waiting": r.ext_waiting}
                for r in self.replicas.replicas.values()]
        up = any(r["up"] for r in reps)
        return JSONResponse({"status": "ok" if up else "no_replicas", "replicas": reps,
                             "strategies": list(STRATEGIES), "default_strategy": self.cfg.strategy},
                            status_code=200 if up else 503)

    def metrics(self) -> Response:
        """This process's own series."""
        return Response(self._metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def metrics_all(self, request: Request) -> Response:
        """GET /metrics: with --workers (peers_dir) every worker's series, merged with a `worker` label, so a
        scrape of the shared port sees all of them whichever worker answers (`?local=1`: this one only)."""
        if not self.cfg.peers_dir or request.query_params.get("local") == "1":
            return self.metrics()
        own = self._metrics_text()
        peers = read_peers(self.cfg.peers_dir)
        peers.pop(self.cfg.worker_id, None)
        texts = dict(zip(peers, await asyncio.gather(*(self._peer_metrics(p) for p in peers.values())), strict=True))
        texts[self.cfg.worker_id] = own
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    async def _peer_metrics(self, port: int) -> bytes | None:
        """One sibling's own /metrics over its loopback listener; None if it does not answer within 2 s."""
        assert self.client is not None
        scheme = "https" if self.cfg.peers_tls else "http"
        try:
            async with self.client.get(f"{scheme}://127.0.0.1:{port}/metrics?local=1", ssl=False,
                                       timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                return await resp.read() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None

    def _metrics_text(self) -> bytes:
        self.m.kv_blocks.set(len(self.policy.kv))
        self.m.tree_blocks.set(len(self.policy.tree))
        for r in self.replicas.replicas.values():
            self.m.external.labels(r.url, "running").set(r.ext_running)
            self.m.external.labels(r.url, "waiting").set(r.ext_waiting)
        state = getattr(self.cfg.l2_lookup, "key_state", None)
        if state is not None:
            for s in KEY_STATES:
                self.m.l2_key_check.labels(s).set(1 if s == state else 0)
        for url, sub in self.subs.items():
            if sub.stats.lag_s:
                self.m.kv_lag.labels(url).set(sub.stats.lag_s[-1])
        return generate_latest(self.m.registry)


def read_peers(peers_dir: str) -> dict[int, int]:
    """worker id -> private loopback port, from the `<id>.port` files the workers wrote."""
    out: dict[int, int] = {}
    for f in Path(peers_dir).glob("*.port"):
        with contextlib.suppress(ValueError, OSError):
            out[int(f.stem)] = int(f.read_text())
    return out


class _Families:
    """A collector that yields already-built metric families (to re-emit parsed, relabelled ones)."""

    def __init__(self, fams: list[Metric]) -> None:
        self.fams = fams

    def collect(self) -> list[Metric]:
        return self.fams


def merge_metrics(texts: dict[int, bytes | None]) -> bytes:
    """Several processes' Prometheus text merged into one exposition: each sample gets `worker="<id>"`, each
    family's HELP/TYPE appears once (sum over `worker` in PromQL for the router-wide value). A worker that did
    not answer is missing from this scrape (kvtier_router_workers_scraped tells how many did)."""
    fams: dict[str, Metric] = {}
    for wid, text in sorted(texts.items()):
        if text is None:
            continue
        for fam in text_string_to_metric_families(text.decode()):
            out = fams.get(fam.name)
            if out is None:
                out = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [smp._replace(labels={**smp.labels, "worker": str(wid)}) for smp in fam.samples]
    scraped = Metric("kvtier_router_workers_scraped", "router worker processes whose series are in this scrape",
                     "gauge")
    scraped.add_sample("kvtier_router_workers_scraped", {}, float(sum(t is not None for t in texts.values())))
    fams[scraped.name] = scraped
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(list(fams.values())))
    return generate_latest(reg)


def _proxy_env() -> bool:
    """Whether any proxy variable is set (http_proxy, HTTPS_PROXY, all_proxy, ...; any case)."""
    return any(k.lower().endswith("_proxy") and k.lower() != "no_proxy" and v for k, v in os.environ.items())


class _Held(StreamingResponse):
    """A streaming response that gives its admission slot back once sent, however it ends: wrapping the
    ASGI call (not the body iterator) also covers a client that leaves before the first chunk, when Starlette
    cancels the send without ever starting the iterator."""

    def __init__(self, resp: StreamingResponse, ticket: Ticket) -> None:  # takes over resp's state as is
        self.__dict__.update(resp.__dict__)
        self.ticket = ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


def _safe_json(body: bytes, code: int) -> dict[str, Any]:
    try:
        obj = json.loads(body)
        if isinstance(obj, dict):
            return obj
    except ValueError:
        pass
    return {"error": {"message": f"replica answered HTTP {code}", "type": "upstream_error", "code": code}}


class FastFront:
    """Pure ASGI front for the two proxy endpoints: a POST there goes straight to the router's handler, skipping
    FastAPI's middleware stack and route matching (~8 % of the router's CPU at 200 req/s in a py-spy profile);
    the admission gate is then the handler's first await. Everything else (lifespan, /health, /metrics,
    /v1/models, 404/405) goes to the FastAPI app unchanged. An exception escaping the handler is uvicorn's
    500, as it was ServerErrorMiddleware's."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.state = app.state
        router: Router = app.state.router
        self._routes: dict[str, Callable[[Request], Awaitable[Response]]] = {
            "/v1/completions": lambda req: router.proxy(req, "/v1/completions", "completion"),
            "/v1/chat/completions": lambda req: router.proxy(req, "/v1/chat/completions", "chat"),
        }

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._routes.get(scope["path"])
            if handler is not None:
                resp = await handler(Request(scope, receive, send))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        for front in app.state.fronts:  # another data path in front of the router (router.haproxy)
            await front.start()
        if cfg.freeze_heap:
            frozen = freeze_startup_heap()
            log.info("froze the start-up heap: %d objects", frozen)
        try:
            yield
        finally:
            for front in app.state.fronts:
                await front.stop()
            await router.stop()

    app = FastAPI(title="kvtier router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.state.fronts = []

    async def completions(request: Request) -> Response:
        return await router.proxy(request, "/v1/completions", "completion")

    async def chat(request: Request) -> Response:
        return await router.proxy(request, "/v1/chat/completions", "chat")

    # Plain Starlette routes for the two hot endpoints: FastAPI's dependency solving would parse the
    # request's cookies and headers on every call (~5 % of the router's CPU at 200 req/s) for nothing.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        return router.health()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await router.metrics_all(request)

    return app
