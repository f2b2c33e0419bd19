"""`kvtier bench workload`: a fleet without kvtier against each tier and router, under a multi-turn load whose
contexts outgrow L0+L1 of every replica.

Workload (seeded, so a rerun sends the same schedule): sessions arrive as a Poisson process at a set rate. A new
session is a new user asking questions over one of a few long shared documents (LMCache's long_doc_qa shape:
many users, one document each), turn after turn with an exponential think time, each turn carrying the whole
history (multi_round_qa's growing prompt). A share of the arrivals are users who come back after at least
`--return-gap` other sessions started: by then the documents and histories sent in between exceed L0 (vLLM's
KV cache, sized with VLLM_CPU_KVCACHE_SPACE or, below 1 GiB, --kv-cache-memory-bytes) plus L1 (LMCache's
max_local_cpu_size) of all replicas together, so without L2 a returning user recomputes the conversation. The
run prints that comparison (distinct context tokens against L0+L1 tokens).

Arms run on the same replicas; the replicas are restarted only when an arm's tier differs from the running one,
and the arms are ordered by tier so that this happens three times (none -> L1 -> L2 plugin -> L2 mount). Arms of
one tier are interleaved at each offered load (their order rotates per load). Every arm and step gets its own
nonce in the documents, so no arm profits from KV an earlier one left behind. Offered load is swept over
--rates (sessions/s) until the arm's TTFT P90 breaks --slo-ms.

Per step: TTFT P50/P90/P99, TPOT, end-to-end latency, achieved requests/s and output tokens/s (client side,
streamed chat completions); hits by tier from the replicas' own counters (deltas over the step): L0 =
vllm:prefix_cache_hits_total, L1+L2 = vllm:external_prefix_cache_hits_total (tokens the KV connector loaded),
L2 = LMCache's lmcache:num_remote_read_bytes / KV bytes per token (exported on the replica's /metrics because
each replica runs with its own PROMETHEUS_MULTIPROC_DIR); cost = engine-busy seconds per request, from vLLM's
vllm:request_prefill_time_seconds + vllm:request_decode_time_seconds sums. Each arm's figures are printed as a
change against the baseline next to the published ones (HyperPod, Curvine + HyperPod).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.common import environment, fmt, pct, stream_chat, table, write_results
from kvtier.bench.cross_pod import parse_counters
from kvtier.up import Stack, StackState, log

# arm -> (tier, router kind, policy). Tier: none = vLLM alone (its own prefix cache), l1 = + LMCache L1,
# plugin = + l2fs L2 through our LMCache plugin, mount = + stock LMCache fs:// on each node's l2fs mount.
ARMS: dict[str, tuple[str, str, str]] = {
    "baseline": ("none", "vllm-router", "round_robin"),
    "+L1": ("l1", "vllm-router", "round_robin"),
    "+L2 plugin": ("plugin", "vllm-router", "round_robin"),
    "L2 kvtier roundrobin": ("plugin", "kvtier", "roundrobin"),  # kvtier's router, cache-blind: its own cost
    "L2 prefixaware": ("plugin", "kvtier", "prefixaware"),
    "L2 kvaware": ("plugin", "kvtier", "kvaware"),
    "L2 session": ("plugin", "kvtier", "session"),
    "L2 vllm-router cache_aware": ("plugin", "vllm-router", "cache_aware"),
    "+L2 mount": ("mount", "vllm-router", "round_robin"),
}
TIER_ORDER = ("none", "l1", "plugin", "mount")
QUICK_ARMS = "baseline,+L2 plugin,L2 prefixaware"

COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "queries": "vllm:prefix_cache_queries_total",
    "l0_hits": "vllm:prefix_cache_hits_total",
    "ext_hits": "vllm:external_prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "decode_s": "vllm:request_decode_time_seconds_sum",
    "l2_read_bytes": "lmcache:num_remote_read_bytes_total",
    "lmc_hit_tokens": "lmcache:num_hit_tokens_total",
}

# Published figures (docs/results.md quotes them beside ours): the reference design's headline.
PUBLISHED = {
    "ttft_p50": "HyperPod -94% P50 (64K, 70B; -72% at 8K); other account up to -40%",
    "ttft_p90": "HyperPod -35% P90 (64K; -40% at 8K)",
    "throughput": "HyperPod +38% (64K), +24% (8K); other account up to +25%",
    "cost": "HyperPod -28% (64K), -21% (8K); other account up to -25%",
    "short": "Curvine + HyperPod 0.99x at ~500 tokens (no gain, no loss)",
    "long": "Curvine + HyperPod 1.7x @~1k, 2.7x @~2.5k, 2.2x @~3k; 1.30x over a 4-turn conversation",
}


# ---------- the workload: documents, users, sessions, a seeded schedule ----------

@dataclass
class User:
    """One user: the document they ask about and their conversation so far (shared by their sessions)."""

    uid: int
    session_key: str
    doc: int
    messages: list[dict[str, str]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Session:
    """One visit of a user: arrival offset (s), its questions and the think time before each."""

    index: int
    user: User
    arrival: float
    returning: bool
    questions: list[str]
    think: list[float]
    after: Session | None = None  # a returning session starts only after the user's previous one ended


@dataclass
class Plan:
    docs: list[str]
    sessions: list[Session]
    doc_tokens: int


def fixed_tokens(encode: Any, decode: Any, rng: random.Random, n: int, words: tuple[str, ...]) -> str:
    """Text that the model's tokenizer turns into ~n tokens (random words, cut at n tokens)."""
    k = n
    while True:
        ids = encode(" ".join(rng.choice(words) for _ in range(k)))
        if len(ids) >= n:
            return str(decode(ids[:n]))
        k *= 2


