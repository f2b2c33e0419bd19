"""Run the rendered manifests' own container commands as local processes and hit their own probes.

`kubectl kustomize deploy/base` gives the l2fs master, worker and FUSE-mount containers; their command,
args ($(VAR) expanded from the rendered ConfigMap the way the kubelet does it) and probes are executed
here on loopback, with ports, data dir and mountpoint redirected to temporary ones. This catches a
manifest whose command line does not start, or whose probe never passes, without a cluster.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import MOUNT_SA, SA, ReviewApi, free_port, jwt, review_api
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _kubectl() -> str:
    for cand in (Path(sys.executable).with_name("kubectl"), shutil.which("kubectl")):
        if cand and Path(cand).exists():
            return str(cand)
    pytest.skip("no kubectl")


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    out = subprocess.run([_kubectl(), "kustomize", str(ROOT / "deploy/base")], capture_output=True, text=True,
                         timeout=120, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def container(docs: list[dict[str, Any]], kind: str, name: str, init: str | None = None) -> dict[str, Any]:
    """The first container of a workload (or its init container `init`), with the pod's runAsUser/Group
    filled in where the container does not set its own (as the kubelet does)."""
    (w,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    spec = w["spec"]["template"]["spec"]
    c = dict(spec["containers"][0] if init is None else {i["name"]: i for i in spec["initContainers"]}[init])
    sc = {**{k: v for k, v in (spec.get("securityContext") or {}).items() if k in ("runAsUser", "runAsGroup")},
          **(c.get("securityContext") or {})}
    c["securityContext"] = sc
    return c


def expand(words: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes $(VAR) expansion of command/args (unknown references are left as they are)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(w)) for w in words]


def as_other_user(cmd: list[str], env: dict[str, str], ids: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Command line for our console script run as another uid. The venv's interpreter may sit under a
    0700 home (it does here: /root/.pyenv); then the system Python 3.11 runs the same sources and the
    venv's site-packages (world-readable), which that uid can reach."""
    try:
        if subprocess.run([sys.executable, "-c", "pass"], capture_output=True, **ids).returncode == 0:
            return cmd, env
    except PermissionError:
        pass
    system = shutil.which("python3.11", path="/usr/bin:/usr/local/bin")
    if system is None or Path(cmd[0]).name not in ("l2fs", "kvtier"):
        pytest.skip(f"no interpreter uid {ids['user']} can run")
    module = {"l2fs": "l2fs.cli", "kvtier": "kvtier.cli"}[Path(cmd[0]).name]
    site = sysconfig.get_paths()["purelib"]
    boot = f"import sys; sys.argv[0] = {Path(cmd[0]).name!r}; from {module} import main; sys.exit(main())"
    # console scripts that uid can run, first on PATH: a wrapper (kvtier tokens exec -- l2fs ...) execs by name
    shims = Path(tempfile.mkdtemp(prefix="kvtier-shims-"))
    shims.chmod(0o755)
    for name, mod in (("l2fs", "l2fs.cli"), ("kvtier", "kvtier.cli")):
        code = f"import sys; sys.argv[0] = {name!r}; from {mod} import main; sys.exit(main())"
        (shims / name).write_text(f'#!/bin/sh\nexec {system} -c "{code}" "$@"\n')
        (shims / name).chmod(0o755)
    return [system, "-c", boot, *cmd[1:]], {**env, "PYTHONPATH": f"{ROOT}:{site}", "PATH": f"{shims}:{env['PATH']}"}


