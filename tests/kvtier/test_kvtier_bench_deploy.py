"""deploy/bench/: the in-cluster cross-pod benchmark Job renders with `kubectl kustomize`, validates against the
Kubernetes 1.32 schema, defines every variable its script uses, and its script, run here with the rendered
ConfigMap as environment and `kvtier` from this checkout, reaches the bench's HTTP-only mode with every flag
accepted (it then stops at the unreachable example pod IPs, as it must: it reads nothing else)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _kustomize(path: Path) -> dict[str, Any]:
    """`kubectl kustomize path` as {kind: object} (one object per kind here)."""
    kubectl = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(r.stdout)}


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    return _kustomize(ROOT / "deploy" / "bench")


def test_bench_job_renders_and_validates(rendered: dict[str, Any]) -> None:
    assert set(rendered) == {"ConfigMap", "Job"}
    for d in rendered.values():
        kubernetes_validate.validate(d, "1.32", strict=True)
    job, cm = rendered["Job"], rendered["ConfigMap"]
    assert job["metadata"]["namespace"] == cm["metadata"]["namespace"] == "team-a"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["image"].startswith("ghcr.io/kvtier/kvtier:")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    script = c["args"][0]
    defined = set(cm["data"]) | {e["name"] for e in c["env"]}
    used = set(re.findall(r"\$\{?([A-Z_]+)", script))
    assert used and used <= defined, used - defined
    assert "--replica-a" in script and "--replica-b" in script and "--from-up" not in script


def test_bench_job_script_reaches_http_mode(rendered: dict[str, Any], tmp_path: Path) -> None:
    c = rendered["Job"]["spec"]["template"]["spec"]["containers"][0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("L2FS_", "LMCACHE_", "KVTIER_"))}
    env.update(rendered["ConfigMap"]["data"])
    env.update(HOME=str(tmp_path), PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
               REPLICA_A="http://127.0.0.1:9/", REPLICA_B="http://127.0.0.1:9/")  # nothing listens on port 9
    r = subprocess.run([*c["command"], c["args"][0]], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "A at http://127.0.0.1:9 does not serve /v1/models" in r.stderr, r.stderr
    assert "=== cross_pod.json ===" not in r.stdout  # set -e: a failed run prints no result


def test_doc_overlay_sets_namespace_and_urls(tmp_path: Path) -> None:
    """docs/bench-cluster.md's way to point the Job at two pods: an overlay next to the repo's deploy/bench."""
    shutil.copytree(ROOT / "deploy" / "bench", tmp_path / "deploy" / "bench")
    run = tmp_path / "bench-run"
    run.mkdir()
    (run / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: team-b\n"
        "resources: [../deploy/bench]\nconfigMapGenerator:\n- name: kvtier-bench-config\n  behavior: merge\n"
        "  options: {disableNameSuffixHash: true}\n"
        "  literals: [REPLICA_A=http://10.1.2.3:8080, REPLICA_B=http://10.4.5.6:8080, LENGTHS=1024]\n")
    docs = _kustomize(run)
    data = docs["ConfigMap"]["data"]
    assert data["REPLICA_A"] == "http://10.1.2.3:8080" and data["REPLICA_B"] == "http://10.4.5.6:8080"
    assert data["LENGTHS"] == "1024" and data["REPS"] == "3"  # merged, not replaced
    assert docs["Job"]["metadata"]["namespace"] == docs["ConfigMap"]["metadata"]["namespace"] == "team-b"
    assert docs["Job"]["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"] == \
        docs["ConfigMap"]["metadata"]["name"]
