"""Small helpers shared by the benchmarks: percentiles, process memory, plain-text tables, raw-result files, one
streamed chat turn."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx


def pct(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation; nan for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stream_chat(http: httpx.Client, url: str, model: str, messages: list[dict[str, str]], answer_tokens: int,
                session_key: str, *, exact_length: bool = True,
                headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One streamed chat turn through a router or replica, as the multi-turn benches send it: TTFT (the first
    token, not the role-only first chunk), end-to-end, TPOT, output tokens, prompt/cached tokens (usage) and
    the answer text (the caller appends it to the history). `exact_length` asks for exactly `answer_tokens`
    (ignore_eos), so arms decode the same number of tokens; the session key goes in `user` and the session
    headers the session router reads. Faults come back as ok=False with the error, never as an exception."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": answer_tokens, "temperature": 0,
                            "stream": True, "user": session_key, "stream_options": {"include_usage": True}}
    if exact_length:
        body.update(min_tokens=answer_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    err = ""
    chunks = 0
    try:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                         headers={**(headers or {}), "x-session-id": session_key, "x-user-id": session_key}) as resp:
            if resp.status_code != 200:
                resp.read()
                err = f"HTTP {resp.status_code}: {resp.text[:200]}"
            else:
                for line in resp.iter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("choices"):
                        chunks += 1
                        delta = chunk["choices"][0].get("delta", {}).get("content") or ""
                        # the first chunk may carry only the role; a token that decodes to "" still counts
                        if first is None and (delta or chunks >= 2):
                            first = time.perf_counter() - t0
                        text.append(delta)
    except (httpx.HTTPError, ValueError) as e:
        err = repr(e)
    e2e = time.perf_counter() - t0
    out_tokens = usage.get("completion_tokens") or 0
    ok = first is not None and not err
    return {"ok": ok, "error": err, "sent_at": t0, "ttft_ms": first * 1e3 if first is not None else None,
            "e2e_ms": e2e * 1e3, "output_tokens": out_tokens,
            "tpot_ms": ((e2e - first) * 1e3 / (out_tokens - 1)) if ok and first is not None and out_tokens > 1
            else None,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "text": "".join(text)}


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process, from /proc (0 if it is gone): the leak signal of long runs."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0


def fmt(v: Any, nd: int = 1) -> str:
    """Numbers right-sized for a table; '-' for missing."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A fixed-width text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(cells[0], widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where the numbers came from (goes into every JSON result)."""
    import os
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "git_commit": commit,
        "load_avg_1m": load,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def write_results(out: Path, name: str, summary: dict[str, Any], raw: list[dict[str, Any]]) -> list[Path]:
    """<out>/<name>.json (summary + raw) and <out>/<name>.csv (raw rows)."""
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / f"{name}.json"
    jpath.write_text(json.dumps({"env": environment(), "summary": summary, "raw": raw}, indent=2,
                                default=str))
    paths = [jpath]
    if raw:
        cpath = out / f"{name}.csv"
        keys: list[str] = []
        for r in raw:
            keys += [k for k in r if k not in keys]
        with cpath.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(raw)
        paths.append(cpath)
    return paths


SHAPER_BOUND_TOLERANCE = 0.15


def shaper_bound(measured_bps: float, link: str | None) -> bool | None:
    """Was the tc shaper the bound? Measured TCP within 15% of the --link rate (None when unshaped).
    A number far below the rate means the CPU (or something else) was the bound, not the link."""
    if not link:
        return None
    from l2fs.testing.netns import parse_rate

    rate = parse_rate(link)
    return abs(measured_bps - rate) <= SHAPER_BOUND_TOLERANCE * rate


def link_line(measured_bps: list[float], link: str | None, what: str) -> str:
    """One line for the report: the plain TCP throughput of the link and whether the shaper bound it."""
    med = pct(measured_bps, 50)
    rate = f"link {link}" if link else ("no link" if what.startswith("loopback") else "link unshaped")
    bound = shaper_bound(med, link)
    verdict = "" if bound is None else (" -> the shaper was the bound" if bound
                                        else " -> NOT the shaper's rate: something else (CPU) was the bound")
    return f"{what} ({rate}): plain TCP {fmt(med / 1e9, 2)} Gbit/s p50 of {len(measured_bps)}{verdict}"
