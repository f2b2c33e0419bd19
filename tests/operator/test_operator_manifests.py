"""deploy/ as its consumers read it: kustomize (images transformer, an operator's overlay on top), the
Prometheus Operator's and Grafana sidecar's selectors (kube-prometheus-stack defaults), and the claims
docs/deploy.md makes about the rendered objects."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import DEPLOY, kubectl, render

ROOT = DEPLOY.parent
# every kustomization a user applies (components are not applied alone)
TARGETS = sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml")
                 if "components" not in p.parts)
KVTIER_IMAGE = "ghcr.io/kvtier/kvtier"


def containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for d in docs:
        spec = (d.get("spec") or {})
        pod = ((spec.get("jobTemplate") or {}).get("spec") or spec).get("template", {}).get("spec")
        if not pod:
            continue
        for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
            out.append((f"{d['kind']}/{d['metadata']['name']}/{c['name']}", c))
    return out


def render_over(target: str, tmp: Path, overlay: dict[str, Any]) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a user's overlay with `resources: [<target>]` plus `overlay`."""
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [os.path.relpath(DEPLOY / target, tmp)], **overlay}))
    out = subprocess.run([kubectl(), "kustomize", str(tmp)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("target", TARGETS)
def test_every_image_is_pinned_and_kvtier_ones_follow_one_entry(target: str, tmp_path: Path) -> None:
    """No container renders with a bare or unpinned image, and one `images:` entry for ghcr.io/kvtier/kvtier
    in an overlay on top retags every kvtier container (what docs/deploy.md "Images" tells operators to do)."""
    plain = containers(render(target))
    for where, c in plain:
        image = c["image"]
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert name and tag and tag != "latest" and "/" not in tag, \
            f"{target}: {where} image {image!r} is bare or unpinned"
    ours = {w for w, c in plain if c["image"].split(":")[0] in (KVTIER_IMAGE, "kvtier")}
    retagged = containers(render_over(target, tmp_path, {"images": [
        {"name": KVTIER_IMAGE, "newName": "registry.example/team/kvtier", "newTag": "t1"},
        {"name": "kvtier", "newName": "registry.example/team/kvtier", "newTag": "t1"}]}))
    assert {w for w, c in retagged if c["image"] == "registry.example/team/kvtier:t1"} == ours


def _runs_where() -> dict[str, list[str]]:
    """docs/deploy.md "What runs where": object name -> its cells."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    table = text.split("## What runs where", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.match(r"`([^`]+)`", cells[0])
        if name:
            rows[name.group(1)] = cells
    return rows


def test_docs_claims_match_the_rendered_manifests() -> None:
    """What docs/deploy.md says about replicas, the master's volume and the plugin pods' node dir is what
    kustomize renders (overlay hyperpod-g6e holds every one of these objects)."""
    docs = render("overlays/hyperpod-g6e")
    rows = _runs_where()
    text = (ROOT / "docs" / "deploy.md").read_text()
    checked = 0
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet") or d["metadata"]["name"] not in rows:
            continue
        cells = rows[d["metadata"]["name"]]
        claim = re.search(rf"{d['kind']} \(\**(\d+)\**\)", cells[1])
        assert claim, f"docs row {d['metadata']['name']}: no '{d['kind']} (N)' in {cells[1]!r}"
        assert int(claim.group(1)) == d["spec"].get("replicas", 1), (d["metadata"]["name"], cells[1])
        checked += 1
        for vct in d["spec"].get("volumeClaimTemplates") or []:
            size = vct["spec"]["resources"]["requests"]["storage"]
            assert f"PVC `{vct['metadata']['name']}` ({size[:-2]} {size[-2:]}" in cells[1], (cells[1], size)
            assert "no volume" not in " ".join(cells)
            prereq = text.split("Prerequisites:", 1)[1].split("```", 1)[0]
            assert "StorageClass" in prereq and "PVC" in prereq, "the prerequisites must name the StorageClass"
    assert checked >= 3  # master, webhook, router
    cfg = [c for c in docs if c["kind"] == "ConfigMap" and c["metadata"]["name"].startswith("kvtier-config-")]
    socket_dir = cfg[0]["data"]["L2FS_SOCKET_DIR"]
    said = re.findall(r"plugin-mode vLLM pods see only the worker's socket dir `([^`]+)`", text)
    assert said == [socket_dir], said


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (nil selects nothing, {} everything)."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def kube_prometheus_stack(release: str) -> dict[str, Any]:
    """What kube-prometheus-stack renders from its default values.yaml for Helm release `release`: the
    Prometheus CR's selectors (…SelectorNilUsesHelmValues: true -> matchLabels release; namespace selectors
    {} = all namespaces) and the Grafana dashboard sidecar (label grafana_dashboard, labelValue "1",
    searchNamespace ALL)."""
    return {"PodMonitor": ({"matchLabels": {"release": release}}, {}),
            "PrometheusRule": ({"matchLabels": {"release": release}}, {}),
            "dashboards": {"label": "grafana_dashboard", "labelValue": "1", "searchNamespace": "ALL"}}


@pytest.mark.parametrize("release", ["kube-prometheus-stack", "prom"])
def test_monitoring_objects_are_selected_by_kube_prometheus_stack(release: str, tmp_path: Path) -> None:
    """Every PodMonitor and the PrometheusRule match the default Prometheus's selectors, the dashboard
    ConfigMap the sidecar's; for another release name, with the one overlay line docs/deploy.md shows."""
    docs = render("monitoring") if release == "kube-prometheus-stack" else \
        render_over("monitoring", tmp_path, {"labels": [{"pairs": {"release": release}}]})
    stack = kube_prometheus_stack(release)
    ns_labels = {"kubernetes.io/metadata.name": "kvtier"}
    kinds = {d["kind"] for d in docs}
    assert {"PodMonitor", "PrometheusRule"} <= kinds
    for d in docs:
        if d["kind"] in ("PodMonitor", "PrometheusRule"):
            sel, ns_sel = stack[d["kind"]]
            assert selects(sel, d["metadata"].get("labels") or {}) and selects(ns_sel, ns_labels), \
                f"{d['kind']}/{d['metadata']['name']} is not selected by release {release}'s Prometheus"
    side = stack["dashboards"]
    cms = [d for d in docs if d["kind"] == "ConfigMap"
           and (d["metadata"].get("labels") or {}).get(side["label"]) == side["labelValue"]
           and side["searchNamespace"] in ("ALL", d["metadata"].get("namespace"))]
    assert [c["metadata"]["name"] for c in cms] == ["kvtier-grafana-dashboard"]
    assert any(k.endswith(".json") for k in cms[0]["data"])


def install_commands(doc: str) -> list[str]:
    """The shell commands of a doc's install code block ("Install, step by step" / the bench's steps), with
    continuation lines joined and comments dropped."""
    text = (ROOT / "docs" / doc).read_text()
    if doc == "deploy.md":
        text = text.split("## Install, step by step", 1)[1]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [ln.split(" #", 1)[0].strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.parametrize("doc", ["deploy.md", "bench-cluster.md"])
def test_install_applies_the_endpoint_only_after_the_webhook_answers(doc: str) -> None:
    """The apply that creates the InferenceEndpointConfig comes after the one that creates the webhook, with
    waits between them for the webhook's pods and for its caBundle (failurePolicy Ignore admits whatever the
    operator renders before that, unpatched); together the applies install all of hyperpod-g6e."""
    cmds = install_commands(doc)
    applies = [(i, c.split("apply -k", 1)[1].split()[0]) for i, c in enumerate(cmds) if "kubectl apply -k" in c]
    rendered = {target: render(target.removeprefix("deploy/")) for _, target in applies
                if target.startswith("deploy/overlays/hyperpod-g6e")}
    assert rendered, cmds

    def first(kind: str) -> int:
        steps = [i for i, t in applies if t in rendered and any(d["kind"] == kind for d in rendered[t])]
        assert steps, f"{doc}: no step applies a {kind}"
        return steps[0]

    hook, endpoint = first("MutatingWebhookConfiguration"), first("InferenceEndpointConfig")
    assert hook < endpoint, f"{doc}: the endpoint is applied with or before the webhook"
    between = cmds[hook + 1:endpoint]
    assert any("rollout status" in c and "deploy/kvtier-webhook" in c for c in between), between
    assert any("kubectl wait" in c and "caBundle" in c and "mutatingwebhookconfiguration/kvtier-operator-patch" in c
               for c in between), between
    whole = {(d["kind"], d["metadata"]["name"]) for d in render("overlays/hyperpod-g6e")}
    assert {(d["kind"], d["metadata"]["name"]) for docs in rendered.values() for d in docs} == whole
