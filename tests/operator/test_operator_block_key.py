"""The master's block key in the rendered manifests: Secret l2fs-block-key is mounted read-only
into the l2fs master alone, at the directory of $L2FS_BLOCK_KEY_FILE, and required; no worker, mount, router
or webhook pod references it (a worker holding the key could mint block ids for itself). The explicitly
insecure overlay drops it along with the tokens. Static checks: no cluster runs here."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import configmap, render, workloads

pytestmark = pytest.mark.unit
SECURE = ["base", "overlays/hyperpod-g6e", "overlays/hyperpod-p5", "overlays/hyperpod-p5-mp", "overlays/dev"]


def _refs(spec: dict[str, Any]) -> list[str]:
    """Every Secret a pod spec names (volumes, env, envFrom), init containers included."""
    out = [v["secret"]["secretName"] for v in spec.get("volumes") or [] if "secret" in v]
    for c in (spec.get("initContainers") or []) + spec["containers"]:
        out += [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                if "secretKeyRef" in (e.get("valueFrom") or {})]
        out += [e["secretRef"]["name"] for e in c.get("envFrom") or [] if "secretRef" in e]
    return out


@pytest.mark.parametrize("target", SECURE)
def test_only_the_master_mounts_the_block_key(target: str) -> None:
    docs = render(target)
    path = configmap(docs, "kvtier-config")["data"]["L2FS_BLOCK_KEY_FILE"]
    assert path.startswith("/") and "KVTIER_PRIVILEGED_SECRETS" in configmap(docs, "kvtier-config")["data"]
    assert "l2fs-block-key" in configmap(docs, "kvtier-config")["data"]["KVTIER_PRIVILEGED_SECRETS"].split(",")
    holders = []
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        if "l2fs-block-key" in _refs(spec):
            holders.append(w["metadata"]["name"])
    assert holders == ["l2fs-master"], (target, holders)
    (master,) = [w for w in workloads(docs) if w["metadata"]["name"] == "l2fs-master"]
    spec = master["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == path.rsplit("/", 1)[0]]
    assert m.get("readOnly") is True
    vol = {v["name"]: v for v in spec["volumes"]}[m["name"]]["secret"]
    assert vol["secretName"] == "l2fs-block-key" and not vol.get("optional")
    assert vol["items"] == [{"key": "block-key", "path": path.rsplit("/", 1)[1]}]
    assert vol["defaultMode"] & 0o007 == 0
    assert {"configMapRef": {"name": configmap(docs, "kvtier-config")["metadata"]["name"]}} in c["envFrom"]


def test_insecure_overlay_has_no_block_key() -> None:
    docs = render("overlays/dev-insecure")
    assert configmap(docs, "kvtier-config")["data"]["L2FS_BLOCK_KEY_FILE"] == ""
    assert not [w["metadata"]["name"] for w in workloads(docs) if "l2fs-block-key" in _refs(w["spec"]["template"]["spec"])]
