"""deploy/monitoring: PodMonitors reach real ports of real pods, and every metric the dashboard and the
alert rules use is one the code defines (ours in l2fs/ router/ connector/ operator_patch/, vLLM's and
LMCache's in their installed sources), with a suffix its type produces (_total for a counter, _bucket
for a histogram). A renamed metric then fails here instead of leaving an empty panel or a silent alert.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import DEPLOY, by_kind, load_yaml, one, render, workloads

from operator_patch.patch import ENDPOINT_LABEL, PatchConfig, mutate

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
OURS = [ROOT / d for d in ("l2fs", "router", "connector", "operator_patch")]
PREFIXES = ("vllm:", "lmcache:", "l2fs_", "kvtier_")
SUFFIX = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def sources(name: str) -> list[Path]:
    for prefix, package, pattern in (("vllm:", "vllm", "v1/metrics/*.py"), ("lmcache:", "lmcache", "observability*.py")):
        if name.startswith(prefix):
            spec = importlib.util.find_spec(package)  # located, not imported (both are slow to import)
            if spec is None or spec.origin is None:
                pytest.skip(f"{package} is not installed; its metric names cannot be checked")
            return list(Path(spec.origin).parent.rglob(pattern) if "/" not in pattern
                        else Path(spec.origin).parent.glob(pattern))
    return [p for d in OURS for p in d.rglob("*.py")]


def metric_type(base: str) -> str | None:
    """counter | histogram | gauge for a metric defined in the code, None when it is not."""
    for path in sources(base):
        text = path.read_text(errors="replace")
        for m in re.finditer(re.escape(f'"{base}"'), text):
            before = text[max(0, m.start() - 200):m.start()].lower()
            kinds = {k: before.rfind(k) for k in SUFFIX}
            kind = max(kinds, key=lambda k: kinds[k])
            if kinds[kind] >= 0:
                return kind
    return None


def used_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers and by/without label lists removed)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", expr)
    return {m for m in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if m.startswith(PREFIXES)}


def check_defined(name: str) -> None:
    for kind, suffixes in SUFFIX.items():
        for suffix in suffixes:
            if suffix and not name.endswith(suffix):
                continue
            base = name[: len(name) - len(suffix)] if suffix else name
            if metric_type(base) == kind:
                return
            if suffix == "_total" and metric_type(name) == kind:  # Counter("x_total"): prometheus_client keeps it
                return
    raise AssertionError(f"metric {name} is not defined in the code with a type that exports that name")


def expressions() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "monitoring" / "kvtier-dashboard.json").read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "monitoring" / "prometheusrule.yaml").read_text())
    out += [(r["alert"], r["expr"]) for g in rules["spec"]["groups"] for r in g["rules"]]
    return out


def test_every_metric_in_dashboard_and_alerts_exists() -> None:
    seen: set[str] = set()
    for where, expr in expressions():
        names = used_metrics(expr)
        assert names or "up{" in expr, f"{where}: no kvtier/vLLM/LMCache metric in {expr!r}"
        seen |= names
    for name in sorted(seen):
        check_defined(name)
    # the dashboard and alerts cover TTFT, each tier's hits, L2 usage and evictions, routing and key drift
    text = " ".join(e for _, e in expressions())
    for must in ("vllm:time_to_first_token_seconds_bucket", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_hits_total", "l2fs_worker_used_bytes", "l2fs_worker_evictions_total",
                 "kvtier_router_decisions_total", "kvtier_key_mismatch_total"):
        assert must in text, must


def test_the_check_catches_a_wrong_name() -> None:
    for bad in ("l2fs_worker_evictions", "l2fs_worker_used_bytes_total", "vllm:time_to_first_token_seconds_total",
                "kvtier_router_decision_total"):
        with pytest.raises(AssertionError):
            check_defined(bad)


def test_alerts_cover_the_asked_conditions() -> None:
    rules = yaml.safe_load((DEPLOY / "monitoring" / "prometheusrule.yaml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]}
    assert "histogram_quantile(0.9" in alerts["KvtierTTFTP90High"]
    assert "kvtier_key_mismatch_total" in alerts["KvtierKeyMismatch"]
    assert "up{" in alerts["L2fsWorkerDown"] and "l2fs-worker" in alerts["L2fsWorkerDown"]
    assert "l2fs_worker_used_bytes" in alerts["L2fsFull"]
    monitors = {f"kvtier/{m['metadata']['name']}" for m in by_kind(render("monitoring"), "PodMonitor")}
    for name, expr in alerts.items():
        for job in re.findall(r'job="([^"]+)"', expr):
            assert job in monitors, f"{name}: job {job} is no PodMonitor (job = namespace/name)"


def _ports(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for c in spec["containers"] for p in c.get("ports") or [] if p.get("name")}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(e["operator"] == "Exists" and e["key"] in labels for e in selector.get("matchExpressions") or [])


def test_pod_monitors_reach_real_ports() -> None:
    """Every PodMonitor selects pods (rendered workloads, or vLLM pods as the webhook patches them) that
    have its port; every role with a metrics endpoint is scraped; the mount has none to scrape."""
    mon = render("monitoring")
    docs = render("overlays/hyperpod-g6e")
    patched = mutate(load_yaml("rendered-v3.2-stripped.yaml"), PatchConfig())
    targets = [(w["metadata"]["name"], w["metadata"].get("namespace"), w["spec"]["template"])
               for w in workloads(docs) + [patched]]
    scraped = set()
    for pm in by_kind(mon, "PodMonitor"):
        ns_any = (pm["spec"].get("namespaceSelector") or {}).get("any") is True
        hits = [(n, t) for n, ns, t in targets if _selects(pm["spec"]["selector"], t["metadata"].get("labels") or {})
                and (ns_any or ns == pm["metadata"]["namespace"])]
        assert hits, f"PodMonitor {pm['metadata']['name']} selects no pod"
        for name, tmpl in hits:
            scraped.add(name)
            for ep in pm["spec"]["podMetricsEndpoints"]:
                assert ep["port"] in _ports(tmpl["spec"]), (pm["metadata"]["name"], name, ep["port"])
                if ep.get("scheme") == "https":
                    assert ep["tlsConfig"]["ca"]["secret"]["name"] == \
                        one(docs, "Certificate", "kvtier-webhook")["spec"]["secretName"]
    assert ENDPOINT_LABEL in patched["spec"]["template"]["metadata"]["labels"]
    assert scraped == {"l2fs-master", "l2fs-worker", "kvtier-webhook", "kvtier-router", patched["metadata"]["name"]}
    mount = one(docs, "DaemonSet", "l2fs-mount")["spec"]["template"]["spec"]
    assert not _ports(mount), "the mount grew a port: give it a PodMonitor"
