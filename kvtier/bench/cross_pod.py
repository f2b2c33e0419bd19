"""`kvtier bench cross-pod`: the Curvine-style cross-pod TTFT sweep through the real stack, over HTTP only.

For each prompt length and repetition (a fresh random prompt each time, sent as token ids so that the
byte-identical prompt is guaranteed and a cold request is really cold): cold on replica A (LMCache stores to L1
and, asynchronously, to l2fs), then the same prompt on replica B (another pod/node that never saw it: its hit can
only come from L2), then again on A (L0/L1 hit). TTFT is client-side, streamed (`/v1/completions`, first token
chunk). Hit evidence per request, all over HTTP: `usage.prompt_tokens_details.cached_tokens` (vLLM needs
`--enable-prompt-tokens-details`) and the deltas of vLLM's Prometheus counters on the replica's `/metrics`
(`vllm:external_prefix_cache_hits_total` = tokens loaded through the KV connector, i.e. LMCache L1/L2;
`vllm:prefix_cache_hits_total` = vLLM's own L0 prefix cache). Each row says which evidence it used.

Two ways to name the replicas:
  --replica-a URL --replica-b URL --model NAME   any two OpenAI-compatible vLLM endpoints (pods, Services): no
                                                 logs, no up.json, no local files are read
  --from-up .kvtier/up.json (or nothing: a stack is started here)   URLs resolved from `kvtier up`'s state file,
                                                 then the same HTTP measurement, plus what only a local stack
                                                 shows: l2fs bytes written by A and LMCache's log lines

Local stacks: --mode plugin (our connector) | mount (stock LMCache fs:// on each node's own l2fs mount), and
--netns [--link RATE] (each node in a network namespace, its link shaped; see docs/netns.md); with --from-up
these come from up.json. The plain TCP throughput between A's node and B's node (the shaped link in --netns,
loopback otherwise) is measured in the same run and printed next to the table, with whether the shaper was the
bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvtier import envs as kvtier_envs
from kvtier.bench.common import fmt, link_line, pct, shaper_bound, table, write_results
from kvtier.up import log

CHUNK = 256
DEFAULT_LENGTHS = [512, 1024, 1536, 2048, 2560, 3072, 4096, 8000]
QUICK_LENGTHS = [300, 600]
# Curvine + HyperPod post (Qwen2-7B on A10G, fs:// L2 on Curvine): prompt tokens -> (cold ms, cross-pod L2 ms).
CURVINE = {534: (184, 187), 1080: (404, 239), 1563: (537, 248), 2022: (618, 261), 2608: (774, 287),
           3142: (893, 403)}
ARMS = ("cold A", "L2 hit B", "L0/L1 hit A")

# vLLM counters read from /metrics (summed over label sets): connector (LMCache L1/L2) hits, L0 prefix-cache hits,
# and prompt tokens (to know when the request we just sent has been counted).
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
L0_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
COUNTERS = (EXTERNAL_HITS, L0_HITS, PROMPT_TOKENS)

HIT_RE = re.compile(r"LMCache hit tokens: (\d+)")
RETRIEVED_RE = re.compile(r"Retrieved (\d+) out of (\d+) required tokens.*?size: ([\d.]+) gb, cost ([\d.]+) ms")


@dataclass
class Target:
    """One replica as the benchmark sees it: nothing but a base URL (and a bearer token if it wants one)."""

    name: str
    url: str
    node: str = ""
    api_key: str | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.node = self.node or (urlsplit(self.url).hostname or self.url)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# ---------- HTTP: metrics, tokenizer, streamed completion ----------

def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Prometheus text -> {name: sum over all label sets} for the given metric names (absent ones left out).
    A name with its labels as exposed (`x_total{result="hit"}`) selects that one series."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        for key in (name, series) if series != name else (name,):
            if key in names:
                try:
                    out[key] = out.get(key, 0.0) + float(value)
                except ValueError:
                    continue
    return out


def scrape(t: Target) -> dict[str, float] | None:
    """The replica's counters of interest; None if /metrics does not answer (then rows use other evidence)."""
    try:
        r = httpx.get(f"{t.url}/metrics", headers=t.headers(), timeout=10)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_counters(r.text, COUNTERS)


def metric_sum(base_url: str, name: str) -> float | None:
    """Sum of a Prometheus counter over all label sets (None if the replica does not export it)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return parse_counters(text, (name,)).get(name)


def counted(t: Target, before: dict[str, float] | None, prompt_tokens: int, timeout: float = 5.0
            ) -> dict[str, float] | None:
    """Counters once the request just sent is in them (vLLM updates /metrics a moment after the response)."""
    if before is None:
        return None
    deadline = time.monotonic() + timeout
    while True:
        cur = scrape(t)
        if cur is None:
            return None
        done = cur.get(PROMPT_TOKENS, 0.0) - before.get(PROMPT_TOKENS, 0.0) >= prompt_tokens
        if done or PROMPT_TOKENS not in cur or time.monotonic() > deadline:
            return cur
        time.sleep(0.1)


def remote_tokenizer(t: Target, model: str) -> Callable[[str], list[int]]:
    """Text -> token ids through the replica's own vLLM `/tokenize` (no tokenizer files needed here)."""
    def encode(text: str) -> list[int]:
        r = httpx.post(f"{t.url}/tokenize", headers=t.headers(), timeout=60,
                       json={"model": model, "prompt": text, "add_special_tokens": False})
        if r.status_code != 200:
            raise SystemExit(f"kvtier bench cross-pod: {t.url}/tokenize: HTTP {r.status_code} {r.text[:200]} "
                             "(pass --tokenizer PATH)")
        return list(r.json()["tokens"])
    return encode


