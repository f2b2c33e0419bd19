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


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    kubectl = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    r = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "bench")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(r.stdout)}


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