def make_plan(seed: int, *, rate: float, sessions: int, docs: int, doc_tokens: int, turns: int,
              think_s: float, return_share: float, return_gap: int, question_words: int, nonce: str,
              encode: Any, decode: Any) -> Plan:
    """The schedule of one step: Poisson arrivals at `rate` sessions/s; each arrival is, with probability
    return_share, a user who left at least return_gap arrivals ago coming back (if one is waiting), else a new
    user on a random document."""
    from kvtier.bench.routing_sim import WORDS

    rng = random.Random(seed)
    words = tuple(WORDS)
    texts = [f"[{nonce} document {d}] " + fixed_tokens(encode, decode, rng, doc_tokens, words) for d in range(docs)]
    t = 0.0
    out: list[Session] = []
    users: list[User] = []
    left: list[tuple[int, User]] = []  # (arrival index of the last visit, user) of users who may come back
    for i in range(sessions):
        t += rng.expovariate(rate)
        back = [(j, u) for j, u in left if i - j >= return_gap]
        if back and rng.random() < return_share:
            j, user = back[0]
            left.remove((j, user))
            prev = next(s for s in reversed(out) if s.user is user)
            returning = True
        else:
            user = User(len(users), f"{nonce}-user-{len(users)}", rng.randrange(docs))
            users.append(user)
            prev, returning = None, False
            left.append((i, user))
        qs = [f"question {k} of user {user.uid} visit {i}: " + " ".join(rng.choice(words) for _ in
                                                                        range(question_words))
              for k in range(turns)]
        out.append(Session(i, user, t, returning, qs, [rng.expovariate(1 / think_s) if think_s > 0 else 0.0
                                                       for _ in range(turns)], prev))
    return Plan(texts, out, doc_tokens)


# ---------- running a step: one thread per session, streamed chat completions ----------

def run_session(s: Session, plan: Plan, url: str, model: str, answer_tokens: int, t_start: float,
                deadline: float, results: list[dict[str, Any]]) -> None:
    if s.after is not None:
        s.after.user.done.wait(timeout=max(0.0, deadline - time.monotonic()))
    user = s.user
    delay = t_start + s.arrival - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    if not user.messages:
        user.messages = [{"role": "system", "content": "Answer questions about this document.\n" + plan.docs[user.doc]}]
    with httpx.Client(timeout=httpx.Timeout(600, connect=30)) as http:
        for k, q in enumerate(s.questions):
            if k:
                time.sleep(s.think[k])
            if time.monotonic() > deadline:  # the step ran past its time: the rest of this visit is not sent
                results.append({"session": s.index, "user": user.uid, "turn": k, "returning": s.returning,
                                "skipped": True, "ok": False})
                continue
            user.messages.append({"role": "user", "content": q})
            r = stream_chat(http, url, model, user.messages, answer_tokens, user.session_key)
            user.messages.append({"role": "assistant", "content": r.pop("text") or "ok"})
            results.append({"session": s.index, "user": user.uid, "turn": k, "returning": s.returning,
                            "skipped": False, **r})
    user.done.set()


# kvaware's L2 lookup results, as the router labels kvtier_router_l2_lookups_total
L2_RESULTS = ("hit", "miss", "failed", "skipped")
# kvtier's router's own series: its time per request, beside the engines' (is a slower arm the router or the policy?)
ROUTER_SERIES = {**{f"{what}_{part}": f"kvtier_router_{what}_seconds_{part}"
                    for what in ("overhead", "tokenize") for part in ("sum", "count")},
                 **{f"l2_{result}": f'kvtier_router_l2_lookups_total{{result="{result}"}}' for result in L2_RESULTS}}


def router_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean routing overhead and tokenize time per request of kvtier's router over a step (None: no request)."""
    out: dict[str, float | None] = {}
    for what in ("overhead", "tokenize"):
        n = after.get(f"{what}_count", 0.0) - before.get(f"{what}_count", 0.0)
        t = after.get(f"{what}_sum", 0.0) - before.get(f"{what}_sum", 0.0)
        out[f"router_{what}_ms"] = 1e3 * t / n if n > 0 else None
    if any(k.startswith("l2_") for k in after):  # kvaware with L2: lookups asked (by result) and skipped
        for result in L2_RESULTS:
            out[f"router_l2_{result}"] = after.get(f"l2_{result}", 0.0) - before.get(f"l2_{result}", 0.0)
    return out


def scrape(url: str, series: dict[str, str] = COUNTERS) -> dict[str, float]:
    """{key: value summed over label sets} of the given /metrics series; {} when the page cannot be read."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    got = parse_counters(text, tuple(series.values()))
    return {k: got[m] for k, m in series.items() if m in got}


def settled(urls: list[str], quiet: float = 11.0, timeout: float = 40.0) -> list[dict[str, float]]:
    """Counters once no scrape has changed for `quiet` seconds. vLLM updates /metrics a moment after the
    response, but LMCache publishes its counters (the L2 read bytes among them) from a logger thread every 10 s
    (LMCacheStatsLogger's log_interval): two scrapes 1 s apart could agree before the last interval was
    published, and an arm's L2 reads then counted in no arm."""
    cur, end = [scrape(u) for u in urls], time.monotonic() + timeout
    changed = time.monotonic()
    while time.monotonic() < end and time.monotonic() - changed < quiet:
        time.sleep(1.0)
        nxt = [scrape(u) for u in urls]
        if nxt != cur:
            cur, changed = nxt, time.monotonic()
    return cur


def deltas(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float | None]:
    """Sum over replicas of each counter's change; None where a replica does not export it."""
    out: dict[str, float | None] = {}
    for k in COUNTERS:
        vals = [a.get(k) - b.get(k, 0.0) for a, b in zip(after, before, strict=True) if a.get(k) is not None]
        out[k] = sum(vals) if vals else None
    return out


def summarize_step(rows: list[dict[str, Any]], d: dict[str, float | None], wall: float, kv_bpt: int,
                   slo_ms: float) -> dict[str, Any]:
    sent = [r for r in rows if not r["skipped"]]
    ok = [r for r in sent if r["ok"]]
    ttft = [r["ttft_ms"] for r in ok]
    first = min((r["sent_at"] for r in ok), default=0.0)
    last = max((r["sent_at"] + r["e2e_ms"] / 1e3 for r in ok), default=0.0)
    span = max(last - first, 1e-9)
    ret = [r["ttft_ms"] for r in ok if r["returning"] and r["turn"] == 0]
    reqs = d.get("requests") or 0
    busy = (d.get("prefill_s") or 0) + (d.get("decode_s") or 0)
    l2_tokens = (d["l2_read_bytes"] / kv_bpt) if d.get("l2_read_bytes") is not None else None
    prompt = d.get("prompt_tokens") or 0
    s = {
        "requests": len(rows), "sent": len(sent), "ok": len(ok), "skipped": len(rows) - len(sent),
        "errors": sorted({r["error"] for r in sent if r.get("error")})[:3],
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None], 50),
        "e2e_p50_ms": pct([r["e2e_ms"] for r in ok], 50), "e2e_p90_ms": pct([r["e2e_ms"] for r in ok], 90),
        "return_ttft_p50_ms": pct(ret, 50), "returns": len(ret),
        "req_per_s": len(ok) / span if ok else 0.0,
        "out_tok_per_s": sum(r["output_tokens"] for r in ok) / span if ok else 0.0,
        "wall_s": wall, "prompt_tokens": prompt,
        "mean_prompt_tokens": (sum(r["prompt_tokens"] or 0 for r in ok) / len(ok)) if ok else None,
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "l0_hit_tokens": d.get("l0_hits"), "ext_hit_tokens": d.get("ext_hits"), "l2_hit_tokens": l2_tokens,
        # LMCache reads whole chunks from L2, vLLM counts only the tokens beyond its own L0 hit: the bytes read
        # can exceed the connector's hits, so L1 here is a lower bound (connector hits not read from L2)
        "l1_hit_tokens": max(0.0, d["ext_hits"] - l2_tokens) if d.get("ext_hits") is not None and l2_tokens
        is not None else d.get("ext_hits"),
        "engine_requests": reqs, "busy_s_per_req": busy / reqs if reqs else None,
    }
    for tier in ("l0", "l1", "l2", "ext"):
        v = s.get(f"{tier}_hit_tokens")
        s[f"{tier}_hit_rate"] = v / prompt if v is not None and prompt else None
    s["slo_ok"] = bool(ok) and len(ok) == len(sent) and s["skipped"] == 0 and s["ttft_p90_ms"] <= slo_ms
    return s


