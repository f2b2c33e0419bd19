"""Request -> token ids, exactly as the replica will see them, cached and off the event loop.

Cache-aware routing is only as good as the token ids it scores: we render chat requests with the
model's own chat template (tools included) and encode like vLLM does, so prefix matches line up with
the engine's KV blocks. A byte-level fallback ("bytes") needs no model files (tests, smoke runs).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any


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


class Tokenizer:
    """Thread-safe tokenizer with an LRU cache keyed by the rendered prompt text.

    source: a local path or hub id for transformers.AutoTokenizer, or "bytes" for UTF-8 bytes as ids.
    """

    def __init__(self, source: str = "bytes", *, cache_entries: int = 4096, workers: int = 2) -> None:
        self.source = source
        self._hf: Any = None
        if source != "bytes":
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(source)
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
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

    def encode(self, kind: str, body: dict[str, Any]) -> list[int]:
        """Blocking encode with caching (call via `aencode` from async code)."""
        rendered = self.render(kind, body)
        if isinstance(rendered, list):
            return rendered
        key = hashlib.blake2b(f"{kind}\0{rendered}".encode(), digest_size=16).digest()
        with self._lock:
            ids = self._cache.get(key)
            if ids is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return ids
        ids = self._encode_text(rendered, kind == "chat")
        with self._lock:
            self.misses += 1
            self._cache[key] = ids
            while len(self._cache) > self._cap:
                self._cache.popitem(last=False)
        return ids

    def cached(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """Cache-only lookup, cheap enough for the event loop when the prompt was seen before."""
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
            return self._cache.get(key)

    async def aencode(self, kind: str, body: dict[str, Any]) -> list[int]:
        """Encode in the worker pool so long prompts never stall other requests."""
        ids = self.cached(kind, body)
        if ids is not None:
            return ids
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, kind, body)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