def local_tokenizer(path: str) -> Callable[[str], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda text: list(tok.encode(text, add_special_tokens=False))


class Prompts:
    """Fresh random prompts of exactly n token ids: random lowercase words run through the model's tokenizer, so
    every id is an ordinary token and no two rows (or runs, with a fresh seed) share a prefix."""

    def __init__(self, encode: Callable[[str], list[int]], seed: int) -> None:
        self.encode = encode
        self.rng = random.Random(seed)

    def make(self, n: int) -> list[int]:
        words = n
        while True:
            text = " ".join("".join(self.rng.choices(string.ascii_lowercase, k=self.rng.randint(2, 9)))
                            for _ in range(words))
            ids = self.encode(text)
            if len(ids) >= n:
                return ids[:n]
            words *= 2


def stream_completion(t: Target, model: str, prompt: list[int], max_tokens: int = 5, timeout: float = 600.0
                      ) -> tuple[float, str, dict[str, Any] | None]:
    """Client-side TTFT (seconds to the first streamed token chunk), the greedy output text, and the usage block
    (asked for with stream_options.include_usage; None if the server sends none)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage = None
    with httpx.stream("POST", f"{t.url}/v1/completions", json=body, headers=t.headers(), timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{t.url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter() - t0
                text.append(chunk["choices"][0].get("text", ""))
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{t.url}: no tokens streamed")
    return first, "".join(text), usage


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    v = details.get("cached_tokens")
    return int(v) if v is not None else None


def served_model(t: Target) -> str:
    """The first model id the replica serves (for --model's default); exits with a clear message if unreachable."""
    try:
        r = httpx.get(f"{t.url}/v1/models", headers=t.headers(), timeout=30)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"kvtier bench cross-pod: {t.name} at {t.url} does not serve /v1/models: {e}") from e


def hit_evidence(before: dict[str, float] | None, after: dict[str, float] | None, cached: int | None,
                 log_hit: int | None) -> dict[str, Any]:
    """One request's hit figures by source, the figure used and which sources backed it ('metrics+usage', ...):
    the /metrics delta first (it splits connector from L0 hits), then usage.cached_tokens, then LMCache's log."""
    ext = l0 = None
    if before is not None and after is not None and EXTERNAL_HITS in after:
        ext = int(after[EXTERNAL_HITS] - before.get(EXTERNAL_HITS, 0.0))
        l0 = int(after.get(L0_HITS, 0.0) - before.get(L0_HITS, 0.0))
    sources = [(name, v) for name, v in (("metrics", None if ext is None else ext + (l0 or 0)),
                                         ("usage", cached), ("log", log_hit)) if v is not None]
    return {"external_hit_tokens": ext, "l0_hit_tokens": l0, "cached_tokens": cached,
            "hit_tokens": sources[0][1] if sources else None,
            "evidence": "+".join(name for name, _ in sources) or "none",
            "metrics_usage_agree": None if ext is None or cached is None else ext + (l0 or 0) == cached}


# ---------- what only a local `kvtier up` stack shows ----------

class LogTail:
    """New lines of a replica log since the last call (requests are serial, so they belong to the last one)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.pos = self.path.stat().st_size if self.path.exists() else 0

    def new_text(self) -> str:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return ""
        self.pos += len(data)
        return data.decode("utf-8", "replace")


def lmcache_evidence(text: str) -> dict[str, Any]:
    """hit tokens / retrieved tokens / bytes / load ms from LMCache's log lines of one request."""
    hits = [int(m) for m in HIT_RE.findall(text)]
    ret = RETRIEVED_RE.findall(text)
    return {
        "lmcache_hit_tokens": hits[-1] if hits else None,
        "retrieved_tokens": sum(int(r[0]) for r in ret) if ret else None,
        "retrieved_gib": sum(float(r[2]) for r in ret) if ret else None,
        "retrieve_ms": sum(float(r[3]) for r in ret) if ret else None,
        # LMCache's own "throughput" of the same line: GiB / cost (kept in GB/s here, like the raw read)
        "retrieve_gbps": (sum(float(r[2]) for r in ret) * 2**30 / 1e9 / (sum(float(r[3]) for r in ret) / 1e3)
                          if ret and sum(float(r[3]) for r in ret) > 0 else None),
    }


class L2Meter:
    """l2fs files/bytes used, read from the master: shows what A's store really wrote to L2."""

    def __init__(self, master: str) -> None:
        from l2fs.client import Client

        self.client = Client(master, node_id="bench")

    def snapshot(self) -> tuple[int, int]:
        r = self.client.report()
        return r.files, r.used

    def wait_stored(self, before: tuple[int, int], min_new_files: int, timeout: float = 30.0) -> tuple[int, int]:
        """Wait until A's asynchronous L2 writes for this prompt landed (>= min_new_files and stable). Files
        are the master's namespace (immediate); used bytes are what workers said in their last heartbeat, so
        they are awaited too, or a row would read 0 bytes and the next one this row's."""
        deadline = time.monotonic() + timeout
        last, stable_since = self.snapshot(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            cur = self.snapshot()
            if cur != last:
                last, stable_since = cur, time.monotonic()
            elif (cur[0] - before[0] >= min_new_files and (min_new_files == 0 or cur[1] > before[1])
                  and time.monotonic() - stable_since > 0.3):
                break
        return last[0] - before[0], last[1] - before[1]

    def close(self) -> None:
        self.client.close()


RAW_READ_THREADS = 8  # the plugin's read pool (remote_storage_plugin.l2fs.threads default)


class LocalProbe:
    """Extras of local mode (up.json): wait for A's L2 writes by watching the l2fs master instead of a fixed
    --store-wait, record the bytes written, and add LMCache's log lines as a third hit evidence. With
    `reader_node` it also reads the chunk files a row added, from that node (B's), with the plugin's
    parallelism: the raw cross-node read of the same bytes B's engine loads, in the same run (the floor)."""

    def __init__(self, l2fs_master: str, logs: dict[str, str], kv_prefix: str = "",
                 reader_node: str | None = None) -> None:
        self.meter = L2Meter(l2fs_master)
        self.tails = {name: LogTail(p) for name, p in logs.items()}
        self.before = (0, 0)
        self.kv_prefix = kv_prefix
        self.reader: Any = None
        if reader_node and kv_prefix:
            from l2fs.client import Client

            self.reader = Client(l2fs_master, node_id=reader_node)
        self.paths_before: set[str] = set()

    def chunk_files(self) -> dict[str, int]:
        """path -> size of every file under the KV prefix (model directories below it)."""
        out: dict[str, int] = {}
        todo = [self.kv_prefix]
        while todo:
            for f in self.meter.client.ls(todo.pop()):
                if f.is_dir:
                    todo.append(f.path)
                else:
                    out[f.path] = f.size
        return out

    def start_row(self) -> None:
        for t in self.tails.values():
            t.new_text()
        self.before = self.meter.snapshot()
        if self.reader is not None:
            self.paths_before = set(self.chunk_files())

    def raw_read(self) -> dict[str, Any]:
        """Read the files this row added from the reader's node (8 threads, as the plugin): bytes, ms, GB/s.
        Empty when not measured or nothing new (a read error is recorded, never raised)."""
        if self.reader is None:
            return {}
        from concurrent.futures import ThreadPoolExecutor

        try:
            new = {p: n for p, n in self.chunk_files().items() if p not in self.paths_before}
            if not new:
                return {}
            # one reused buffer per thread, allocated before the clock starts (as the plugin's pool threads)
            bufs = [memoryview(bytearray(max(new.values()))) for _ in range(RAW_READ_THREADS)]
            share = [list(new.items())[i::RAW_READ_THREADS] for i in range(RAW_READ_THREADS)]

            def read(i: int) -> int:
                return sum(self.reader.get_into(p, bufs[i][:n]) or 0 for p, n in share[i])

            t0 = time.perf_counter()
            with ThreadPoolExecutor(RAW_READ_THREADS) as ex:
                got = list(ex.map(read, range(RAW_READ_THREADS)))
            dt = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a side measurement: recorded, the sweep goes on
            return {"raw_read_error": str(e)[:200]}
        nbytes = sum(got)
        return {"raw_read_files": len(new), "raw_read_bytes": nbytes, "raw_read_ms": dt * 1e3,
                "raw_read_gbps": nbytes / dt / 1e9 if dt > 0 else None}

    def wait_stored(self, n: int) -> dict[str, Any]:
        files, nbytes = self.meter.wait_stored(self.before, n // CHUNK)
        return {"l2_new_files": files, "l2_new_bytes": nbytes}

    def request_done(self, name: str) -> dict[str, Any]:
        time.sleep(0.2)  # let the replica flush its log lines
        return lmcache_evidence(self.tails[name].new_text())

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.meter.close()


# ---------- the sweep ----------

def warm_up(a: Target, b: Target, model: str, prompts: Prompts) -> None:
    """First requests pay one-time costs: one on each replica, with prompts never reused."""
    log(f"replica A = {a.name} ({a.node}) {a.url}; replica B = {b.name} ({b.node}) {b.url}; model {model}")
    for r in (a, b):
        stream_completion(r, model, prompts.make(300))


def request(t: Target, model: str, prompt: list[int], probe: LocalProbe | None) -> tuple[dict[str, Any], str]:
    """One streamed request with its hit evidence: (raw row fields, greedy text)."""
    m0 = scrape(t)
    ttft, text, usage = stream_completion(t, model, prompt)
    m1 = counted(t, m0, len(prompt))
    extra = probe.request_done(t.name) if probe else {}
    return ({"replica": t.name, "node": t.node, "ttft_ms": ttft * 1e3,
             **hit_evidence(m0, m1, cached_tokens(usage), extra.get("lmcache_hit_tokens")), **extra}, text)


def run_sweep(a: Target, b: Target, model: str, prompts: Prompts, lengths: list[int], reps: int, *,
              store_wait: float = 2.0, probe: LocalProbe | None = None, warm: bool = True) -> list[dict[str, Any]]:
    """Cold A, cross-pod B, warm A per fresh prompt; one raw row per request. Nothing but HTTP unless a local
    probe is given (then B's row also carries the raw cross-node read of the row's chunk files)."""
    if warm:
        warm_up(a, b, model, prompts)
    raw: list[dict[str, Any]] = []
    for rep in range(reps):
        for n in lengths:
            prompt = prompts.make(n)
            row_base: dict[str, Any] = {"prompt_tokens": n, "rep": rep, "full_chunk_tokens": n // CHUNK * CHUNK}
            if probe:
                probe.start_row()
            outs: dict[str, str] = {}
            for arm, t in zip(ARMS, (a, b, a), strict=True):
                if arm == "L2 hit B":  # A's L2 store is asynchronous: let it land before B asks
                    if probe:
                        row_base.update(probe.wait_stored(n))
                    else:
                        time.sleep(store_wait)
                fields, text = request(t, model, prompt, probe)
                outs[arm] = text
                raw.append({**row_base, "arm": arm, **fields, "same_output_as_cold": text == outs["cold A"]})
            if probe:  # after B's and A's requests: the raw read does not warm anything they measure
                raw[-2].update(floor_fields(probe.raw_read(), raw[-2]))
            last = raw[-3:]
            log(f"{n:>5} tok rep {rep}: " + ", ".join(f"{r['arm']} {r['ttft_ms']:.0f} ms" for r in last)
                + f"; B hit {last[1]['hit_tokens']} tok ({last[1]['evidence']}), cold A hit {last[0]['hit_tokens']}"
                + (f", L2 +{row_base['l2_new_bytes'] / 1e6:.1f} MB" if "l2_new_bytes" in row_base else ""))
    return raw


def floor_fields(read: dict[str, Any], b_row: dict[str, Any]) -> dict[str, Any]:
    """The raw read of the row's chunks and the floor of B's L2 load: the bytes B's LMCache retrieved (else the
    bytes read) / the raw cross-node rate; LMCache's own retrieval rate as a fraction of the raw one."""
    rate = read.get("raw_read_gbps")
    if not rate:
        return read
    nbytes = b_row["retrieved_gib"] * 2**30 if b_row.get("retrieved_gib") else read["raw_read_bytes"]
    lm = b_row.get("retrieve_gbps")
    return {**read, "floor_ms": nbytes / (rate * 1e9) * 1e3, "lmcache_over_raw": lm / rate if lm else None}


def hittable(n: int) -> int:
    """Most prompt tokens a replica can load for an n-token prompt: its full chunks, but vLLM always computes
    at least the last prompt token itself."""
    return min(n // CHUNK * CHUNK, n - 1)


def summarize(raw: list[dict[str, Any]], lengths: list[int]) -> tuple[list[dict[str, Any]], str]:
    rows, out = [], []
    for n in lengths:
        by = {arm: [r for r in raw if r["prompt_tokens"] == n and r["arm"] == arm] for arm in ARMS}
        t = {arm: [r["ttft_ms"] for r in rs] for arm, rs in by.items()}
        b = by["L2 hit B"]
        full, can = n // CHUNK * CHUNK, hittable(n)
        hits = [r["hit_tokens"] or 0 for r in b]
        ext = [r["external_hit_tokens"] for r in b if r["external_hit_tokens"] is not None]
        cached = [r["cached_tokens"] for r in b if r["cached_tokens"] is not None]
        cold = [r["hit_tokens"] for r in by["cold A"] if r["hit_tokens"] is not None]
        ref_n = min(CURVINE, key=lambda k: abs(k - n))
        ref = CURVINE[ref_n] if abs(ref_n - n) <= 300 else None
        s: dict[str, Any] = {
            "prompt_tokens": n, "reps": len(b), "full_chunk_tokens": full, "hittable_tokens": can,
            **{f"{arm}_p50_ms": pct(t[arm], 50) for arm in ARMS},
            **{f"{arm}_p90_ms": pct(t[arm], 90) for arm in ARMS},
            "speedup_cold_over_l2": pct(t["cold A"], 50) / pct(t["L2 hit B"], 50),
            "l2_over_l1": pct(t["L2 hit B"], 50) / pct(t["L0/L1 hit A"], 50),
            "b_hit_tokens_min": min(hits) if hits else None,
            "b_hit_pct_full_chunks": (100.0 * min(min(hits), can) / can) if hits and can > 0 else None,
            "b_external_hit_tokens_min": min(ext) if ext else None,
            "b_cached_tokens_min": min(cached) if cached else None,
            "b_evidence": sorted({r["evidence"] for r in b}),
            "cold_hit_tokens_max": max(cold) if cold else None,
            "l2_bytes_p50": pct([r["l2_new_bytes"] for r in b if r.get("l2_new_bytes") is not None], 50),
            "l2_retrieve_ms_p50": pct([r["retrieve_ms"] for r in b if r.get("retrieve_ms") is not None], 50),
            "same_output_all": all(r["same_output_as_cold"] for r in raw if r["prompt_tokens"] == n),
            "curvine_ref_tokens": ref_n if ref else None,
            "curvine_ref_speedup": ref[0] / ref[1] if ref else None,
            **{f"{k}_p50": pct([r[k] for r in b if r.get(k) is not None], 50)
               for k in ("raw_read_gbps", "floor_ms", "retrieve_gbps", "lmcache_over_raw")},
        }
        s["l2_ttft_over_floor"] = s["L2 hit B_p50_ms"] / s["floor_ms_p50"] if s["floor_ms_p50"] > 0 else None
        rows.append(s)
        out.append([n, len(b), fmt(s["cold A_p50_ms"], 0), fmt(s["cold A_p90_ms"], 0),
                    fmt(s["L2 hit B_p50_ms"], 0), fmt(s["L2 hit B_p90_ms"], 0),
                    fmt(s["L0/L1 hit A_p50_ms"], 0), fmt(s["L0/L1 hit A_p90_ms"], 0),
                    fmt(s["speedup_cold_over_l2"], 2) + "x", fmt(s["l2_over_l1"], 2) + "x",
                    f"{s['b_hit_tokens_min']}/{full}", fmt(s["b_external_hit_tokens_min"], 0),
                    fmt(s["b_cached_tokens_min"], 0), fmt(s["cold_hit_tokens_max"], 0), ",".join(s["b_evidence"]),
                    fmt(s["l2_bytes_p50"] / 1e6, 1), fmt(s["l2_retrieve_ms_p50"], 1),
                    "yes" if s["same_output_all"] else "NO",
                    (f"{fmt(s['curvine_ref_speedup'], 2)}x @{ref_n}" if ref else "-")])
    text = table(
        ["tokens", "reps", "cold p50", "cold p90", "L2(B) p50", "L2(B) p90", "L0/L1(A) p50", "L0/L1(A) p90",
         "cold/L2", "L2/L1", "B hit tok/full", "B ext hit", "B cached", "cold hit", "B evidence", "L2 MB",
         "L2 load ms", "same out", "Curvine ref"],
        out, title="cross-pod TTFT (ms, client-side, streamed; B never saw the prompt before: its hit is L2)")
    return rows, text


def floor_table(rows: list[dict[str, Any]]) -> str | None:
    """B's in-engine L2 load against the raw cross-node read of the same chunk files in the same run (the
    target: LMCache's retrieval at >= 0.7x the raw read, so a hit costs little more than reading its bytes;
    the L2-hit TTFT is reported against that floor); None without raw reads (HTTP-only runs)."""
    if not any(r["raw_read_gbps_p50"] == r["raw_read_gbps_p50"] for r in rows):  # all nan
        return None
    out = [[r["prompt_tokens"], fmt(r["l2_bytes_p50"] / 1e6, 1), fmt(r["raw_read_gbps_p50"], 2),
            fmt(r["floor_ms_p50"], 0), fmt(r["L2 hit B_p50_ms"], 0), fmt(r["l2_ttft_over_floor"], 2) + "x",
            fmt(r["l2_retrieve_ms_p50"], 0), fmt(r["retrieve_gbps_p50"], 2), fmt(r["lmcache_over_raw_p50"], 2) + "x"]
           for r in rows]
    return table(["tokens", "L2 MB", "raw read GB/s", "floor ms", "L2 hit TTFT", "TTFT/floor", "LMCache load ms",
                  "LMCache GB/s", "LMCache/raw"], out,
                 title="L2 load vs the physical floor (raw cross-node read of the same chunk files from B's node, "
                 f"{RAW_READ_THREADS} threads, same run; floor = bytes B retrieved / that rate; p50s)")


def notes(raw: list[dict[str, Any]]) -> list[str]:
    """What the evidence says about the replicas' set-up (missing flags, a cold request that was not cold)."""
    out = []
    if all(r["cached_tokens"] is None for r in raw):
        out.append("note: no usage.prompt_tokens_details.cached_tokens from the replicas: start vLLM with "
                   "--enable-prompt-tokens-details for per-request hit evidence")
    if all(r["external_hit_tokens"] is None for r in raw):
        out.append(f"note: no {EXTERNAL_HITS} on the replicas' /metrics (not vLLM v1, or /metrics not reachable)")
    if any(r["metrics_usage_agree"] is False for r in raw):
        out.append("note: /metrics deltas and usage.cached_tokens disagree on some request: other traffic on the "
                   "replicas during the run? (usage is per request, /metrics per replica)")
    cold = [r for r in raw if r["arm"] == "cold A" and (r["hit_tokens"] or 0) > 0]
    if cold:
        out.append(f"WARNING: {len(cold)} cold request(s) hit a cache: prompts reused from an earlier run with the "
                   "same --seed? Their rows are not a cold baseline")
    return out


def goals(rows: list[dict[str, Any]]) -> str:
    """The cross-pod targets (every full chunk a hit on B; cold/L2 >= 2.7x at ~2.5k tokens, Curvine's GPU
    figure; an L2 hit within 1.25x of a same-pod L0/L1 hit), evaluated on this run (printed, never asserted)."""
    near = min(rows, key=lambda r: abs(r["prompt_tokens"] - 2500))
    hits = [r["b_hit_pct_full_chunks"] for r in rows if r["b_hit_pct_full_chunks"] is not None]
    return "\n".join([
        f"goal: cross-pod hit 100% of full chunks -> min over lengths {fmt(min(hits) if hits else None, 1)}%",
        f"goal: cold/L2 >= 2.7x at ~2.5k tokens -> {fmt(near['speedup_cold_over_l2'], 2)}x at "
        f"{near['prompt_tokens']} (Curvine GPU reference: 2.70x at 2,608)",
        f"goal: L2 within 1.25x of same-pod L0/L1 hit -> {fmt(near['l2_over_l1'], 2)}x at {near['prompt_tokens']}",
    ])
def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["prompt_tokens"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, style in zip(ARMS, ("o-", "s-", "^-"), strict=True):
        ax1.plot(xs, [r[f"{arm}_p50_ms"] for r in rows], style, label=f"{arm} (p50)")
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("TTFT ms")
    ax1.set_yscale("log")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    ax1.set_title("TTFT by arm")
    ax2.plot(xs, [r["speedup_cold_over_l2"] for r in rows], "s-", label="kvtier cold / cross-pod L2")
    ax2.plot(list(CURVINE), [c / w for c, w in CURVINE.values()], "k--", label="Curvine+HyperPod (GPU, 7B)")
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("speedup (x)")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    ax2.set_title("cross-pod speedup over cold")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench cross-pod", description=__doc__.split("\n")[0])
    p.add_argument("--replica-a", metavar="URL", help="replica A's base URL (http://host:port): HTTP-only mode")
    p.add_argument("--replica-b", metavar="URL", help="replica B's base URL, on another node than A")
    p.add_argument("--model", default=None, help="served model name (default: what replica A's /v1/models lists; "
                   "local stack: the tiny local model)")
    p.add_argument("--model-preset", choices=("tiny", "kv8b"), default=None,
                   help="stack started here: serve a local preset model, built under --dir on first use (kv8b: "
                   "Llama-3.1-8B's 128 KiB of KV per token, 32 MiB chunks; see `kvtier model kv8b`)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path/name for the prompts (default: replica A's "
                   "own /tokenize endpoint)")
    p.add_argument("--api-key", default=kvtier_envs.get("KVTIER_BENCH_API_KEY"),
                   help="bearer token for the replicas (default $KVTIER_BENCH_API_KEY)")
    p.add_argument("--lengths", default=None, help="prompt lengths in tokens, comma separated")
    p.add_argument("--reps", type=int, default=3, help="fresh prompts per length (default 3)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: lengths 300,600, 1 rep")
    p.add_argument("--store-wait", type=float, default=2.0,
                   help="HTTP mode: seconds between A's cold request and B's (A's L2 store is asynchronous)")
    p.add_argument("--from-up", type=Path, default=None,
                   help="reuse a running `kvtier up` (its <dir>/up.json) instead of starting a stack")
    p.add_argument("--dir", type=Path, default=Path(".kvtier/bench-cross-pod"), help="stack dir if started here")
    p.add_argument("--l1-gb", type=float, default=1.0)
    p.add_argument("--mode", choices=("plugin", "mount"), default=None,
                   help="stack started here: plugin (our connector, default) or mount (stock fs:// on each node's "
                   "l2fs mount); with --from-up it is read from up.json")
    p.add_argument("--mount-server", choices=("auto", "passthrough", "pyfuse3"), default=None,
                   help="stack started here with --mode mount: each node's mount (kvtier up --mount-server; default "
                   "auto: passthrough where the kernel grants it)")
    p.add_argument("--netns", action="store_true",
                   help="stack started here: each node in its own network namespace (docs/netns.md)")
    p.add_argument("--link", default=None, metavar="RATE", help="with --netns: each node's link rate, e.g. 2gbit")
    p.add_argument("--tcp-mb", type=float, default=50.0,
                   help="MB per plain TCP probe of the A-node -> B-node link (3 probes, after the sweep)")
    p.add_argument("--seed", type=int, default=None,
                   help="prompt seed (default: a fresh one per run, recorded, so a rerun is cold too)")
    p.add_argument("--prefill-tokens-per-s", default=None, metavar="N|auto",
                   help="stack started here (plugin mode): the engines' prefill rate for the L2 load gate "
                   "(connector.loadgate); auto = measured: a cold prompt of the shortest length on A after the "
                   "warm-up, its tokens / TTFT, handed to the running replicas through a file; printed")
    p.add_argument("--throttle-l2", default=None, metavar="SPEC",
                   help="stack started here: instead of the sweep, B's L2 hit vs recompute with the l2fs worker "
                   "holding A's chunks throttled: stop:ON/OFF (SIGSTOP/SIGCONT seconds, e.g. stop:2.7/0.3) or "
                   "rate:RATE (--netns: A's node link, e.g. rate:20mbit); healthy phase beside it "
                   "(kvtier.bench.cross_pod_throttle)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where JSON/CSV/PNG go")
    return p


def _local_targets(state: Any, api_key: str | None) -> tuple[Target, Target, LocalProbe]:
    """A and B from a `kvtier up` state: the first replica and the first one on another l2fs node."""
    a = state.replicas[0]
    others = [r for r in state.replicas[1:] if r.node_id != a.node_id]
    if not others:
        raise SystemExit("kvtier bench cross-pod: needs two replicas on different l2fs nodes")
    b = others[0]
    # with --netns the master's own address is inside the namespaces: the host reaches it by a forwarder
    probe = LocalProbe(state.host_l2fs_master or state.l2fs_master, {a.name: a.log_path, b.name: b.log_path},
                       kv_prefix=state.kv_prefix, reader_node=b.node_id)
    return (Target(a.name, a.url, a.node_id, api_key), Target(b.name, b.url, b.node_id, api_key), probe)


def link_tcp(state: Any, a: Target, b: Target, nbytes: int, net: Any = None) -> tuple[list[float], str | None]:
    """Plain TCP throughput (bits/s, 3 probes) from A's node to B's node and the link rate: over the stack's
    namespaces (net, or attached by up.json's prefix) or, without --netns, over loopback."""
    if not state.netns:
        from kvtier.bench.l2 import tcp_stream_gbps

        return [g * 8e9 for g in tcp_stream_gbps(nbytes, 3)], None
    from l2fs.testing.netns import NetnsCluster

    if net is None:
        net = NetnsCluster.attach(state.netns["prefix"])
    rates = {n["name"]: n.get("rate") for n in state.netns["nodes"]}
    link = rates.get(a.node) or rates.get(b.node)
    return [net.tcp_throughput(a.node, b.node, nbytes) for _ in range(3)], link


def _check_stack_args(args: argparse.Namespace, http_mode: bool) -> str | None:
    """The stack options only make sense for a stack started here: an error message, or None."""
    if args.link and not args.netns:
        return "--link needs --netns (loopback has no link to shape)"
    if (http_mode or args.from_up) and (args.mode or args.netns):
        return "--mode/--netns/--link are for a stack started here (--from-up reads them from up.json)"
    if args.mount_server and args.mode != "mount":
        return "--mount-server needs --mode mount (a stack started here)"
    if args.model_preset and (http_mode or args.from_up or args.model):
        return "--model-preset builds the model for a stack started here (not with --model/--from-up/--replica-*)"
    if (args.throttle_l2 or args.prefill_tokens_per_s) and (http_mode or args.from_up):
        return ("--throttle-l2/--prefill-tokens-per-s need a stack started here (the bench signals its worker and "
                "sets its replicas' env)")
    if args.prefill_tokens_per_s and (args.mode or "plugin") != "plugin":
        return "--prefill-tokens-per-s: the load gate is in the l2fs plugin (--mode plugin)"
    if args.prefill_tokens_per_s not in (None, "auto"):
        try:
            if float(args.prefill_tokens_per_s) < 0:
                raise ValueError
        except ValueError:
            return f"--prefill-tokens-per-s {args.prefill_tokens_per_s!r}: a number of tokens/s >= 0, or auto"
    if args.throttle_l2:
        from kvtier.bench.cross_pod_throttle import parse_throttle

        try:
            spec = parse_throttle(args.throttle_l2)
        except ValueError as e:
            return str(e)
        if spec.kind == "rate" and not args.netns:
            return "--throttle-l2 rate:... shapes a node link: needs --netns"
    if args.link:
        from l2fs.testing.netns import NetnsError, parse_rate

        try:
            parse_rate(args.link)
        except NetnsError as e:
            return str(e)
    return None


def measure_prefill(a: Target, model: str, prompts: Prompts, n: int, path: Path) -> dict[str, Any]:
    """`--prefill-tokens-per-s auto`: the median cold TTFT of 3 fresh n-token prompts on A -> tokens/s (one
    request on a shared box can be 2x off), written to the file the replicas' plugins watch
    (connector.config.watch_prefill_file); waits until they re-read it."""
    from connector.config import read_prefill_file

    ttfts = [stream_completion(a, model, prompts.make(n))[0] for _ in range(3)]
    ttft = pct(ttfts, 50)
    figure = n / ttft
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{figure:.1f}\n")
    tmp.replace(path)
    time.sleep(2.5)  # the plugins poll the file every 2 s
    assert read_prefill_file(path) > 0
    return {"figure": figure, "how": f"auto: {n} tokens cold on A, median TTFT {ttft * 1e3:.0f} ms of "
            + "/".join(f"{t * 1e3:.0f}" for t in ttfts), "auto_tokens": n, "auto_ttft_ms": [t * 1e3 for t in ttfts]}


def _prefill_env(args: argparse.Namespace, path: Path) -> dict[str, str]:
    """The replicas' env for the load gate: a fixed figure, or (auto) the file measure_prefill writes later."""
    from connector.config import PREFILL_FILE_ENV
    from kvtier.up import prefill_env

    if args.prefill_tokens_per_s == "auto":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a figure of an earlier run must not open the gate before we measured
        return {PREFILL_FILE_ENV: str(path)}
    return prefill_env(float(args.prefill_tokens_per_s) if args.prefill_tokens_per_s else None)


def floor_goal(rows: list[dict[str, Any]]) -> str:
    ratios = [(r["lmcache_over_raw_p50"], r["prompt_tokens"]) for r in rows if r["lmcache_over_raw_p50"] > 0]
    if not ratios:
        return "goal: LMCache L2 retrieval >= 0.70x the raw cross-node read -> not measured"
    worst = min(ratios)
    return (f"goal: LMCache L2 retrieval >= 0.70x the raw cross-node read -> worst {fmt(worst[0], 2)}x at "
            f"{worst[1]} ({'met' if worst[0] >= 0.7 else 'NOT met'})")


def _report_throttled(args: argparse.Namespace, raw: list[dict[str, Any]], lengths: list[int], reps: int,
                      model: str, seed: int, prefill: dict[str, Any]) -> int:
    from kvtier.bench.cross_pod_throttle import goal_line, summarize_throttled

    rows, text = summarize_throttled(raw, lengths)
    print(f"cross-pod, L2 throttled ({args.throttle_l2}): prefill figure "
          f"{fmt(prefill['figure'], 0)} tokens/s ({prefill['how']})")
    print(text)
    print(goal_line(rows))
    summary = {"mode": "local-throttle", "throttle": args.throttle_l2, "lengths": lengths, "reps": reps,
               "model": model, "seed": seed, "prefill": prefill, "rows": rows, "netns": args.netns,
               "link": args.link}
    for p in write_results(args.out, "cross_pod_throttle", summary, raw):
        print(f"wrote {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lengths, reps = (QUICK_LENGTHS, 1) if args.quick else (DEFAULT_LENGTHS, args.reps)
    if args.lengths:
        try:
            lengths = [int(x) for x in args.lengths.split(",")]
        except ValueError:
            print(f"kvtier bench cross-pod: bad --lengths {args.lengths!r}", file=sys.stderr)
            return 2
    if reps < 1 or any(n < CHUNK for n in lengths):
        print(f"kvtier bench cross-pod: --reps >= 1 and every length >= {CHUNK} (one LMCache chunk)",
              file=sys.stderr)
        return 2
    http_mode = bool(args.replica_a or args.replica_b)
    if http_mode and not (args.replica_a and args.replica_b):
        print("kvtier bench cross-pod: give both --replica-a and --replica-b", file=sys.stderr)
        return 2
    if http_mode and args.from_up:
        print("kvtier bench cross-pod: --replica-a/--replica-b and --from-up exclude each other", file=sys.stderr)
        return 2
    bad = _check_stack_args(args, http_mode)
    if bad:
        print(f"kvtier bench cross-pod: {bad}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    tcp_bps: list[float] = []
    link: str | None = None
    state: Any = None
    nbytes = int(args.tcp_mb * 1e6)

    prefill: dict[str, Any] = {"figure": None if args.prefill_tokens_per_s in (None, "auto")
                               else float(args.prefill_tokens_per_s), "how": args.prefill_tokens_per_s or "off"}
    prefill_file = args.dir.resolve() / "prefill_tokens_per_s"

    def measure_local(state: Any, stack: Any = None) -> list[dict[str, Any]]:
        nonlocal tcp_bps, link
        a, b, probe = _local_targets(state, args.api_key)
        log(f"stack: mode {state.mode}, " + (f"netns {state.netns['prefix']}-*" if state.netns else "loopback"))
        out = measure(a, b, probe, state.model, stack)
        tcp_bps, link = link_tcp(state, a, b, nbytes, stack.net if stack is not None else None)
        return out

    def measure(a: Target, b: Target, probe: LocalProbe | None, model: str, stack: Any = None
                ) -> list[dict[str, Any]]:
        encode = local_tokenizer(args.tokenizer) if args.tokenizer else remote_tokenizer(a, model)
        prompts = Prompts(encode, seed)
        try:
            warm_up(a, b, model, prompts)
            if args.prefill_tokens_per_s == "auto":
                prefill.update(measure_prefill(a, model, prompts, min(lengths), prefill_file))
            if prefill["figure"]:
                log(f"load gate: prefill figure {prefill['figure']:.0f} tokens/s ({prefill['how']})")
            if args.throttle_l2:
                from kvtier.bench.cross_pod_throttle import Throttle, parse_throttle, run_throttled

                assert probe is not None and stack is not None  # _check_stack_args: a stack started here
                throttle = Throttle(parse_throttle(args.throttle_l2), stack, a.node)
                return run_throttled(a, b, model, prompts, lengths, reps, probe, throttle)
            return run_sweep(a, b, model, prompts, lengths, reps, store_wait=args.store_wait, probe=probe,
                             warm=False)
        finally:
            if probe:
                probe.close()

    if http_mode:
        a = Target("A", args.replica_a, api_key=args.api_key)
        b = Target("B", args.replica_b, api_key=args.api_key)
        model = args.model or served_model(a)
        served_model(b)  # both reachable before anything is measured
        raw = measure(a, b, None, model)
    else:
        from kvtier.up import Stack, StackState

        if args.from_up:
            state = StackState.load(args.from_up)
            model = state.model
            raw = measure_local(state)
        else:
            if args.model_preset:
                from kvtier.devstack.tiny_model import preset_model

                args.model = str(preset_model(args.dir, args.model_preset))
            with Stack(args.dir, replicas=2, workers=2, model=args.model, strategy=None, l1_gb=args.l1_gb,
                       max_model_len=max(8192, max(lengths) + 64), mode=args.mode or "plugin",
                       mount_server=args.mount_server or "auto",
                       netns=args.netns, link=args.link, replica_env=_prefill_env(args, prefill_file)) as stack:
                state = StackState.load(stack.state_path)
                model = state.model
                raw = measure_local(state, stack)
    if args.throttle_l2:
        return _report_throttled(args, raw, lengths, reps, model, seed, prefill)
    rows, text = summarize(raw, lengths)
    stack_mode = state.mode if state is not None else None
    netns = bool(state is not None and state.netns)
    if state is not None:
        where = f"netns link {link or 'unshaped'}" if netns else "loopback"
        servers = sorted(set(state.mount_servers.values()))
        print(f"cross-pod: mode {stack_mode}" + (f" ({'/'.join(servers)} mount)" if servers else "") + f", {where}")
    print(text)
    ftext = floor_table(rows)
    if ftext:
        print(ftext)
        print(floor_goal(rows))
    print(goals(rows))
    for line in notes(raw):
        print(line)
    if tcp_bps:
        print(link_line(tcp_bps, link, "A's node -> B's node" if netns else "loopback, A -> B"))
    args.out.mkdir(parents=True, exist_ok=True)
    png: Path | None = args.out / "cross_pod.png"
    where = (f"{args.replica_a} -> {args.replica_b}" if http_mode else
             f"local kvtier up, CPU, {stack_mode}, " + (f"netns {link or 'unshaped'}" if netns else "loopback"))
    try:
        plot(rows, args.out / "cross_pod.png", f"kvtier cross-pod TTFT, {Path(model).name}, {where} ({reps} reps)")
    except ImportError:  # the kvtier image (in-cluster Job) has no matplotlib: table + JSON/CSV only
        print("no matplotlib: plot skipped (pip install matplotlib, or kvtier[bench])")
        png = None
    summary = {"mode": "http" if http_mode else "local", "replica_a": args.replica_a, "replica_b": args.replica_b,
               "lengths": lengths, "reps": reps, "model": model, "seed": seed, "rows": rows, "notes": notes(raw),
               "l2_mode": stack_mode, "netns": netns, "link": link,
               "mount_servers": state.mount_servers if state is not None else {},
               "link_tcp_gbit": pct(tcp_bps, 50) / 1e9 if tcp_bps else None,
               "link_tcp_gbit_all": [b / 1e9 for b in tcp_bps], "prefill": prefill,
               "shaper_bound": shaper_bound(pct(tcp_bps, 50), link) if tcp_bps else None}
    for p in [*write_results(args.out, "cross_pod", summary, raw), *([png] if png else [])]:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
