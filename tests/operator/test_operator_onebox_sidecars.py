"""Native sidecars on the one-box cluster (kubelet_sim.OneBox), as the kubelet runs them (Kubernetes >= 1.29):
an init container with restartPolicy Always is started in its place in the init order, the next container only
once it has started (startup probe passed), it keeps running beside the containers and is restarted when it
exits, its readiness is part of the pod's, it is stopped only after the containers, and a Job's pod completes
with it. mp mode's `lmcache server` sidecar (operator_patch) depends on each of these. Shell containers only,
no vLLM: seconds each.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_sim import OneBox, Pod, box_root

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nsenter") or not shutil.which("setpriv"),
                       reason="needs root, nsenter, setpriv (network and mount namespaces)"),
]
WORK = "/kvtier-onebox-sidecar-work"  # an emptyDir shared by the pod's containers (the test reads it too)
# a process that records SIGTERM (and whether the pod's main container had already stopped) and exits
TERM_LOOP = ('trap \'test -f {w}/main-term && echo after > {w}/{n}-term || echo before > {w}/{n}-term; exit 0\' TERM; '
             'while :; do sleep 0.1; done')


def sh(name: str, script: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "command": ["sh", "-c", script],
            "volumeMounts": [{"name": "work", "mountPath": WORK}], **extra}


def exec_probe(script: str, period: int = 1, failures: int = 3) -> dict[str, Any]:
    return {"exec": {"command": ["sh", "-c", script]}, "periodSeconds": period, "failureThreshold": failures}


def workload(kind: str, name: str, init: list[dict[str, Any]], containers: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 5,
                            "initContainers": init, "containers": containers,
                            "volumes": [{"name": "work", "emptyDir": {}}]}
    if kind == "Job":
        spec["restartPolicy"] = "Never"
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": "default"},
                "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "default"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}


@pytest.fixture(scope="module")
def box() -> Iterator[OneBox]:
    for root in box_root("kvtier-onebox-sidecar-"):
        with OneBox(root, {"node-1": {}}, max_pods=6, max_backoff=1) as b:
            yield b


def until(box: OneBox, cond: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        box.check()
        assert time.monotonic() < deadline, f"{what}\n{box.describe()}"
        time.sleep(0.1)
    return got


def the_pod(box: OneBox, name: str) -> Pod:
    return until(box, lambda: (box.pods_of(name) or [None])[0], f"no pod of {name}")


def work(pod: Pod) -> Path:
    return pod.volumes["work"]  # type: ignore[attr-defined]


def test_next_container_starts_once_the_sidecar_has_started_and_both_run_together(box: OneBox) -> None:
    """The regular init container after the sidecar runs only once the sidecar's startup probe passed (the sidecar
    takes 2 s to make its file), the main container after that, while the sidecar keeps running; the API shows
    the sidecar started and ready in initContainerStatuses."""
    box.apply([workload("Deployment", "order", [
        sh("side", f"sleep 2; date +%s.%N > {WORK}/t && mv {WORK}/t {WORK}/side-up; while :; do sleep 0.1; done",
           restartPolicy="Always", startupProbe=exec_probe(f"test -f {WORK}/side-up")),
        sh("after", f"test -f {WORK}/side-up && date +%s.%N > {WORK}/after")],
        [sh("main", f"test -f {WORK}/after && while :; do sleep 0.1; done")])])
    pod = the_pod(box, "order")
    box.wait_ready("order", timeout=60)
    side, after, main = (pod.container(n) for n in ("side", "after", "main"))
    assert after.exits == [0] and main.restarts == 0, box.describe("order")  # it never ran before the sidecar was up
    assert float((work(pod) / "after").read_text()) >= float((work(pod) / "side-up").read_text())
    assert side.proc is not None and side.proc.poll() is None and side.started and side.ready
    got = box.get("Pod", "default", pod.name)
    assert got is not None
    (st,) = [s for s in got["status"]["initContainerStatuses"] if s["name"] == "side"]
    assert st["started"] and st["ready"] and "running" in st["state"], st


def test_a_sidecar_that_never_starts_is_restarted_and_holds_the_pod_back(box: OneBox) -> None:
    """failureThreshold failed startup probes kill the sidecar, the kubelet starts it again, and nothing after it
    in the pod ever starts."""
    box.apply([workload("Deployment", "stuck", [
        sh("side", "while :; do sleep 0.1; done", restartPolicy="Always",
           startupProbe=exec_probe("false", failures=2))], [sh("main", "while :; do sleep 0.1; done")])])
    pod = the_pod(box, "stuck")
    side = pod.container("side")
    until(box, lambda: side.restarts >= 2, "the sidecar was not restarted after failing its startup probe")
    assert pod.container("main").proc is None and not pod.ready


def test_a_sidecar_that_exits_is_restarted_beside_the_running_container(box: OneBox) -> None:
    """Killed (an OOM kill), the sidecar is started again; the main container is not touched; while the sidecar
    is not ready, neither is the pod."""
    box.apply([workload("Deployment", "restart", [
        sh("side", f"rm -f {WORK}/side-ok; sleep 1; touch {WORK}/side-ok; while :; do sleep 0.1; done",
           restartPolicy="Always", readinessProbe=exec_probe(f"test -f {WORK}/side-ok"))],
        [sh("main", "while :; do sleep 0.1; done")])])
    pod = the_pod(box, "restart")
    box.wait_ready("restart", timeout=60)
    side, main = pod.container("side"), pod.container("main")
    assert main.proc is not None
    main_pid = main.proc.pid
    box.kill(pod, "side")
    until(box, lambda: not pod.ready, "the pod stayed ready without its sidecar")
    until(box, lambda: side.restarts == 1 and pod.ready, "the sidecar was not restarted")
    assert main.proc.pid == main_pid and main.proc.poll() is None and main.restarts == 0


def test_sidecars_stop_after_the_containers_in_reverse_order(box: OneBox) -> None:
    """A deleted pod: the main container gets SIGTERM first; each sidecar only once it has exited, the later
    sidecar before the earlier one."""
    box.apply([workload("Deployment", "stop", [
        sh("side1", TERM_LOOP.format(w=WORK, n="side1").replace("exit 0", f"date +%s.%N > {WORK}/side1-at; exit 0")
           .replace("while :;", f"touch {WORK}/side1-up; while :;"), restartPolicy="Always"),
        sh("side2", TERM_LOOP.format(w=WORK, n="side2").replace("exit 0", f"date +%s.%N > {WORK}/side2-at; exit 0")
           .replace("while :;", f"touch {WORK}/side2-up; while :;"), restartPolicy="Always")],
        [sh("main", f"trap 'sleep 0.5; touch {WORK}/main-term; exit 0' TERM; touch {WORK}/main-up; "
            "while :; do sleep 0.1; done")])])
    pod = the_pod(box, "stop")
    box.wait_ready("stop", timeout=60)
    # ready is "running", not "its trap is set": a SIGTERM before main's shell reached `trap` killed it with no
    # main-term left (a loaded CI run saw the sidecars answer "before"); the order is what is tested, so wait for
    # main's trap (set before main-up) and for the sidecars' first loop turn (their traps come first too)
    deadline = time.monotonic() + 30
    while not ((work(pod) / "main-up").exists() and all((work(pod) / f"side{i}-up").exists() for i in (1, 2))):
        assert time.monotonic() < deadline, box.describe()
        time.sleep(0.1)
    # the workload goes first (else its controller starts a new pod), then the pod
    urllib.request.urlopen(urllib.request.Request(
        f"{box.api_url}/apis/apps/v1/namespaces/default/deployments/stop", method="DELETE"), timeout=10)
    box.stop_pod(pod)
    w = work(pod)
    assert (w / "side1-term").read_text().strip() == "after" and (w / "side2-term").read_text().strip() == "after"
    assert float((w / "side2-at").read_text()) <= float((w / "side1-at").read_text())
    assert all(c.proc is not None and c.proc.poll() is not None for c in pod.containers)


def test_a_jobs_pod_completes_with_its_sidecar_stopped(box: OneBox) -> None:
    """A Job's container exits 0: the pod is Succeeded although its sidecar would run forever (it is stopped,
    after the container)."""
    box.apply([workload("Job", "job", [sh("side", TERM_LOOP.format(w=WORK, n="side"), restartPolicy="Always")],
                        [sh("main", f"touch {WORK}/main-term; echo done")])])
    pod = box.wait_done("job", "default", timeout=60)
    assert pod.phase == "Succeeded", box.describe("job")
    assert (work(pod) / "side-term").read_text().strip() == "after"
    assert pod.container("side").proc.poll() is not None  # type: ignore[union-attr]