# ---------- the fleet: one l2fs cluster, replicas (re)started per tier ----------

def keep_logs(logs: Path) -> Path | None:
    """Move an earlier run's logs aside (logs-<its last write, UTC>) so this run's do not overwrite them: two runs
    with one --dir once lost the router log that would have explained a failed request. Returns where they went."""
    try:
        entries = list(logs.iterdir())
    except OSError:
        return None
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(max(e.stat().st_mtime for e in entries)))
    dest, n = logs.with_name(f"logs-{stamp}"), 1
    while dest.exists():
        n += 1
        dest = logs.with_name(f"logs-{stamp}-{n}")
    logs.rename(dest)
    return dest


class Fleet(Stack):
    """`kvtier up`'s Stack (l2fs master + workers, mounts when a mount arm runs) whose replicas are restarted
    per tier: none (vLLM alone), l1 (LMCache, no L2), plugin (l2fs connector) or mount (fs:// on the mount)."""

    def __init__(self, base: Path, *, replicas: int, model: str, l0_bytes: int, l1_gb: float, max_model_len: int,
                 mount: bool) -> None:
        super().__init__(base, replicas=replicas, workers=replicas, model=model, strategy=None, l1_gb=l1_gb,
                         max_model_len=max_model_len, prefix_caching=True, mode="mount" if mount else "plugin")
        self.l0_bytes = l0_bytes
        self.tier: str | None = None
        self.starts: list[dict[str, Any]] = []
        self.failed: set[str] = set()
        self.routers: dict[tuple[str, str], tuple[Any, str]] = {}  # (kind, policy) -> (process, url), this tier
        self.router_args: list[str] = []  # extra `kvtier router` arguments (--router-args)

    def arm_router(self, kind: str, policy: str) -> str:
        """The URL of this tier's router of that kind/policy (started once per tier: kvaware's start is slow)."""
        from kvtier.bench.routing import start_router

        if (kind, policy) not in self.routers:
            self.routers[kind, policy] = start_router(kind, policy, self.state(), self.base / "logs",
                                                      self.router_args)
        return self.routers[kind, policy][1]

    def stop_routers(self) -> None:
        from l2fs import procs

        for proc, _ in self.routers.values():
            procs.stop(proc, grace=10)
        self.routers = {}

    def start_l2fs(self) -> None:
        # an empty L2 per run, as every tier's L0/L1 are (fresh replicas): the workers' data under --dir outlives
        # the run, and a rerun with the same --dir and --seed sends the same documents, which would be L2 hits
        shutil.rmtree(self.base / "l2fs", ignore_errors=True)
        self.base.mkdir(parents=True, exist_ok=True)
        keep_logs(self.base / "logs")
        (self.base / "logs").mkdir(exist_ok=True)
        self.model = self.model_arg or ""
        self.gpu_slots = [None] * self.n_replicas
        self.nodes = self._start_l2fs()

    def l0_env_args(self) -> tuple[dict[str, str], list[str], Any]:
        """L0 size: VLLM_CPU_KVCACHE_SPACE (whole GiB, vLLM's CPU knob); below that --kv-cache-memory-bytes,
        which the CPU platform reads only when that env is unset (the launcher sets it, so the engine runs under
        `env -u`), so that small L0s fit CPU-feasible workloads."""
        gib = 2**30
        if self.l0_bytes % gib == 0:
            return {"VLLM_CPU_KVCACHE_SPACE": str(self.l0_bytes // gib)}, [], None
        return {}, ["--kv-cache-memory-bytes", str(self.l0_bytes)], (
            lambda argv: ["env", "-u", "VLLM_CPU_KVCACHE_SPACE", *argv])

    def use(self, tier: str) -> None:
        """Replicas of this tier running (restarted only if another tier runs)."""
        if tier in self.failed:
            raise RuntimeError(f"the replicas of tier {tier} did not start (see above)")
        if tier == self.tier:
            return
        self.stop_replicas()
        self.tier = tier
        t0 = time.monotonic()
        log(f"starting {self.n_replicas} replicas, tier {tier}")
        self.kv_events, self.infos, self._launched = [], [], {}
        try:
            self._start_replicas(self._plan_replicas(self.nodes))
        except BaseException:
            self.failed.add(tier)
            self.stop_replicas()
            self.tier = None
            raise
        self.starts.append({"tier": tier, "seconds": time.monotonic() - t0})
        log(f"tier {tier}: replicas healthy after {time.monotonic() - t0:.0f}s")

    def _launch(self, i: int, p: Any, errors: list[BaseException]) -> None:
        from kvtier.devstack.replica import start_replica

        env, l0_args, wrap = self.l0_env_args()
        prom = self.base / "prom" / f"{self.tier}-{p.name}"  # LMCache's counters on this replica's /metrics
        prom.mkdir(parents=True, exist_ok=True)
        for f in prom.iterdir():
            f.unlink()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(prom)
        extra = ["--enable-prompt-tokens-details", *l0_args, "--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_events[i]})]
        l2: dict[str, Any] = {}
        if self.tier == "plugin":
            l2 = {"l2fs_master": self.cluster.master}
        elif self.tier == "mount":
            l2 = {"mount_path": self.mounts[p.node]}
        try:
            self._launched[i] = start_replica(
                self.model, p.port, node_id=p.node, l1_gb=self.l1_gb, log_path=p.log_path,
                max_model_len=self.max_model_len, prefix_caching=True, lmcache=self.tier != "none",
                extra_args=extra, config_dir=self.base / "config", progress=False, extra_env=env, wrap=wrap,
                host_share=self._host_share, **l2)
        except BaseException as e:  # noqa: BLE001 - reported after all launches returned
            errors.append(e)

    def stop_replicas(self) -> None:
        self.stop_routers()
        for i in sorted(self._launched):
            try:
                self._launched[i].stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                log(f"error stopping replica: {e!r}")
        self._launched, self.infos = {}, []

    def state(self) -> StackState:
        return StackState(dir=str(self.base), model=self.model, l2fs_master=self.cluster.master, nodes=self.nodes,
                          replicas=list(self.infos), kv_events=self.kv_events,
                          router_url=None, strategy=None)


# ---------- arms, steps, the sweep ----------

@dataclass
class Step:
    context: int  # document tokens
    rate: float   # sessions per second


def run_step(arm: str, step: Step, fleet: Fleet, args: argparse.Namespace, seed: int, kv_bpt: int,
             tok: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One arm at one (context, rate): the step's seeded plan (the same for every arm), fresh documents."""
    tier, kind, policy = ARMS[arm]
    fleet.use(tier)
    state = fleet.state()
    urls = [r.url for r in state.replicas]
    nonce = f"{arm.replace(' ', '_')}-{step.context}-{step.rate:g}-{seed}"
    plan = make_plan(seed, rate=step.rate, sessions=args.sessions, docs=args.docs, doc_tokens=step.context,
                     turns=args.turns, think_s=args.think_s, return_share=args.return_share,
                     return_gap=args.return_gap, question_words=args.question_words, nonce=nonce,
                     encode=lambda s: tok(s, add_special_tokens=False)["input_ids"], decode=tok.decode)
    url = fleet.arm_router(kind, policy)
    before, load0 = [scrape(u) for u in urls], os.getloadavg()[0]
    rbefore = scrape(url, ROUTER_SERIES) if kind == "kvtier" else {}
    results: list[dict[str, Any]] = []
    t_start = time.monotonic() + 0.5
    deadline = t_start + args.step_timeout
    threads = [threading.Thread(target=run_session, daemon=True,
                                args=(s, plan, url, fleet.model, args.answer_tokens, t_start, deadline, results))
               for s in plan.sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=max(1.0, deadline + 600 - time.monotonic()))
    wall = time.monotonic() - t_start
    after, load1 = settled(urls), os.getloadavg()[0]
    summ = summarize_step(results, deltas(before, after), wall, kv_bpt, args.slo_ms)
    # requests each replica served: how far a policy concentrates the load
    summ["replica_requests"] = [a.get("requests", 0.0) - b.get("requests", 0.0) for a, b in zip(after, before, strict=True)]
    if kind == "kvtier":
        summ.update(router_ms(rbefore, scrape(url, ROUTER_SERIES)))
    history: dict[int, int] = {}  # user -> longest prompt beyond the document (their conversation)
    for r in results:
        if r.get("ok"):
            history[r["user"]] = max(history.get(r["user"], 0), (r["prompt_tokens"] or 0) - step.context)
    used = {s.user.doc for s in plan.sessions}  # documents some user asked about
    distinct = step.context * len(used) + sum(history.values())
    router = " ".join([kind, policy, *(fleet.router_args if kind == "kvtier" else [])])
    summ.update(arm=arm, tier=tier, router=router, context=step.context, rate=step.rate,
                offered_req_per_s=step.rate * args.turns, seed=seed, load_before=load0, load_after=load1,
                distinct_context_tokens=distinct)
    for r in results:
        r.update(arm=arm, context=step.context, rate=step.rate)
    return summ, results


def run_mrqa(arm: str, fleet: Fleet, args: argparse.Namespace, context: int, seed: int, tok: Any) -> dict[str, Any]:
    """LMCache's own multi_round_qa benchmark (multi-round-qa.py from its sdist, unmodified) through the arm's
    router: the same shape (users x rounds over a shared system prompt of `context` tokens plus a per-user
    history), its own client and its own per-request CSV, summarized here with the replicas' counters."""
    import csv
    import subprocess

    tier, kind, policy = ARMS[arm]
    fleet.use(tier)
    state = fleet.state()
    urls = [r.url for r in state.replicas]
    out = args.out.resolve() / f"mrqa-{arm.replace(' ', '_')}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    url = fleet.arm_router(kind, policy)
    # its prompt lengths count "hi " words, not tokens: scale them by this tokenizer's tokens per "hi "
    per_hi = len(tok(" ".join(["hi"] * 1000), add_special_tokens=False)["input_ids"]) / 1000
    argv = [sys.executable, str(args.mrqa), "--num-users", str(args.mrqa_users), "--num-rounds", str(args.turns),
            "--qps", f"{args.mrqa_qps:g}", "--shared-system-prompt", str(int(context / per_hi)),
            "--user-history-prompt", str(int(args.mrqa_history / per_hi)), "--answer-len", str(args.answer_tokens),
            "--model", fleet.model, "--base-url", f"{url}/v1", "--time", f"{args.mrqa_time:g}",
            "--init-user-id", str(seed), "--request-with-user-id", "--output", str(out), "--log-interval", "30"]
    env = dict(os.environ)
    if args.mrqa_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.mrqa_pythonpath, env.get("PYTHONPATH")) if p)
    logf = Path(fleet.base) / "logs" / f"mrqa-{arm.replace(' ', '_')}.log"
    before, t0 = [scrape(u) for u in urls], time.monotonic()
    with logf.open("wb") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=Path(args.mrqa).parent, env=env,
                            timeout=args.mrqa_time + 600).returncode
    wall = time.monotonic() - t0
    after = settled(urls)
    rows = list(csv.DictReader(out.open())) if out.exists() else []
    ttft = [float(r["ttft"]) * 1e3 for r in rows]
    span = (max(float(r["finish_time"]) for r in rows) - min(float(r["launch_time"]) for r in rows)) if rows else 0
    d = deltas(before, after)
    prompt = d.get("prompt_tokens") or 0
    return {"harness": "LMCache multi_round_qa", "arm": arm, "rc": rc, "requests": len(rows), "wall_s": wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_mean_ms": (sum(ttft) / len(ttft))
            if ttft else None, "req_per_s": len(rows) / span if span else None,
            "l0_hit_rate": (d.get("l0_hits") or 0) / prompt if prompt else None,
            "ext_hit_rate": (d.get("ext_hits") or 0) / prompt if prompt else None,
            "csv": str(out), "log": str(logf), "argv": argv[1:]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier bench workload", description=__doc__.split("\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default=None, help="model path (default: --model-preset)")
    p.add_argument("--model-preset", default="tiny", choices=("tiny", "kv8b"),
                   help="local model built under --dir (`kvtier model tiny|kv8b`)")
    p.add_argument("--contexts", default="2048", help="document tokens per step, comma-separated (e.g. 2048,4096)")
    p.add_argument("--rates", default="0.1,0.2,0.4", help="offered load, sessions/s, swept low to high")
    p.add_argument("--short-tokens", type=int, default=448,
                   help="also one step per arm with documents this short (~500-token prompts), at --short-rate; 0 = off")
    p.add_argument("--short-rate", type=float, default=0.2)
    p.add_argument("--sessions", type=int, default=14, help="session arrivals per step")
    p.add_argument("--docs", type=int, default=8, help="distinct documents per step (shared by the users)")
    p.add_argument("--turns", type=int, default=3, help="questions per visit")
    p.add_argument("--think-s", type=float, default=2.0, help="mean think time between turns (exponential)")
    p.add_argument("--return-share", type=float, default=0.4, help="share of arrivals that are returning users")
    p.add_argument("--return-gap", type=int, default=6, help="a user returns after at least this many arrivals")
    p.add_argument("--question-words", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--l0-tokens", type=int, default=0,
                   help="L0 (vLLM KV cache) per replica in tokens (default: 2 x max model length)")
    p.add_argument("--l1-tokens", type=int, default=6144, help="L1 (LMCache max_local_cpu_size) per replica, tokens")
    p.add_argument("--slo-ms", type=float, default=3000.0, help="TTFT P90 SLO; the sweep of an arm stops past it")
    p.add_argument("--step-timeout", type=float, default=240.0, help="seconds per step before unsent turns are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tier-order", default=",".join(TIER_ORDER),
                   help="order of the tiers (each a restart); put first what must run if --until cuts the run short")
    p.add_argument("--until", default=None, metavar="HH:MM",
                   help="UTC time after which no new step starts (the rest are reported as not run)")
    p.add_argument("--router-args", default="", metavar="ARGS",
                   help="extra arguments for kvtier's router in every kvtier arm, e.g. '--load-epsilon 0.1'")
    p.add_argument("--mrqa", type=Path, default=None, metavar="SCRIPT",
                   help="LMCache's benchmarks/multi_round_qa/multi-round-qa.py (from its sdist, unmodified; needs "
                   "openai + pandas): also run it through the router of each --mrqa-arms arm, first on its tier")
    p.add_argument("--mrqa-arms", default="baseline,L2 prefixaware")
    p.add_argument("--mrqa-users", type=int, default=6)
    p.add_argument("--mrqa-qps", type=float, default=0.5)
    p.add_argument("--mrqa-history", type=int, default=512, help="its --user-history-prompt (tokens)")
    p.add_argument("--mrqa-time", type=float, default=60.0, help="its --time (seconds)")
    p.add_argument("--mrqa-pythonpath", default=None, help="extra PYTHONPATH for the harness only (its pandas)")
    p.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                   help="no run: merge the workload.json of several runs (pieces that each fit the engine lock) "
                   "into one report, JSON/CSV and plots under --out; each step keeps its piece and box load")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke: 2 replicas, 3 arms (baseline, +L2 plugin, L2 prefixaware), one short step")
    p.add_argument("--dir", type=Path, default=Path(".kvtier/bench-workload"))
    p.add_argument("--out", type=Path, default=Path("bench-results/workload"))
    return p


