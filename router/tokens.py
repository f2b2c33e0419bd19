"""Request -> token ids, exactly as the replica will see them, cached and off the event loop.

Cache-aware routing is only as good as the token ids it scores: we render chat requests with the
model's own chat template (tools included) and encode like vLLM does, so prefix matches line up with
the engine's KV blocks. A byte-level fallback ("bytes") needs no model files (tests, smoke runs).
"replica" (the default when no --tokenizer is given, and the fallback when the given path cannot be
loaded) asks a replica's own vLLM `/tokenize` endpoint, so a router pod without model files still scores
the engine's exact token ids; a failed /tokenize degrades that request to bytes (counted), never fails it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("kvtier.router.tokens")

REPLICA = "replica"  # --tokenizer value: ask a replica's /tokenize
# A request body up to this size is rendered and encoded on the event loop (well under a millisecond for ~2k
# tokens): on a box whose cores the engines keep busy, the pool's two thread hand-offs cost more than that.
INLINE_BYTES = 8192
# (kind, vLLM /tokenize request body) -> token ids; raises on any failure
RemoteTokenize = Callable[[str, dict[str, Any]], Awaitable[list[int]]]


class TokenizeError(ValueError):
    """The request cannot be turned into a prompt (bad messages/prompt shape)."""


def _token_ids(ids: list[Any]) -> list[int]:
    """A token-id prompt as vLLM accepts it: non-negative ints only (no floats, bools, nulls or strings)."""
    if not all(type(t) is int and t >= 0 for t in ids):
        raise TokenizeError("a token-id prompt must be a list of non-negative integers")
    return list(ids)


def _bytes_chat(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


class RemoteTokenizeFailed(Exception):
    """The replica could not tokenize; `ids` is the bytes fallback to route this request by."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__("replica /tokenize failed")
        self.ids = ids


