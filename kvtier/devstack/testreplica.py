"""A lightweight OpenAI-compatible replica that behaves like one vLLM engine for routing purposes.

Used by the router tests and the routing benchmark (4 real vLLM engines do not fit on a 2-core CI box).
It keeps a block-level LRU prefix cache (engine-style hashes the router cannot reproduce), reports
`usage.prompt_tokens_details.cached_tokens` like vLLM, serializes prefill (one compute engine) at a
configurable cost per uncached token, and publishes real vLLM-wire KV events (PUB + ROUTER replay, the
ZmqEventPublisher protocol) in either the newer map or the older array msgpack encoding. Admin
endpoints inject faults (500/429/garbage/hang), sequence gaps and cache resets.

    python -m kvtier.devstack.testreplica --port 0 --kv-events tcp://127.0.0.1:5557 --kv-replay tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
import sys
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from router.tokens import TokenizeError, Tokenizer

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """vLLM ZmqEventPublisher wire protocol on asyncio sockets."""

    def __init__(self, endpoint: str, replay: str | None, encoding: str, buffer_steps: int, topic: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.replay = None
        if replay:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay)
        self.encoding = encoding
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.drop_next = 0
        self.task: asyncio.Task[None] | None = None

    def event(self, kind: str, **f: Any) -> Any:
        if self.encoding == "map":
            return {"type": kind, **f}
        if kind == "BlockStored":
            return [kind, f["block_hashes"], f["parent_block_hash"], f["token_ids"], f["block_size"], None,
                    f["medium"], None]
        if kind == "BlockRemoved":
            return [kind, f["block_hashes"], f["medium"]]
        return [kind]

    async def publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if self.drop_next > 0:  # simulate a subscriber that missed messages (HWM overflow)
            self.drop_next -= 1
            return
        await self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    async def serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, buf in list(self.buffer):
                if seq >= start_seq:
                    await self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), buf))
            await self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        if self.task:
            self.task.cancel()
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.tok = Tokenizer(args.tokenizer)
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill_lock = asyncio.Lock()
        self.fault = args.fault
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "inflight": 0, "max_inflight": 0, "tokenize": 0, "waiting": 0}
        self.request_ids: list[str] = []
        self.last_headers: dict[str, str] = {}  # of the last completion request (what a router forwarded)
        self.pub: Publisher | None = None
        self.seed = hashlib.sha256(args.hash_seed.encode()).digest()

    def hashes(self, tokens: list[int]) -> list[int]:
        """Engine-private block hashes (seeded sha256, low 64 bits, like vLLM's int hashes)."""
        out, parent, bs = [], self.seed, self.a.block_size
        for i in range(len(tokens) // bs):
            h = hashlib.sha256(parent + json.dumps(tokens[i * bs:(i + 1) * bs]).encode()).digest()
            out.append(int.from_bytes(h, "big") & ((1 << 64) - 1))
            parent = h
        return out

    async def admit(self, tokens: list[int]) -> int:
        """Prefix-cache lookup + store; publishes the KV events; returns cached tokens."""
        hs = self.hashes(tokens)
        bs = self.a.block_size
        hit = 0
        for h in hs:
            if h not in self.cache:
                break
            hit += 1
        for h in hs[:hit]:
            self.cache.move_to_end(h)
        new = hs[hit:]
        events: list[Any] = []
        pub = self.pub
        if new:
            for h in new:
                self.cache[h] = None
            if pub:
                events.append(pub.event("BlockStored", block_hashes=new, parent_block_hash=hs[hit - 1] if hit else None,
                                        token_ids=tokens[hit * bs:len(hs) * bs], block_size=bs, medium="GPU",
                                        lora_name=None))
        evicted = []
        while len(self.cache) > self.a.capacity_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        if evicted and pub:
            events.append(pub.event("BlockRemoved", block_hashes=evicted, medium="GPU"))
        if pub:
            await pub.publish(events)
        cached = hit * bs
        if cached >= len(tokens):  # like vLLM: the last token is always recomputed
            cached = max(0, cached - bs)
        return cached

    async def reset(self) -> None:
        self.cache.clear()
        if self.pub:
            await self.pub.publish([self.pub.event("AllBlocksCleared")])


def create_app(args: argparse.Namespace) -> FastAPI:
    eng = Engine(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if args.kv_events:
            eng.pub = Publisher(args.kv_events, args.kv_replay, args.encoding, args.buffer_steps, args.topic)
            if eng.pub.replay is not None:
                eng.pub.task = asyncio.get_running_loop().create_task(eng.pub.serve_replay())
        try:
            yield
        finally:
            if eng.pub:
                eng.pub.close()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = eng

    @app.get("/health")
    async def health() -> Response:
        if eng.fault == "down":
            return PlainTextResponse("down", status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model",
                                                          "owned_by": "kvtier-testreplica"}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        s = eng.stats
        # vLLM's names: the router derives other routers' load from the two request gauges
        lbl = f'{{engine="0",model_name="{args.model}"}}'
        return PlainTextResponse(f"vllm:prefix_cache_queries_total{lbl} {s['prompt_tokens']}\n"
                                 f"vllm:prefix_cache_hits_total{lbl} {s['cached_tokens']}\n"
                                 f"vllm:num_requests_running{lbl} {s['inflight'] - s['waiting']}.0\n"
                                 f"vllm:num_requests_waiting{lbl} {s['waiting']}.0\n")

    @app.get("/admin/stats")
    async def stats() -> Response:
        return JSONResponse({**eng.stats, "cache_blocks": len(eng.cache), "request_ids": eng.request_ids[-100:],
                             "last_headers": eng.last_headers,
                             "seq": eng.pub.seq if eng.pub else None})

    @app.post("/admin/fault")
    async def fault(request: Request) -> Response:
        eng.fault = (await request.json())["mode"]
        return JSONResponse({"fault": eng.fault})

    @app.post("/admin/config")
    async def config(request: Request) -> Response:
        """Change the simulated costs at runtime (benchmarks switch to zero cost to measure overhead)."""
        body = await request.json()
        for k in ("prefill_us_per_token", "decode_ms_per_token"):
            if k in body:
                setattr(args, k, float(body[k]))
        return JSONResponse({k: getattr(args, k) for k in ("prefill_us_per_token", "decode_ms_per_token")})

    @app.post("/admin/drop_events")
    async def drop(request: Request) -> Response:
        body = await request.json()
        assert eng.pub is not None
        eng.pub.drop_next = int(body["n"])
        if "buffer_steps" in body:
            eng.pub.buffer = deque(eng.pub.buffer, maxlen=int(body["buffer_steps"]))
        return JSONResponse({"ok": True})

    @app.post("/reset_prefix_cache")
    async def reset() -> Response:
        await eng.reset()
        return JSONResponse({"ok": True})

    async def handle(request: Request, kind: str) -> Response:
        f = eng.fault
        if f == "500":
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        if f == "429":
            return JSONResponse({"error": {"message": "too many requests"}}, status_code=429)
        if f == "hang":
            await asyncio.sleep(3600)
        body = await request.json()
        if f == "garbage":
            return Response(b"\x00\xffnot json at all", media_type="application/json")
        try:
            tokens = eng.tok.encode(kind, body)
        except TokenizeError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        asked = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
        if any(type(v) is not int or v < 1 for v in asked):  # as vLLM: a 400, not a crash (500)
            return JSONResponse({"error": {"message": "max_tokens must be an integer >= 1"}}, status_code=400)
        max_tokens = asked[0] if asked else args.max_tokens
        rid = request.headers.get("x-request-id", "")
        eng.request_ids.append(rid)
        eng.last_headers = {k.lower(): v for k, v in request.headers.items()}
        s = eng.stats
        s["requests"] += 1
        s["inflight"] += 1
        s["max_inflight"] = max(s["max_inflight"], s["inflight"])
        stream = bool(body.get("stream"))
        created = int(time.time())
        cid = f"cmpl-{uuid.uuid4().hex}"

        async def prefill() -> int:
            s["waiting"] += 1  # queued for the one compute engine (vLLM's "waiting")
            try:
                await eng.prefill_lock.acquire()
            finally:
                s["waiting"] -= 1
            try:
                cached = await eng.admit(tokens)
                await asyncio.sleep((len(tokens) - cached) * args.prefill_us_per_token / 1e6)
            finally:
                eng.prefill_lock.release()
            s["prompt_tokens"] += len(tokens)
            s["cached_tokens"] += cached
            return cached

        def usage(cached: int, n: int) -> dict[str, Any]:
            return {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n,
                    "prompt_tokens_details": {"cached_tokens": cached}}

        def piece(i: int) -> str:
            return f" t{i}"

        if not stream:
            try:
                task = asyncio.ensure_future(prefill())
                while not task.done():
                    await asyncio.wait({task}, timeout=0.01)
                    if not task.done() and await request.is_disconnected():
                        task.cancel()
                        raise asyncio.CancelledError
                cached = task.result()
                for _ in range(max_tokens):
                    await asyncio.sleep(args.decode_ms_per_token / 1e3)
                    if args.decode_ms_per_token >= 5 and await request.is_disconnected():
                        raise asyncio.CancelledError
            except asyncio.CancelledError:
                s["cancelled"] += 1
                s["inflight"] -= 1
                return Response(status_code=499)
            s["completed"] += 1
            s["inflight"] -= 1
            text = "".join(piece(i) for i in range(max_tokens))
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length"}
                obj = "text_completion"
            return JSONResponse({"id": cid, "object": obj, "created": created, "model": args.model,
                                 "choices": [choice], "usage": usage(cached, max_tokens)})

        async def gen() -> AsyncIterator[bytes]:
            done = False
            try:
                cached = await prefill()
                for i in range(max_tokens):
                    if kind == "chat":
                        delta = {"index": 0, "delta": {"content": piece(i)}, "finish_reason": None}
                        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                 "model": args.model, "choices": [delta]}
                    else:
                        chunk = {"id": cid, "object": "text_completion", "created": created, "model": args.model,
                                 "choices": [{"index": 0, "text": piece(i), "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(args.decode_ms_per_token / 1e3)
                final = {"id": cid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                         "created": created, "model": args.model, "choices": [], "usage": usage(cached, max_tokens)}
                yield f"data: {json.dumps(final)}\n\n".encode()
                yield b"data: [DONE]\n\n"
                done = True
            finally:
                s["inflight"] -= 1
                s["completed" if done else "cancelled"] += 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: {"model", "prompt"} or {"model", "messages", ...} -> {"tokens": [...], "count"}."""
        eng.stats["tokenize"] += 1
        if eng.fault in ("500", "tokenize"):
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        body = await request.json()
        try:
            tokens = eng.tok.encode("chat" if "messages" in body else "completion", body)
        except TokenizeError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        return JSONResponse({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens, "token_strs": None})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "chat")

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvtier.devstack.testreplica")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="test-model")
    p.add_argument("--tokenizer", default="bytes")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--kv-events", default=None, help="PUB bind endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-replay", default=None, help="ROUTER bind endpoint for replay")
    p.add_argument("--encoding", choices=("map", "array"), default="map")
    p.add_argument("--buffer-steps", type=int, default=10_000)
    p.add_argument("--topic", default="")
    p.add_argument("--hash-seed", default="0")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    p.add_argument("--decode-ms-per-token", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--fault", default="ok", help="ok|500|429|garbage|hang|down|tokenize (only /tokenize fails)")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    app = create_app(args)
    # proto IPPROTO_TCP: asyncio then sets TCP_NODELAY on each accepted connection (with proto 0 it does not, and
    # a response's body waited ~40 ms for the client's delayed ACK; router.cli._tcp_socket)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    print(f"testreplica listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    asyncio.run(server.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