def apply_quick(args: argparse.Namespace) -> None:
    if args.arms == ",".join(ARMS):
        args.arms = QUICK_ARMS
    args.contexts, args.rates, args.short_tokens = "768", "1.0", 0
    args.sessions, args.docs, args.turns, args.think_s = 6, 3, 2, 0.2
    args.return_share, args.return_gap, args.question_words, args.answer_tokens = 0.5, 2, 8, 4
    args.l0_tokens = args.l0_tokens or 2560  # 1.25 x the model length: returning users find little left in L0/L1
    args.l1_tokens = args.l1_tokens if args.l1_tokens != 6144 else 1024
    args.slo_ms, args.step_timeout = 1e9, 180


def plan_order(arms: list[str], rates: list[float], contexts: list[int], short: tuple[int, float] | None,
               tiers: tuple[str, ...] = TIER_ORDER) -> list[tuple[str, Step]]:
    """Tier by tier (fewest restarts); within a tier, per step, the arms in an order that rotates."""
    out: list[tuple[str, Step]] = []
    for tier in tiers:
        group = [a for a in arms if ARMS[a][0] == tier]
        if not group:
            continue
        steps = [Step(c, r) for c in contexts for r in rates] + ([Step(*short)] if short else [])
        for k, st in enumerate(steps):
            rot = k % len(group)
            out += [(a, st) for a in group[rot:] + group[:rot]]
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)) or math.isnan(b):
        return None
    return a / b - 1