class Tokenizer:
    """Thread-safe tokenizer with an LRU cache keyed by the rendered prompt text.

    source: a local path or hub id for transformers.AutoTokenizer, "bytes" for UTF-8 bytes as ids, or
    "replica" for a replica's /tokenize (set `remote`). A path that cannot be loaded falls back to "replica"
    when `fallback_replica` (the router), else raises (the test replica needs its tokenizer).
    """

    def __init__(self, source: str = "bytes", *, cache_entries: int = 4096, workers: int = 2,
                 fallback_replica: bool = False, inline_bytes: int = INLINE_BYTES) -> None:
        self.source = source
        self.inline_bytes = inline_bytes
        self._hf: Any = None
        if source not in ("bytes", REPLICA):
            try:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(source)
            except Exception as e:
                if not fallback_replica:
                    raise
                log.warning("tokenizer %r cannot be loaded (%s); asking the replicas' /tokenize instead", source, e)
                self.source = REPLICA
        self.remote: RemoteTokenize | None = None  # set by the router when source == "replica"
        self.remote_failures = 0
        # ids kept as tuples: a tuple of ints leaves the cyclic GC at its first collection, a list stays tracked and
        # every full collection walks it (4,096 prompts x ~2 k ids: 15-60 ms pauses on the event loop)
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._cap = cache_entries
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-tok")
        self.hits = 0
        self.misses = 0

    # -- rendering --------------------------------------------------------------------------------
    def render(self, kind: str, body: dict[str, Any]) -> str | list[int]:
        """Prompt text (or ready token ids) for a /v1/completions or /v1/chat/completions body."""
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise TokenizeError("'messages' must be a non-empty list of objects")
            if self._hf is None:
                return _bytes_chat(messages)
            kwargs: dict[str, Any] = {}
            if body.get("tools"):
                kwargs["tools"] = body["tools"]
            if isinstance(body.get("chat_template_kwargs"), dict):
                kwargs.update(body["chat_template_kwargs"])
            try:
                return self._hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True),
                    **kwargs)
            except Exception as e:  # template errors are the client's problem (bad roles, etc.)
                raise TokenizeError(f"chat template failed: {e}") from e
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                return _token_ids(prompt)
            if isinstance(first, list):  # batch of token-id prompts: route by the first
                return _token_ids(first)
            prompt = first  # batch of strings: route by the first
        if not isinstance(prompt, str):
            raise TokenizeError("'prompt' must be a string, a list of strings or a list of token ids")
        return prompt

    def _encode_text(self, text: str, chat: bool) -> list[int]:
        if self._hf is None:
            return list(text.encode("utf-8"))
        # vLLM: chat prompts already carry special tokens from the template; plain prompts get BOS.
        return list(self._hf.encode(text, add_special_tokens=not chat))

    def _cache_get(self, key: bytes) -> list[int] | None:
        with self._lock:
            ids = self._cache.get(key)
            if ids is None:
                return None
            self._cache.move_to_end(key)
            self.hits += 1
        return list(ids)

    def _cache_put(self, key: bytes, ids: list[int]) -> None:
        with self._lock:
            self.misses += 1
            self._cache[key] = tuple(ids)
            while len(self._cache) > self._cap:
                self._cache.popitem(last=False)

    def encode(self, kind: str, body: dict[str, Any]) -> list[int]:
        """Blocking encode with caching (call via `aencode` from async code)."""
        rendered = self.render(kind, body)
        if isinstance(rendered, list):
            return rendered
        key = hashlib.blake2b(f"{kind}\0{rendered}".encode(), digest_size=16).digest()
        ids = self._cache_get(key)
        if ids is not None:
            return ids
        ids = self._encode_text(rendered, kind == "chat")
        self._cache_put(key, ids)
        return ids

    def cached(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """Cache-only lookup, cheap enough for the event loop when the prompt was seen before."""
        if self.source == REPLICA:
            return None  # aencode keys the remote cache itself
        if self._hf is not None and kind == "chat":
            return None  # rendering a template is not free; let the pool do it
        try:
            rendered = self.render(kind, body)
        except TokenizeError:
            return None
        if isinstance(rendered, list):
            return rendered
        if self._hf is None:
            return list(rendered.encode("utf-8"))
        key = hashlib.blake2b(f"{kind}\0{rendered}".encode(), digest_size=16).digest()
        with self._lock:
            ids = self._cache.get(key)
        return None if ids is None else list(ids)

    def _remote_request(self, kind: str, body: dict[str, Any], rendered: str) -> dict[str, Any]:
        """vLLM's /tokenize body for this request, with the same defaults vLLM applies when serving it."""
        if kind != "chat":
            return {"model": body.get("model"), "prompt": rendered}
        req: dict[str, Any] = {"model": body.get("model"), "messages": body["messages"],
                               "add_generation_prompt": body.get("add_generation_prompt", True)}
        for k in ("tools", "chat_template_kwargs"):
            if body.get(k):
                req[k] = body[k]
        return req

    async def _aencode_remote(self, kind: str, body: dict[str, Any]) -> list[int]:
        """Replica /tokenize, LRU-cached like local encoding; on failure this request's bytes (not cached)."""
        rendered = self.render(kind, body)  # validates the shape (400s stay ours) and picks a batch's first
        if isinstance(rendered, list):
            return rendered
        req = self._remote_request(kind, body, rendered)
        key = hashlib.blake2b(f"{kind}\0".encode() + json.dumps(req, sort_keys=True, default=str).encode(),
                              digest_size=16).digest()
        ids = self._cache_get(key)
        if ids is not None:
            return ids
        try:
            if self.remote is None:
                raise RuntimeError("no replica tokenizer wired")
            ids = await self.remote(kind, req)
        except Exception as e:  # noqa: BLE001 - tokenization trouble degrades routing, never the request
            self.remote_failures += 1
            if self.remote_failures <= 3 or self.remote_failures % 1000 == 0:
                log.warning("replica /tokenize failed (%d so far): %s; routing by bytes", self.remote_failures, e)
            raise RemoteTokenizeFailed(list(rendered.encode("utf-8"))) from e
        self._cache_put(key, ids)
        return ids

    async def aencode(self, kind: str, body: dict[str, Any], nbytes: int | None = None) -> list[int]:
        """Encode in the worker pool so long prompts never stall other requests; a body of at most
        `inline_bytes` (`nbytes`, its size on the wire) is encoded right here."""
        if self.source == REPLICA:
            return await self._aencode_remote(kind, body)
        if nbytes is not None and nbytes <= self.inline_bytes:
            return self.encode(kind, body)
        ids = self.cached(kind, body)
        if ids is not None:
            return ids
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, kind, body)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


