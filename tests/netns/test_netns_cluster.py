"""The namespace cluster itself: reachability over the bridge, an untouched host, the shaper as the bound,
partitions, link and process faults, netem refusal, cleanup of crashed launchers, two launchers at once."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_helpers import echo_server, host_net, reaches, wait_reaches
from polling import wait_until

from l2fs.testing.netns import (
    NETNS_DIR,
    STATE_DIR,
    NetnsCluster,
    NetnsError,
    cleanup,
    netem_available,
    parse_rate,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_parse_rate_like_tc() -> None:
    assert parse_rate("10gbit") == 10_000_000_000
    assert parse_rate("2gbit") == 2_000_000_000
    assert parse_rate("500mbit") == 500_000_000
    assert parse_rate("1.5mbit") == 1_500_000
    assert parse_rate("12mbps") == 96_000_000  # tc: bps = bytes per second
    assert parse_rate("1mibit") == 1024 * 1024
    assert parse_rate("64000") == 64_000  # bare number: bits per second
    for bad in ("fast", "10 gigabit", "", "-5mbit", "1bit"):
        with pytest.raises(NetnsError):
            parse_rate(bad)


def test_nodes_reach_each_other_and_host_is_untouched(netns_host: None) -> None:
    before = host_net()
    with NetnsCluster(3) as c:
        assert host_net() == before, "the cluster added interfaces, addresses or routes to the host"
        subnet = ipaddress.ip_network(c.describe()["subnet"])
        addrs = [c.ctl.addr, *(n.addr for n in c.nodes)]
        assert len(set(addrs)) == 4 and all(ipaddress.ip_address(a) in subnet for a in addrs)
        assert all(ns.netns.startswith(c.prefix + "-") and (NETNS_DIR / ns.netns).exists()
                   for ns in c.namespaces)
        n2 = echo_server(c, 2)
        ctl = echo_server(c, "ctl")
        assert reaches(c, 1, n2) and reaches(c, 3, n2) and reaches(c, 2, ctl)
        # the node namespaces see only their own address: nothing of the host's is there
        out = c.run(1, ["ip", "-o", "-4", "addr", "show"], text=True).stdout
        assert sorted(line.split()[3] for line in out.splitlines()) == sorted(
            ["127.0.0.1/8", f"{c.nodes[0].addr}/{subnet.prefixlen}"])
        names = [ns.netns for ns in c.namespaces]
    assert host_net() == before
    assert not any((NETNS_DIR / n).exists() for n in names)
    assert not (STATE_DIR / f"{c.prefix}.json").exists()


@pytest.mark.parametrize("netns_cluster", [{"nodes": 2, "link": "200mbit"}], indirect=True)
def test_shaper_is_the_bound_and_rate_cut_is_live(netns_cluster: NetnsCluster) -> None:
    c = netns_cluster
    shaped = c.tcp_throughput(1, 2, 10_000_000)  # ~0.4 s at 200 Mbit/s
    assert shaped < 2 * 200e6, f"{shaped / 1e6:.0f} Mbit/s over a 200mbit link: the shaper did not bind"
    c.set_rate(2, "50mbit")  # node-2's link only; it is on the path both ways
    cut = c.tcp_throughput(1, 2, 2_500_000)
    assert cut < 2 * 50e6, f"{cut / 1e6:.0f} Mbit/s after a cut to 50mbit"
    c.set_rate(1, None)
    c.set_rate(2, None)
    free = c.tcp_throughput(1, 2, 10_000_000)
    # the same measurement without shapers is far above the rate, so the bounds above can fail
    assert free > 2 * 200e6, f"unshaped veth only {free / 1e6:.0f} Mbit/s: the test cannot tell"


def test_partition_cuts_one_pair_only_and_heals(netns_cluster: NetnsCluster) -> None:
    c = netns_cluster
    n2, ctl, n1 = echo_server(c, 2), echo_server(c, "ctl"), echo_server(c, 1)
    assert reaches(c, 1, n2)
    c.partition(1, 2)
    assert not reaches(c, 1, n2, timeout=0.5)
    assert not reaches(c, 2, n1, timeout=0.5)
    assert reaches(c, 1, ctl) and reaches(c, 3, n2) and reaches(c, 2, ctl)
    c.heal(1, 2)
    assert reaches(c, 1, n2) and reaches(c, 2, n1)
    with pytest.raises(NetnsError):
        c.partition(1, 1)


def test_link_down_up(netns_cluster: NetnsCluster) -> None:
    c = netns_cluster
    ctl = echo_server(c, "ctl")
    c.link_down(1)
    assert not reaches(c, 1, ctl, timeout=0.5)
    assert reaches(c, 2, ctl)
    c.link_up(1)
    assert wait_reaches(c, 1, ctl)


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_process_faults(netns_cluster: NetnsCluster) -> None:
    c = netns_cluster
    p = c.popen(1, ["sleep", "60"])
    _wait_exec(p.pid)
    # it runs in node-1's network namespace, but shares our mount namespace (a node's FUSE mount is seen)
    assert os.stat(f"/proc/{p.pid}/ns/net").st_ino == os.stat(NETNS_DIR / c.nodes[0].netns).st_ino
    assert os.readlink(f"/proc/{p.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")  # mounts stay shared
    c.pause(p)
    assert _wait_state(p.pid, "T")
    c.resume(p)
    assert _wait_state(p.pid, "S")
    assert c.kill(p) == -signal.SIGKILL


def _wait_exec(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
        time.sleep(0.02)
    return True


def _wait_state(pid: int, want: str) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if _proc_state(pid) == want:
            return True
        time.sleep(0.02)
    return False


def test_delay_and_loss_need_netem(netns_cluster: NetnsCluster) -> None:
    """This kernel has no netem: asking for delay/loss must fail clearly and leave nothing behind."""
    if netem_available(netns_cluster.ctl.netns):
        with NetnsCluster(1, delay="5ms"):
            pass
        return
    delayed, lossy = NetnsCluster(1, delay="5ms"), NetnsCluster(1, loss="1%")
    with pytest.raises(NetnsError, match="netem"):
        with delayed:
            pass
    with pytest.raises(NetnsError, match="netem"):
        lossy.__enter__()
    # only these two clusters' namespaces: other workers' tests create and remove theirs meanwhile
    assert [n for n in os.listdir(NETNS_DIR) if n.startswith((delayed.prefix, lossy.prefix))] == []


CRASHER = """
import os, subprocess, sys
from l2fs.testing.netns import NetnsCluster
c = NetnsCluster(2)
c.start()
mnt = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "kvt-test", mnt], check=True)
c.register_mount(mnt)
p = c.popen(1, ["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(c.prefix, p.pid, flush=True)
os.kill(os.getpid(), 9)  # a launcher that dies without any cleanup
"""


def test_cleanup_removes_crashed_launcher_only(netns_cluster: NetnsCluster, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    crashed = subprocess.run([sys.executable, "-c", CRASHER, str(mnt)], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    prefix, pid = crashed.stdout.split()
    left = [n for n in os.listdir(NETNS_DIR) if n.startswith(prefix + "-")]
    assert sorted(left) == [f"{prefix}-ctl", f"{prefix}-n1", f"{prefix}-n2"]
    assert Path(f"/proc/{pid}").exists()  # its process in node-1 outlived it
    assert os.path.ismount(mnt)  # and so did the mount it registered
    out = subprocess.run([sys.executable, "-m", "l2fs.cli", "netns", "list"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert f"{prefix} pid=" in out and "LEFTOVER" in out.split(prefix)[1].splitlines()[0]
    removed = cleanup()
    assert set(left) <= set(removed) and f"mount {mnt}" in removed
    assert not os.path.ismount(mnt)
    assert not any(n.startswith(prefix) for n in os.listdir(NETNS_DIR))
    assert not (STATE_DIR / f"{prefix}.json").exists()
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _proc_state(int(pid)) == "Z", 5)
    # the live cluster of this process was left alone
    assert all((NETNS_DIR / ns.netns).exists() for ns in netns_cluster.namespaces)
    assert reaches(netns_cluster, 1, echo_server(netns_cluster, 2))


def test_two_launchers_get_distinct_names_and_subnets(netns_cluster: NetnsCluster) -> None:
    a = netns_cluster
    with NetnsCluster(2) as b:
        assert a.prefix != b.prefix
        assert not ipaddress.ip_network(a.describe()["subnet"]).overlaps(ipaddress.ip_network(b.describe()["subnet"]))
        assert not {ns.netns for ns in a.namespaces} & {ns.netns for ns in b.namespaces}
        assert reaches(a, 1, echo_server(a, 2)) and reaches(b, 1, echo_server(b, 2))
    assert reaches(a, 1, echo_server(a, 2))


@pytest.mark.unit
def test_refuses_without_root_or_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    import l2fs.testing.netns as netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="root"):
        netns.NetnsCluster(2)
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda t: None if t == "tc" else f"/usr/sbin/{t}")
    with pytest.raises(NetnsError, match="tc"):
        netns.cleanup()


def _start_up(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "l2fs.cli", "netns", "up", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _described(p: subprocess.Popen[str]) -> dict:
    """The names and addresses `l2fs netns up` prints (indented JSON) once its cluster is up."""
    import json

    lines: list[str] = []
    while not lines or lines[-1] != "}\n":
        line = p.stdout.readline() if p.stdout else ""
        assert line, f"l2fs netns up exited early: {p.stderr.read() if p.stderr else ''}"
        lines.append(line)
    return json.loads("".join(lines))


def test_launchers_started_at_once_get_distinct_subnets(netns_host: None) -> None:
    ps = [_start_up("--nodes", "1") for _ in range(3)]
    try:
        infos = [_described(p) for p in ps]
        nets = [ipaddress.ip_network(i["subnet"]) for i in infos]
        assert len({i["prefix"] for i in infos}) == 3
        assert not any(a.overlaps(b) for k, a in enumerate(nets) for b in nets[k + 1:]), nets
        for p in ps:
            p.terminate()
        assert [p.wait(timeout=20) for p in ps] == [0, 0, 0]
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    assert not any(n.startswith(tuple(i["prefix"] for i in infos)) for n in os.listdir(NETNS_DIR))


def test_cli_up_holds_until_ctrl_c_then_removes_everything(netns_host: None) -> None:
    p = _start_up("--nodes", "2", "--link", "1gbit")
    try:
        info = _described(p)
        names = [info["ctl"]["netns"], *(n["netns"] for n in info["nodes"])]
        assert all((NETNS_DIR / n).exists() for n in names)
        qdisc = subprocess.run(["tc", "-n", names[1], "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc
        bad = subprocess.run([sys.executable, "-m", "l2fs.cli", "netns", "exec", "host", "true"],
                             capture_output=True, text=True, cwd=ROOT)
        assert bad.returncode == 2 and "no namespace of ours" in bad.stderr
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert not any((NETNS_DIR / n).exists() for n in names)
    assert not (STATE_DIR / f"{info['prefix']}.json").exists()


def _netns_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "l2fs.cli", "netns", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


@pytest.mark.parametrize("netns_cluster", [{"nodes": 2, "link": "200mbit"}], indirect=True)
def test_chaos_cli_on_a_cluster_held_by_another_launcher(netns_cluster: NetnsCluster) -> None:
    c = netns_cluster
    n2, n1 = echo_server(c, 2), echo_server(c, 1)
    attached = NetnsCluster.attach(c.prefix)
    assert [(n.name, n.addr) for n in attached.namespaces] == [(n.name, n.addr) for n in c.namespaces]
    assert attached.rates == {"node-1": "200mbit", "node-2": "200mbit"}
    r = _netns_cli("chaos", c.prefix, "partition", "node-1", "2", "--kind", "prohibit")
    assert r.returncode == 0, r.stderr
    assert not reaches(c, 1, n2) and not reaches(c, 2, n1)
    assert _netns_cli("chaos", c.prefix, "heal", "1", "node-2").returncode == 0
    assert reaches(c, 1, n2)
    assert _netns_cli("chaos", c.prefix, "rate", "node-2", "50mbit").returncode == 0
    assert NetnsCluster.attach(c.prefix).rates["node-2"] == "50mbit"
    p = c.popen(2, ["sleep", "61"])
    _wait_exec(p.pid)
    r = _netns_cli("chaos", c.prefix, "kill", "node-2", "--match", "sleep 61")
    assert r.returncode == 0 and str(p.pid) in r.stdout
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert _netns_cli("chaos", c.prefix, "kill", "node-2", "--match", "nothing-like-this").returncode == 1
    bad = _netns_cli("chaos", "kvt000000", "link-down", "node-1")
    assert bad.returncode == 2 and "no cluster of ours" in bad.stderr
    r = _netns_cli("down", c.prefix)
    assert r.returncode == 0 and f"{c.prefix}-ctl" in r.stdout
    assert not any((NETNS_DIR / ns.netns).exists() for ns in c.namespaces)