def arm_figures(steps: list[dict[str, Any]], arms: list[str], ref: tuple[int, float]) -> list[dict[str, Any]]:
    """Per arm: figures at the reference step (context, rate) and over the sweep, and changes vs baseline."""
    def at(arm: str, key: tuple[int, float]) -> dict[str, Any] | None:
        return next((s for s in steps if s["arm"] == arm and (s["context"], s["rate"]) == key), None)

    out = []
    for arm in arms:
        mine = [s for s in steps if s["arm"] == arm and s["context"] == ref[0]]
        r = at(arm, ref) or {}
        good = [s["req_per_s"] for s in mine if s["slo_ok"]]
        sat = max(mine, key=lambda s: s["req_per_s"], default=None)
        out.append({"arm": arm, "ttft_p50_ms": r.get("ttft_p50_ms"), "ttft_p90_ms": r.get("ttft_p90_ms"),
                    "ttft_p99_ms": r.get("ttft_p99_ms"), "tpot_p50_ms": r.get("tpot_p50_ms"),
                    "e2e_p50_ms": r.get("e2e_p50_ms"), "return_ttft_p50_ms": r.get("return_ttft_p50_ms"),
                    "req_per_s_at_slo": max(good) if good else None,
                    "req_per_s_sat": sat["req_per_s"] if sat else None,
                    "out_tok_per_s_sat": sat["out_tok_per_s"] if sat else None,
                    "busy_s_per_req": r.get("busy_s_per_req"),
                    "l0_hit_rate": r.get("l0_hit_rate"), "ext_hit_rate": r.get("ext_hit_rate"),
                    "l2_hit_rate": r.get("l2_hit_rate"), "l2_hit_tokens": r.get("l2_hit_tokens"),
                    "short_ttft_p50_ms": None, "short_ttft_p90_ms": None})
        short = [s for s in steps if s["arm"] == arm and s["context"] != ref[0] and s["context"] < 1000]
        if short:
            out[-1]["short_ttft_p50_ms"] = short[0]["ttft_p50_ms"]
            out[-1]["short_ttft_p90_ms"] = short[0]["ttft_p90_ms"]
    base = next((a for a in out if a["arm"] == "baseline"), None)
    for a in out:
        for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "return_ttft_p50_ms", "req_per_s_at_slo",
                  "req_per_s_sat", "out_tok_per_s_sat", "busy_s_per_req", "short_ttft_p50_ms", "short_ttft_p90_ms"):
            a[f"{k}_change"] = ratio(a[k], base[k]) if base else None
    return out