@pytest.fixture
def hostpath() -> Iterator[Path]:
    """A node path for processes that run as the manifests' non-root user (65532): outside pytest's tmp
    tree, whose root pytest keeps 0700 (and re-chmods whenever any pytest session starts)."""
    d = Path(tempfile.mkdtemp(prefix="kvtier-hostpath-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Env:
    """The container environment: the rendered ConfigMap with local ports/paths, plus downward API values."""

    def __init__(self, docs: list[dict[str, Any]], tmp: Path, hostpath: Path, api: ReviewApi,
                 engines: tuple[str, ...] = ("ep-a@team-a",)) -> None:
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvtier-config")]
        self.vars: dict[str, str] = dict(cm["data"])
        mport = free_port()
        self.vars.update({
            "L2FS_MASTER_PORT": str(mport), "L2FS_MASTER": f"127.0.0.1:{mport}",
            "L2FS_MASTER_METRICS_PORT": str(free_port()), "L2FS_WORKER_PORT": str(free_port()),
            "L2FS_WORKER_DATA_PORT": str(free_port()), "L2FS_WORKER_METRICS_PORT": str(free_port()),
            "L2FS_DATA_DIR": str(hostpath / "nvme"), "L2FS_SOCKET_DIR": str(hostpath / "run"), "L2FS_DATA_CAPACITY": "1G", "L2FS_MOUNT_PATH": str(hostpath / "mnt"),
            "NODE_NAME": "node-a", "POD_IP": "127.0.0.1", "L2FS_MASTER_JOURNAL": str(hostpath / "master" / "journal.db"),
        })
        (hostpath / "master").mkdir(exist_ok=True)  # the PersistentVolume, owned as fsGroup would make it
        if os.geteuid() == 0:
            os.chown(hostpath / "master", 65532, 65532)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = tmp
        # the Secrets, as `kvtier tokens generate` makes them; the tokens file where the Secret volume would be
        # (readable by the worker's group: fsGroup 65532 + mode 0440 in the manifests)
        self.secrets: dict[tuple[str, str], str] = {}
        tokens = hostpath / "tokens.json"
        made = subprocess.run([sys.executable, "-m", "kvtier.cli", "tokens", "generate", "--workers", "node-a", "node-b",
                               *[f"--engine={e}" for e in engines], "--router", "team-a", "--admin", "-o", str(tokens),
                               "--secret-yaml", "-"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert made.returncode == 0, made.stderr
        for s in yaml.safe_load_all(made.stdout):
            self.secrets.update({(s["metadata"]["name"], k): v for k, v in (s.get("stringData") or {}).items()})
        # Secret l2fs-endpoint-mounts as its volume in the mount pod: a file per key (mode 0400)
        self.endpoint_mounts = hostpath / "endpoint-mounts"
        self.endpoint_mounts.mkdir()
        for (name, k), v in self.secrets.items():
            if name == "l2fs-endpoint-mounts":
                (self.endpoint_mounts / k).write_text(v)
                (self.endpoint_mounts / k).chmod(0o400)
        key = hostpath / "block-key"  # the master's block key, made next to the tokens file (Secret l2fs-block-key)
        verifiers = hostpath / "token-verifiers.json"  # Secret l2fs-token-verifiers: what workers mount
        # the worker pod's projected ServiceAccount token, and the API server that issued it (the master reaches
        # it as in a pod: kubeconfig instead of in-cluster config, the TokenReview the same)
        self.api = api
        identity = hostpath / "identity-token"
        self.identity = jwt("l2fs-worker-pod-on-node-a")
        api.emu.table[self.identity] = (SA, "node-a", ["l2fs"])
        identity.write_text(self.identity)
        # the FUSE mount pod's projected token (ServiceAccount l2fs-mount): no Secret, the master names it
        # mount@node-a (--mount-sa)
        mount_identity = hostpath / "mount-identity-token"
        self.mount_identity = jwt("l2fs-mount-pod-on-node-a")
        api.emu.table[self.mount_identity] = (MOUNT_SA, "node-a", ["l2fs"])
        mount_identity.write_text(self.mount_identity)
        for f in (tokens, key, verifiers, identity, mount_identity):
            if os.geteuid() == 0:
                os.chown(f, 0, 65532)
            f.chmod(0o440)
        self.tokens = {e["name"]: e["token"] for e in json.loads(tokens.read_text())}
        self.vars["L2FS_TOKENS_FILE"] = str(tokens)
        self.vars["L2FS_TOKEN_VERIFIERS_FILE"] = str(verifiers)
        self.vars["L2FS_WORKER_TOKEN_FILE"] = str(identity)
        self.vars["L2FS_MOUNT_TOKEN_FILE"] = str(mount_identity)
        self.vars["L2FS_MOUNT_ENDPOINTS_DIR"] = str(self.endpoint_mounts)
        self.vars["L2FS_MOUNT_STATUS_FILE"] = str(tmp / "l2fs-mounts.status")
        (tmp / "mount-cache-volume").mkdir()  # the mount-cache emptyDir (passthrough mounts' files), this node's
        self.vars["L2FS_MOUNT_CACHE_DIR"] = str(tmp / "mount-cache-volume")
        self.vars["KUBECONFIG"] = str(api.kubeconfig)
        self.vars["L2FS_BLOCK_KEY_FILE"] = str(key)

    def start(self, c: dict[str, Any], log: str) -> subprocess.Popen[bytes]:
        cmd = expand(c["command"] + c.get("args", []), self.vars)
        exe = Path(sys.executable).with_name(cmd[0])
        if exe.exists():
            cmd[0] = str(exe)
        env = {**os.environ, **self.vars, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        env.pop("L2FS_TOKEN", None)
        for e in c.get("env") or []:  # the container's own env: plain values and Secret references, as kubelet does
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                env[e["name"]] = self.secrets[(ref["name"], ref["key"])]
            elif "value" in e:
                env[e["name"]] = expand([e["value"]], self.vars)[0]
        # a container starts with the manifest's env, not this test process's: LMCache, once imported by an
        # earlier test in this process, exports PROMETHEUS_MULTIPROC_DIR (a root-owned /tmp dir), which a
        # non-root child's prometheus_client would then fail to open
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        sc = c.get("securityContext") or {}
        ids: dict[str, Any] = {}
        if os.geteuid() == 0 and sc.get("runAsUser"):  # the manifest's non-root user, as the kubelet would
            ids = {"user": sc["runAsUser"], "group": sc.get("runAsGroup", sc["runAsUser"]), "extra_groups": []}
            cmd, env = as_other_user(cmd, env, ids)
        proc = subprocess.Popen(cmd, env=env, stdout=open(self.tmp / log, "wb"), stderr=subprocess.STDOUT, **ids)
        self.procs.append(proc)
        return proc

    def port(self, c: dict[str, Any], name: str | int) -> int:
        """Map a container port (by name) to the local port its $(VAR) flag was given."""
        if isinstance(name, int):
            return name
        key = {"grpc": "PORT", "metrics": "METRICS_PORT", "data": "DATA_PORT"}[name]
        role = "MASTER" if "master" in " ".join(c["command"]) else "WORKER"
        return int(self.vars[f"L2FS_{role}_{key}"])

    def probe(self, c: dict[str, Any], which: str) -> bool:
        p = c[which]
        if "httpGet" in p:
            url = f"http://127.0.0.1:{self.port(c, p['httpGet']['port'])}{p['httpGet']['path']}"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        if "tcpSocket" in p:
            import socket

            try:
                socket.create_connection(("127.0.0.1", self.port(c, p["tcpSocket"]["port"])), timeout=2).close()
                return True
            except OSError:
                return False
        cmd = expand(p["exec"]["command"], self.vars)
        return subprocess.run(cmd, env={**os.environ, **self.vars}, timeout=10).returncode == 0

    def wait_probe(self, c: dict[str, Any], which: str, proc: subprocess.Popen[bytes], log: str) -> None:
        deadline = time.monotonic() + 60
        while not self.probe(c, which):
            assert proc.poll() is None, f"{log} exited {proc.returncode}: {(self.tmp / log).read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{which} of {log} never passed: {(self.tmp / log).read_text()[-2000:]}"
            time.sleep(0.3)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def start_worker(base: list[dict[str, Any]], env: Env) -> subprocess.Popen[bytes]:
    """The worker pod: its hostPath (created root-owned, as DirectoryOrCreate does), its root init
    container handing the dir to the worker's user, then the worker as that user; waits until ready."""
    data = Path(env.vars["L2FS_DATA_DIR"])
    data.mkdir(exist_ok=True)
    Path(env.vars["L2FS_SOCKET_DIR"]).mkdir(exist_ok=True)
    init = container(base, "DaemonSet", "l2fs-worker", init="own-data-dir")
    assert init["securityContext"]["runAsUser"] == 0
    done = subprocess.run(expand(init["command"] + init["args"], env.vars), env={**os.environ, **env.vars},
                          timeout=60)
    assert done.returncode == 0
    if os.geteuid() == 0:
        assert (data.stat().st_uid, data.stat().st_gid) == (65532, 65532)
        sock_dir = Path(env.vars["L2FS_SOCKET_DIR"]).stat()
        assert (sock_dir.st_uid, sock_dir.st_gid) == (65532, 65532)
    worker = container(base, "DaemonSet", "l2fs-worker")
    wp = env.start(worker, "worker.log")
    env.wait_probe(worker, "readinessProbe", wp, "worker.log")
    return wp


@pytest.fixture
def env(base: list[dict[str, Any]], tmp_path: Path, hostpath: Path) -> Iterator[Env]:
    with review_api(hostpath) as api:
        e = Env(base, tmp_path, hostpath, api)
        yield e
        mnt = e.vars["L2FS_MOUNT_PATH"]
        e.stop()
        # the endpoints' mounts (l2fs mount --endpoints: <mnt>/<endpoint>/<endpoint>), deepest first, and any at
        # the base; mount_type also sees a dead one (os.path.ismount does not: stat fails with ENOTCONN)
        from l2fs.fuse.main import mount_type

        for m in sorted({mnt, *glob.glob(f"{glob.escape(mnt)}/*"), *glob.glob(f"{glob.escape(mnt)}/*/*")},
                        key=len, reverse=True):
            if (mount_type(m) or "").startswith("fuse"):
                subprocess.run(["fusermount3", "-u", "-z", m], timeout=20)


def test_master_and_worker_commands_and_probes(base: list[dict[str, Any]], env: Env) -> None:
    master = container(base, "StatefulSet", "l2fs-master")
    worker = container(base, "DaemonSet", "l2fs-worker")
    mp = env.start(master, "master.log")
    env.wait_probe(master, "readinessProbe", mp, "master.log")
    assert env.probe(master, "livenessProbe")
    wp = start_worker(base, env)
    assert env.probe(worker, "livenessProbe")
    # the worker registered under the node name from the downward API, with the configured capacity
    l2fs = str(Path(sys.executable).with_name("l2fs"))
    report = subprocess.run([l2fs, "report", "--json", "--master", env.vars["L2FS_MASTER"]], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "L2FS_TOKEN": env.tokens["admin"]})
    assert report.returncode == 0, report.stderr
    assert "node-a" in report.stdout
    # the non-root worker serves a root client on its node (short-circuit: root-owned files in its dir)
    src = env.tmp / "blob"
    src.write_bytes(os.urandom(300_000))
    common = ["--master", env.vars["L2FS_MASTER"], "--node-id", "node-a"]
    admin = {**os.environ, "L2FS_TOKEN": env.tokens["admin"]}
    for cmd in (["put", str(src), "/kv/blob"], ["get", "/kv/blob", str(env.tmp / "back")], ["rm", "/kv/blob"]):
        r = subprocess.run([l2fs, cmd[0], *common, *cmd[1:]], capture_output=True, text=True, timeout=60, env=admin)
        assert r.returncode == 0, f"{cmd}: {r.stderr}\n{(env.tmp / 'worker.log').read_text()[-2000:]}"
    assert (env.tmp / "back").read_bytes() == src.read_bytes()
    # the rm went through the master's journal on its volume (the manifest's --journal)
    assert Path(env.vars["L2FS_MASTER_JOURNAL"]).stat().st_size > 0
    if os.geteuid() == 0:
        import psutil

        assert psutil.Process(wp.pid).uids().real == 65532


def test_scoped_tokens_from_the_generated_file(base: list[dict[str, Any]], env: Env) -> None:
    """`kvtier tokens generate` output as the rendered master and worker containers load it: the worker holds
    no token (only the verifier file) and registers with its pod's projected ServiceAccount token, which the
    master reviews and binds to node-a; a pod on another node showing that token is refused; the engine token
    puts under its endpoint's prefix only and cannot overwrite or delete; the router token only reads; the
    mount pod's ServiceAccount token cannot delete the engine's file, the admin token can."""
    master = container(base, "StatefulSet", "l2fs-master")
    env.wait_probe(master, "readinessProbe", env.start(master, "master.log"), "master.log")
    wp = start_worker(base, env)
    l2fs = str(Path(sys.executable).with_name("l2fs"))

    def cli(token: str, *cmd: str, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*wrap, l2fs, cmd[0], "--master", env.vars["L2FS_MASTER"], "--node-id", "node-a",
                               *cmd[1:]], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "L2FS_TOKEN": token, "D": env.vars["L2FS_DATA_DIR"],
                                   "S": env.vars["L2FS_SOCKET_DIR"]})

    report = cli(env.tokens["admin"], "report", "--json")
    assert report.returncode == 0 and "node-a" in report.stdout, report.stderr
    # the worker process holds no token of anyone: no L2FS_TOKEN, and the file it checks tokens with has digests
    environ = Path(f"/proc/{wp.pid}/environ").read_bytes().split(b"\0")
    assert not [e for e in environ if e.startswith(b"L2FS_TOKEN=")]
    verifiers = Path(env.vars["L2FS_TOKEN_VERIFIERS_FILE"]).read_text()
    assert not [t for t in env.tokens.values() if t in verifiers]
    assert env.identity in env.api.emu.seen  # it registered with its projected token, reviewed by the API server
    # node-a's pod token shown by a worker pod of node-x (same DaemonSet, same Secrets): registration refused
    worker = container(base, "DaemonSet", "l2fs-worker")
    stray_dir = Path(env.vars["L2FS_DATA_DIR"]).parent / "stray"
    stray_dir.mkdir()
    if os.geteuid() == 0:
        os.chown(stray_dir, 65532, 65532)
    stray = {**worker, "args": expand(worker["args"], {"NODE_NAME": "node-x", "L2FS_DATA_DIR": str(stray_dir),
                                                        "L2FS_WORKER_PORT": str(free_port()),
                                                        "L2FS_WORKER_DATA_PORT": str(free_port()),
                                                        "L2FS_WORKER_METRICS_PORT": str(free_port()),
                                                        "L2FS_SOCKET_DIR": str(stray_dir)})}
    sp = env.start(stray, "stray.log")
    time.sleep(3)
    assert sp.poll() is None and "PERMISSION_DENIED" in (env.tmp / "stray.log").read_text()
    assert "node-x" not in cli(env.tokens["admin"], "report", "--json").stdout
    # engine ep-a: put-if-absent under /kvtier/kv/ep-a only
    src = env.tmp / "chunk"
    src.write_bytes(os.urandom(100_000))
    engine, router, mount = env.secrets[("ep-a-l2fs-token", "token")], env.secrets[
        ("kvtier-router-l2fs-token", "token")], env.mount_identity
    assert engine == env.tokens["engine-ep-a"] and router == env.tokens["router-team-a"]
    own = "/kvtier/kv/ep-a/rev1/salt/c0.data"
    # as a plugin-mode pod on this node sees it (the webhook's mount): the worker's socket dir read-only and no
    # data dir at all (an empty tmpfs over it); the same-node put goes over the data plane (faster than a memfd
    # at every size: `kvtier bench local-put`) and the get short-circuits through a passed fd
    sock = Path(env.vars["L2FS_SOCKET_DIR"]) / "worker.sock"
    assert sock.is_socket()
    pod_view = ("unshare", "--mount", "sh", "-c",
                'mount -t tmpfs none "$D" && mount --bind "$S" "$S" && mount -o remount,bind,ro "$S" && exec "$@"',
                "sh")
    fds = 0.0
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pod_view = ()
    else:
        fds = _fds_passed(env)
    put = cli(engine, "put", str(src), own, wrap=pod_view)
    assert put.returncode == 0, put.stderr
    got = cli(engine, "get", own, str(env.tmp / "ro-back"), wrap=pod_view)
    assert got.returncode == 0 and (env.tmp / "ro-back").read_bytes() == src.read_bytes(), got.stderr
    if pod_view:  # a read fd went through the socket
        assert _fds_passed(env) >= fds + 1
    for denied in (cli(engine, "put", str(src), "/kvtier/kv/ep-b/rev1/c0.data"),
                   cli(engine, "put", str(src), own, "--overwrite"), cli(engine, "rm", own),
                   cli(router, "put", str(src), "/kvtier/kv/ep-a/rev1/c1.data"), cli(router, "rm", own)):
        assert denied.returncode != 0 and "may not" in denied.stderr + denied.stdout, denied
    assert cli(router, "get", own, str(env.tmp / "back")).returncode == 0
    assert (env.tmp / "back").read_bytes() == src.read_bytes()
    # the FUSE mount pod's ServiceAccount token (mount@node-a): not another credential's file; the admin may
    denied = cli(mount, "rm", own)
    assert denied.returncode != 0 and "may not" in denied.stderr + denied.stdout, denied
    assert mount in env.api.emu.seen
    assert cli(env.tokens["admin"], "rm", own).returncode == 0
    assert cli(router, "stat", own).returncode != 0


def _fds_passed(env: Env) -> float:
    """Block fds the worker has handed out over its socket (l2fs_worker_fdpass_fds_total, all ops)."""
    url = f"http://127.0.0.1:{env.vars['L2FS_WORKER_METRICS_PORT']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("l2fs_worker_fdpass_fds_total{"))


@pytest.mark.fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                    reason="needs root, /dev/fuse and fusermount3")
def test_mount_command_probes_and_sigterm(base: list[dict[str, Any]], env: Env) -> None:
    """The rendered mount command serves each endpoint of Secret l2fs-endpoint-mounts at
    <mount path>/<endpoint>/<endpoint> (its prefix only, its own token) in a root-owned 0755 directory; readiness
    waits for every endpoint's mount; SIGTERM unmounts them all."""
    master = container(base, "StatefulSet", "l2fs-master")
    mount = container(base, "DaemonSet", "l2fs-mount")
    env.wait_probe(master, "readinessProbe", env.start(master, "master.log"), "master.log")
    start_worker(base, env)
    mnt = Path(env.vars["L2FS_MOUNT_PATH"])
    assert not env.probe(mount, "readinessProbe")  # nothing mounted yet: not ready
    env.vars.update(L2FS_MOUNT_UID="1000", L2FS_MOUNT_GID="1000")  # a non-root vLLM container's ids
    proc = env.start(mount, "mount.log")
    env.wait_probe(mount, "readinessProbe", proc, "mount.log")
    assert env.probe(mount, "livenessProbe")
    # the endpoint's mount, in its plain node directory (what its pods bind), no node-wide one
    assert os.path.ismount(mnt / "ep-a" / "ep-a") and not os.path.ismount(mnt / "ep-a") and not os.path.ismount(mnt)
    home = (mnt / "ep-a").stat()
    assert (home.st_uid, home.st_mode & 0o7777) == (0, 0o755), home  # only root writes there, no non-root pod
    # what vLLM's LMCache fs connector will do through it: mkdir, write tmp, rename, read; it lands under the
    # endpoint's prefix
    chunk = mnt / "ep-a" / "ep-a" / "rev1"
    chunk.mkdir(parents=True, exist_ok=True)
    (chunk / "k.data.tmp").write_bytes(b"x" * 4096)
    os.replace(chunk / "k.data.tmp", chunk / "k.data")
    assert (chunk / "k.data").read_bytes() == b"x" * 4096
    l2fs = str(Path(sys.executable).with_name("l2fs"))
    got = subprocess.run([l2fs, "cat", "--master", env.vars["L2FS_MASTER"], "/kvtier/kv/ep-a/rev1/k.data"],
                         capture_output=True, timeout=60, env={**os.environ, "L2FS_TOKEN": env.tokens["admin"]})
    assert got.returncode == 0 and got.stdout == b"x" * 4096, got.stderr
    # the configured owner (uid 1000) writes like LMCache does; another non-root uid reads but cannot write
    write = f"printf y > {chunk}/u.data.tmp && mv {chunk}/u.data.tmp {chunk}/u.data"
    as_uid = ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "sh", "-c", write]
    assert subprocess.run(as_uid, timeout=30).returncode == 0 and (chunk / "u.data").read_bytes() == b"y"
    other = ["setpriv", "--reuid", "1001", "--regid", "1001", "--clear-groups", "sh", "-c",
             f"cat {chunk}/u.data >/dev/null && ! (printf z > {chunk}/o.data) 2>/dev/null"]
    assert subprocess.run(other, timeout=30).returncode == 0 and not (chunk / "o.data").exists()
    # SIGTERM (what the kubelet sends; no preStop): every endpoint unmounted, the daemon exits, liveness fails
    proc.terminate()
    assert proc.wait(30) == 0
    assert not os.path.ismount(mnt / "ep-a" / "ep-a")
    assert not env.probe(mount, "livenessProbe")
    # why the mount has a role of its own (mount: renames of its own files onto free paths), not an engine token:
    # with one, even inside that engine's own prefix, what LMCache's fs:// connector does through a mount (write
    # a temp file, rename it) is refused
    (env.endpoint_mounts / "ep-a").chmod(0o600)
    (env.endpoint_mounts / "ep-a").write_text(json.dumps({"root": "/kvtier/kv/ep-a", "token": env.tokens["engine-ep-a"]}))
    env.vars["L2FS_MOUNT_PATH"] = str(mnt) + "-engine"
    eproc = env.start(mount, "mount-engine.log")
    env.wait_probe(mount, "readinessProbe", eproc, "mount-engine.log")
    own = Path(env.vars["L2FS_MOUNT_PATH"]) / "ep-a" / "ep-a" / "rev2"
    own.mkdir(parents=True, exist_ok=True)  # mkdir under its own prefix is allowed
    try:
        (own / "k.data.tmp").write_bytes(b"x" * 4096)
        os.replace(own / "k.data.tmp", own / "k.data")
        published = True
    except OSError:
        published = False
    assert not published and not (own / "k.data").exists()
    eproc.terminate()
    assert eproc.wait(30) == 0


@pytest.mark.fuse
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                    reason="needs root, /dev/fuse and fusermount3")
def test_mount_command_with_passthrough(base: list[dict[str, Any]], env: Env) -> None:
    """The rendered mount command with kvtier-config's default L2FS_MOUNT_SERVER=auto: on a kernel that offers
    FUSE passthrough (its probe mount says so) each endpoint's mount is the read-write passthrough server keeping
    its files in the mount-cache emptyDir (L2FS_MOUNT_CACHE_DIR is that volume's mountPath, the volume sized);
    LMCache's write pattern through it lands under the endpoint's prefix; SIGTERM unmounts. A value other than
    auto|pyfuse3|passthrough stops the container with the reason."""
    import psutil

    (ds,) = [d for d in base if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "l2fs-mount"]
    spec = ds["spec"]["template"]["spec"]
    mount = container(base, "DaemonSet", "l2fs-mount")
    (cfg,) = [d for d in base if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvtier-config")]
    (vm,) = [m for m in mount["volumeMounts"] if m["mountPath"] == cfg["data"]["L2FS_MOUNT_CACHE_DIR"]]
    (vol,) = [v for v in spec["volumes"] if v["name"] == vm["name"]]
    assert vol["emptyDir"]["sizeLimit"] and cfg["data"]["L2FS_MOUNT_SERVER"] == "auto"  # the default
    bad = env.start(mount, "mount-bad.log") if not env.vars.update(L2FS_MOUNT_SERVER="fast") else None
    assert bad is not None and bad.wait(30) == 2
    assert "want auto, pyfuse3 or passthrough" in (env.tmp / "mount-bad.log").read_text()
    master = container(base, "StatefulSet", "l2fs-master")
    env.wait_probe(master, "readinessProbe", env.start(master, "master.log"), "master.log")
    start_worker(base, env)
    cache = env.tmp / "mount-cache"  # the emptyDir, where this test's node has it
    cache.mkdir()
    env.vars.update(L2FS_MOUNT_SERVER="auto", L2FS_MOUNT_CACHE_DIR=str(cache))
    proc = env.start(mount, "mount.log")
    env.wait_probe(mount, "readinessProbe", proc, "mount.log")
    text = (env.tmp / "mount.log").read_text()
    if "passthrough on" not in text:
        assert "pyfuse3 mounts" in text, text  # auto fell back, with its reason
        pytest.skip("the kernel grants no FUSE passthrough (needs Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH)")
    assert "offers FUSE passthrough: passthrough mounts" in text, text
    assert "l2fs-probe" not in Path("/proc/self/mounts").read_text()  # the probe's throwaway mount is gone
    (child,) = psutil.Process(proc.pid).children()
    assert "--passthrough" in child.cmdline() and len(list(cache.glob("l2fs-pt-*"))) == 1
    chunk = Path(env.vars["L2FS_MOUNT_PATH"]) / "ep-a" / "ep-a" / "rev1"
    chunk.mkdir(parents=True, exist_ok=True)
    data = os.urandom(2 << 20)
    (chunk / "k.data.tmp").write_bytes(data)
    os.replace(chunk / "k.data.tmp", chunk / "k.data")
    l2fs = str(Path(sys.executable).with_name("l2fs"))
    got = subprocess.run([l2fs, "cat", "--master", env.vars["L2FS_MASTER"], "/kvtier/kv/ep-a/rev1/k.data"],
                         capture_output=True, timeout=60, env={**os.environ, "L2FS_TOKEN": env.tokens["admin"]})
    assert got.returncode == 0 and got.stdout == data, got.stderr
    proc.terminate()
    assert proc.wait(30) == 0 and not os.path.ismount(Path(env.vars["L2FS_MOUNT_PATH"]) / "ep-a" / "ep-a")
    assert list(cache.iterdir()) == []  # its private directory removed at exit


@pytest.mark.parametrize("data_path", ["python", "haproxy"])
def test_router_command_discovers_the_pods_the_webhook_labels(cluster: Any, tmp_path: Path, hostpath: Path,
                                                              data_path: str) -> None:
    """The g6e overlay's router container (its args, its ConfigMap) against the API emulator: it routes to
    the endpoint pod that carries the label the webhook adds, and ignores an unpatched one. Both values of the
    ConfigMap's KVTIER_ROUTER_DATA_PATH (haproxy: the real haproxy child, run as the manifest's user)."""
    import copy
    import json

    from operator_helpers import load_yaml

    pytest.importorskip("router.l2", reason="kvtier router's --l2fs-master support (router/l2.py) is not in the tree yet")

    from operator_patch.patch import PatchConfig, mutate

    out = subprocess.run([_kubectl(), "kustomize", str(ROOT / "deploy/overlays/hyperpod-g6e")], capture_output=True,
                         text=True, timeout=120, check=True)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    router = container(docs, "Deployment", "kvtier-router")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvtier-router-config")]
    engine_port, router_port = free_port(), free_port()
    env = Env.__new__(Env)
    env.tmp, env.procs = tmp_path, []
    if data_path == "haproxy" and not shutil.which("haproxy"):
        pytest.skip("haproxy not installed (.ci/install)")
    assert cm["data"]["KVTIER_ROUTER_DATA_PATH"] == "python"  # the manifest's default; overridden below
    env.vars = {**cm["data"], "ROUTER_ENGINE_PORT": str(engine_port), "ROUTER_PORT": str(router_port),
                "POD_NAMESPACE": cm["metadata"]["namespace"], "POD_IP": "127.0.0.1",
                "KVTIER_ROUTER_DATA_PATH": data_path}
    env.secrets = {("kvtier-router-api-key", "api-key"): "router-key",
                   ("kvtier-router-l2fs-token", "token"): "router-token-0123456789"}
    # the tokenizer init container's emptyDir, filled here with a locally trained tokenizer instead of S3
    from kvtier.devstack.tiny_model import build_tokenizer

    # the router runs as its manifest's user (65532): its emptyDir is a path that user can reach
    tok_mount = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}["tokenizer"]
    build_tokenizer(hostpath / "tokenizer", 1000, 0)
    router = {**router, "args": [str(hostpath / "tokenizer") if a == tok_mount else a for a in router["args"]]}
    rendered = load_yaml("rendered-v3.2-stripped.yaml")
    rendered["metadata"]["name"] = rendered["metadata"]["ownerReferences"][0]["name"] = "qwen2-7b"
    # the webhook's vLLM KV-event ports (named kv-events / kv-replay) on free local ports
    events_port, replay_port = free_port(), free_port()
    patched = mutate(rendered, PatchConfig(kv_events_port=events_port, kv_replay_port=replay_port))

    def pod(name: str, template: dict[str, Any], ip: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "team-a", "labels": template["metadata"]["labels"]},
                "spec": copy.deepcopy(template["spec"]),
                "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    from kubernetes import client

    core = client.CoreV1Api(cluster.api)
    core.create_namespaced_pod("team-a", pod("qwen2-7b-patched", patched["spec"]["template"], "127.0.0.1"))
    core.create_namespaced_pod("team-a", pod("qwen2-7b-unpatched", rendered["spec"]["template"], "127.0.0.2"))
    replica = subprocess.Popen([sys.executable, "-m", "kvtier.devstack.testreplica", "--port", str(engine_port),
                                "--kv-events", f"tcp://127.0.0.1:{events_port}",
                                "--kv-replay", f"tcp://127.0.0.1:{replay_port}"], cwd=ROOT,
                               stdout=open(tmp_path / "replica.log", "wb"), stderr=subprocess.STDOUT)
    env.procs.append(replica)
    try:
        router = {**router, "args": router["args"] + ["--k8s-api", cluster.url]}
        proc = env.start(router, "router.log")
        deadline = time.monotonic() + 180  # start-up imports + first discovery; a parallel suite took > 60 s once
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/health", timeout=2) as r:
                    health = json.loads(r.read())
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-2000:]
            time.sleep(0.5)
        assert [r["url"] for r in health["replicas"]] == [f"http://127.0.0.1:{engine_port}"]
        assert health["default_strategy"] == cm["data"]["ROUTER_STRATEGY"]
        # the API key from its Secret is enforced (health and metrics stay open for probes and Prometheus)
        req = urllib.request.Request(f"http://127.0.0.1:{router_port}/v1/models")
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(req, timeout=5)
        assert denied.value.code == 401
        req.add_header("Authorization", "Bearer router-key")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        # the router found the pod's kv-events/kv-replay ports by name and indexes the engine's KV events
        body = json.dumps({"model": "test-model", "prompt": "kv events " * 40, "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{router_port}/v1/completions", data=body, method="POST",
                                     headers={"Authorization": "Bearer router-key", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and r.headers["x-kvtier-data-path"] == data_path

        def indexed() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=5) as r:
                text = r.read().decode()
            blocks = re.search(r"^kvtier_router_kv_index_blocks (\S+)$", text, re.M)
            return bool(blocks and float(blocks.group(1)) > 0)

        wait_until(indexed, 30, 0.5,
                   message=lambda: "no KV event indexed:\n" + (tmp_path / "router.log").read_text()[-2000:])
    finally:
        env.stop()