def pc(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.0f}%"


def report(figs: list[dict[str, Any]], steps: list[dict[str, Any]], ref: tuple[int, float]) -> str:
    lines = [table(
        ["arm", "context", "sessions/s", "offered req/s", "ok/sent", "TTFT p50", "p90", "p99", "TPOT p50",
         "E2E p50", "return TTFT p50", "req/s", "out tok/s", "L0 hit %", "L1+L2 hit %", "L2 read %", "busy s/req",
         "SLO", "load"],
        [[s["arm"], str(s["context"]), fmt(s["rate"], 2), fmt(s["offered_req_per_s"], 2), f"{s['ok']}/{s['sent']}",
          fmt(s["ttft_p50_ms"], 0), fmt(s["ttft_p90_ms"], 0), fmt(s["ttft_p99_ms"], 0), fmt(s["tpot_p50_ms"], 1),
          fmt(s["e2e_p50_ms"], 0), fmt(s["return_ttft_p50_ms"], 0), fmt(s["req_per_s"], 3),
          fmt(s["out_tok_per_s"], 1),
          *(fmt(100 * s[f"{t}_hit_rate"], 1) if s[f"{t}_hit_rate"] is not None else "-" for t in ("l0", "ext", "l2")),
          fmt(s["busy_s_per_req"], 2), "ok" if s["slo_ok"] else "broken",
          f"{fmt(s['load_before'], 1)}/{fmt(s['load_after'], 1)}"] for s in steps],
        title="steps (times in ms; % of prompt tokens, the replicas' counters: L0 = vLLM prefix cache, L1+L2 = "
              "loaded by the KV connector, L2 read = LMCache's bytes read from L2 / KV bytes per token)")]
    lines.append("")
    lines.append(table(
        ["arm", "TTFT p50", "change", "TTFT p90", "change", "return-user TTFT p50", "change",
         "req/s at SLO", "change", "req/s sat.", "change", "busy s/req", "change", "~500-tok TTFT p50", "change"],
        [[a["arm"], fmt(a["ttft_p50_ms"], 0), pc(a["ttft_p50_ms_change"]), fmt(a["ttft_p90_ms"], 0),
          pc(a["ttft_p90_ms_change"]), fmt(a["return_ttft_p50_ms"], 0), pc(a["return_ttft_p50_ms_change"]),
          fmt(a["req_per_s_at_slo"], 3), pc(a["req_per_s_at_slo_change"]), fmt(a["req_per_s_sat"], 3),
          pc(a["req_per_s_sat_change"]), fmt(a["busy_s_per_req"], 2), pc(a["busy_s_per_req_change"]),
          fmt(a["short_ttft_p50_ms"], 0), pc(a["short_ttft_p50_ms_change"])] for a in figs],
        title=f"per arm against the baseline (TTFT and cost at {ref[0]} document tokens, {ref[1]:g} sessions/s)"))
    lines.append("published: " + "; ".join(f"{k}: {v}" for k, v in PUBLISHED.items()))
    return "\n".join(lines)


def plot(steps: list[dict[str, Any]], raw: list[dict[str, Any]], ref: tuple[int, float], out: Path,
         title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    arms = list(dict.fromkeys(s["arm"] for s in steps))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in arms:
        xs = sorted(r["ttft_ms"] for r in raw if r["arm"] == arm and r.get("ok") and
                    (r["context"], r["rate"]) == ref)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=arm, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title}\nTTFT CDF, {ref[0]} doc tokens, {ref[1]:g} sessions/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    paths.append(out / "workload_ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for arm in arms:
        mine = sorted((s for s in steps if s["arm"] == arm and s["context"] == ref[0]), key=lambda s: s["rate"])
        a1.plot([s["offered_req_per_s"] for s in mine], [s["req_per_s"] for s in mine], marker="o", label=arm)
        a2.plot([s["offered_req_per_s"] for s in mine], [s["ttft_p90_ms"] for s in mine], marker="o", label=arm)
    a1.set_xlabel("offered load (req/s)")
    a1.set_ylabel("achieved throughput (req/s)")
    a2.set_xlabel("offered load (req/s)")
    a2.set_ylabel("TTFT P90 (ms)")
    a2.set_yscale("log")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"{title}, {ref[0]} doc tokens")
    fig.tight_layout()
    paths.append(out / "workload_load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def combine(paths: list[Path], out: Path) -> int:
    """One report over several runs' workload.json: steps and raw rows as they were measured (tagged with their
    piece), figures against the baseline at the first piece's reference step. Arms of different pieces ran at
    different times, so they also differ in the box's load (each step carries its load)."""
    steps: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    pieces = []
    for p in paths:
        try:
            doc = json.loads(p.read_text())
            summ = doc["summary"]
        except (OSError, ValueError, KeyError) as e:
            print(f"kvtier bench workload --combine: {p}: not a workload result ({e!r})", file=sys.stderr)
            return 2
        piece = p.parent.name if p.name == "workload.json" else p.stem
        pieces.append({"piece": piece, "path": str(p), "env": doc.get("env"), "args": summ.get("args"),
                       "reference_step": summ.get("reference_step"), "restarts": summ.get("restarts"),
                       "harnesses": summ.get("harnesses", [])})
        steps += [{**s, "piece": piece} for s in summ.get("steps", [])]
        raw += [{**r, "piece": piece} for r in doc.get("raw", [])]
    good = [s for s in steps if "ttft_p90_ms" in s]
    ref = tuple(pieces[0]["reference_step"] or (good[0]["context"], good[0]["rate"]))
    arms = list(dict.fromkeys(["baseline"] * any(s["arm"] == "baseline" for s in good) + [s["arm"] for s in good]))
    figs = arm_figures(good, arms, (int(ref[0]), float(ref[1])))
    print(report(figs, good, (int(ref[0]), float(ref[1]))))
    harnesses = [h for pc_ in pieces for h in pc_["harnesses"]]
    summary = {"combined_from": [pc_["path"] for pc_ in pieces], "pieces": pieces, "reference_step": ref,
               "steps": steps, "arms": figs, "harnesses": harnesses, "published": PUBLISHED}
    paths_out = write_results(out, "workload", summary, raw)
    try:
        paths_out += plot(good, raw, (int(ref[0]), float(ref[1])), out, f"kvtier workload, {len(pieces)} pieces")
    except ImportError:
        print("no matplotlib: plots skipped (pip install kvtier[bench])")
    for q in paths_out:
        print(f"wrote {q}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out)
    if args.quick:
        apply_quick(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
        rates = sorted(float(x) for x in args.rates.split(","))
    except ValueError:
        print("kvtier bench workload: --contexts are integers, --rates numbers", file=sys.stderr)
        return 2
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms or min(rates) <= 0 or min(contexts) < 256 or args.sessions < 1 or args.turns < 1:
        print(f"kvtier bench workload: unknown arms {bad} (from {', '.join(ARMS)}), or a rate <= 0, a context "
              "< 256 tokens, --sessions/--turns < 1", file=sys.stderr)
        return 2
    from transformers import AutoConfig, AutoTokenizer

    from kvtier.devstack.tiny_model import kv_bytes_per_token, preset_model

    model = args.model or str(preset_model(args.dir.resolve(), args.model_preset))
    kv_bpt = kv_bytes_per_token(AutoConfig.from_pretrained(model).to_dict())
    tok = AutoTokenizer.from_pretrained(model)
    longest = max(contexts + [args.short_tokens])
    max_model_len = int(math.ceil((longest + 2 * args.turns * (args.question_words * 2 + args.answer_tokens + 32)
                                   + 256) / 1024) * 1024)
    # vLLM refuses to start unless L0 holds one request of the model length (plus a little): keep 25% over it
    l0_tokens = max(args.l0_tokens or 2 * max_model_len, int(1.25 * max_model_len))
    l0_bytes = int(math.ceil(l0_tokens * kv_bpt / 2**20)) * 2**20
    l1_gb = args.l1_tokens * kv_bpt / 2**30
    cap = args.replicas * (l0_bytes // kv_bpt + args.l1_tokens)
    log(f"model {model} ({kv_bpt} B KV/token); L0 {l0_bytes // kv_bpt} tokens ({l0_bytes / 2**20:.0f} MiB) + L1 "
        f"{args.l1_tokens} tokens ({l1_gb:.3f} GiB) per replica: L0+L1 of all {args.replicas} replicas = {cap} "
        f"tokens; documents per step: {args.docs} x {contexts} tokens + histories")
    if args.l1_tokens < 2 * max_model_len and any(ARMS[a][0] != "none" for a in arms):
        log(f"warning: L1 ({args.l1_tokens} tokens) holds fewer than two prompts of {max_model_len}: LMCache stores "
            "and loads (L2 too) through L1 memory, so it fails allocations and L2 hits come late or not at all")
    short = (args.short_tokens, args.short_rate) if args.short_tokens else None
    tiers = tuple(t for t in args.tier_order.split(",") if t)
    if sorted(tiers) != sorted(TIER_ORDER):
        print(f"kvtier bench workload: --tier-order is an order of {','.join(TIER_ORDER)}", file=sys.stderr)
        return 2
    order = plan_order(arms, rates, contexts, short, tiers)
    until = None
    if args.until:
        hh, mm = (int(x) for x in args.until.split(":"))
        now = time.gmtime()
        until = time.time() + ((hh * 60 + mm) - (now.tm_hour * 60 + now.tm_min)) * 60 - now.tm_sec
    ref = (contexts[0], rates[0])
    steps: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    broken: set[tuple[str, int]] = set()
    harnesses: list[dict[str, Any]] = []
    started = environment()
    fleet = Fleet(args.dir, replicas=args.replicas, model=model, l0_bytes=l0_bytes, l1_gb=l1_gb,
                  max_model_len=max_model_len, mount=any(ARMS[a][0] == "mount" for a in arms))
    fleet.router_args = shlex.split(args.router_args)
    try:
        fleet.start_l2fs()
        mrqa_arms = [a for a in args.mrqa_arms.split(",") if a in arms] if args.mrqa else []
        for n, (arm, st) in enumerate(order):
            for m in [m for m in mrqa_arms if ARMS[m][0] == ARMS[arm][0]]:
                mrqa_arms.remove(m)
                try:
                    # its users' ids (their contexts) differ per harness run: two arms of one tier run back to
                    # back on the same replicas and the same L2, and the second must not find the first's users
                    h = run_mrqa(m, fleet, args, contexts[0], args.seed * 1000 + len(harnesses), tok)
                except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                    h = {"harness": "LMCache multi_round_qa", "arm": m, "error": repr(e)}
                harnesses.append(h)
                log(f"LMCache multi_round_qa through {m}: rc {h.get('rc')}, {h.get('requests')} requests, TTFT "
                    f"p50/p90 {fmt(h.get('ttft_p50_ms'), 0)}/{fmt(h.get('ttft_p90_ms'), 0)} ms, "
                    f"{fmt(h.get('req_per_s'), 3)} req/s {h.get('error', '')}")
            if until is not None and time.time() > until:
                log(f"step {n + 1}/{len(order)}: {arm} {st.context} tok @ {st.rate:g}/s not run (--until {args.until})")
                steps.append({"arm": arm, "context": st.context, "rate": st.rate, "not_run": "--until"})
                continue
            if (arm, st.context) in broken and st.rate > min(rates):
                log(f"step {n + 1}/{len(order)}: {arm} {st.context} tok @ {st.rate:g}/s skipped (SLO broken below)")
                continue
            seed = args.seed * 1_000_003 + st.context * 1_000 + int(st.rate * 1_000)  # same plan in every arm
            try:
                s, r = run_step(arm, st, fleet, args, seed, kv_bpt, tok)
            except Exception as e:  # noqa: BLE001 - a failed step is reported, the others still run
                log(f"step {n + 1}/{len(order)}: {arm} failed: {e!r}")
                s = {"arm": arm, "context": st.context, "rate": st.rate, "error": repr(e), "ok": 0, "sent": 0}
                r = []
            steps.append(s)
            raw += r
            if "ttft_p90_ms" in s:
                if not s["slo_ok"]:
                    broken.add((arm, st.context))
                log(f"step {n + 1}/{len(order)}: {arm}, {st.context} doc tokens @ {st.rate:g} sessions/s: "
                    f"{s['ok']}/{s['sent']} ok, TTFT p50/p90 {fmt(s['ttft_p50_ms'], 0)}/{fmt(s['ttft_p90_ms'], 0)} ms, "
                    f"{fmt(s['req_per_s'], 3)} req/s, hits L0/L1/L2 {fmt(s['l0_hit_tokens'], 0)}/"
                    f"{fmt(s['l1_hit_tokens'], 0)}/{fmt(s['l2_hit_tokens'], 0)} (L2 read) tokens of {fmt(s['prompt_tokens'], 0)}, "
                    f"distinct context {s['distinct_context_tokens']} vs L0+L1 {cap}, load {fmt(s['load_after'], 1)}, "
                    f"requests per replica {'/'.join(fmt(x, 0) for x in s.get('replica_requests', []))}"
                    + (f", router {fmt(s['router_overhead_ms'], 2)} ms + tokenize {fmt(s.get('router_tokenize_ms'), 2)} ms"
                       if s.get("router_overhead_ms") is not None else "")
                    + (", L2 lookups hit/miss/failed/skipped "
                       + "/".join(fmt(s[f"router_l2_{x}"], 0) for x in L2_RESULTS)
                       if "router_l2_skipped" in s else ""))
    finally:
        fleet.stop_replicas()
        fleet.stop()
    good = [s for s in steps if "ttft_p90_ms" in s]
    figs = arm_figures(good, arms, ref)
    print(report(figs, good, ref))
    if harnesses:
        print(table(["harness", "arm", "rc", "requests", "TTFT p50", "TTFT p90", "TTFT mean", "req/s", "L0 hit %",
                     "L1+L2 hit %"],
                    [[h["harness"], h["arm"], str(h.get("rc", "-")), str(h.get("requests", "-")),
                      fmt(h.get("ttft_p50_ms"), 0), fmt(h.get("ttft_p90_ms"), 0), fmt(h.get("ttft_mean_ms"), 0),
                      fmt(h.get("req_per_s"), 3),
                      *(fmt(100 * h[k], 1) if h.get(k) is not None else "-" for k in ("l0_hit_rate", "ext_hit_rate"))]
                     for h in harnesses], title="outside harness, unmodified, through the same routers"))
    summary = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "model": model, "kv_bytes_per_token": kv_bpt, "l0_tokens_per_replica": l0_bytes // kv_bpt,
               "l1_tokens_per_replica": args.l1_tokens, "l0_l1_tokens_all_replicas": cap,
               "max_model_len": max_model_len, "reference_step": ref, "restarts": fleet.starts,
               "env_start": started, "env_end": environment(), "steps": steps, "arms": figs, "harnesses": harnesses,
               "published": PUBLISHED}
    paths = write_results(args.out, "workload", summary, raw)
    try:
        paths += plot(good, raw, ref, args.out, f"kvtier workload, {Path(model).name}, {args.replicas} CPU replicas")
    except ImportError:
        print("no matplotlib: plots skipped (pip install kvtier[bench])")
    for p in paths:
        print(f"wrote {p}")
    complete = all(s.get("sent") and s["ok"] == s["sent"] for s in steps if "not_run" not in s)
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
