"""`kvtier chaos`: faults on a running `kvtier up --netns` (or `l2fs local --netns`) cluster, from another shell.

A thin front on `l2fs.testing.netns.chaos` (the code of `l2fs netns chaos`): the cluster is found by its prefix
(`--cluster kvt1a2b3c`), or from a `kvtier up` state file (`--from-up`, default ./.kvtier/up.json when it
names a live cluster), or as the only live cluster of ours on the machine. The one thing it adds is naming
a node's process by role (worker, mount, replica) instead of a command-line match, because that is what a
user of the stack thinks in.

    kvtier chaos link-down node-1          kvtier chaos link-up node-1
    kvtier chaos rate node-2 50mbit        kvtier chaos rate node-2 none
    kvtier chaos partition node-1 node-2   kvtier chaos heal node-1 node-2    (ctl = master and router)
    kvtier chaos kill|stop|cont node-1 [--process worker|mount|replica|all]
    kvtier chaos status                    what is cut now, per node
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier.up import DEFAULT_DIR, STATE_NAME
from l2fs.testing.netns import CHAOS_FAULTS, PREFIX_RE, NetnsCluster, NetnsError, chaos, clusters

# What each role's process has in its command line (kvtier up / l2fs local start them so).
PROCESSES = {"worker": "l2fs.cli worker", "mount": "l2fs.cli mount", "replica": "vllm.entrypoints", "all": None}


def find_cluster(prefix: str | None, from_up: Path | None) -> str:
    """The prefix of the cluster to act on: given, from up.json, or the only live one of ours."""
    if prefix:
        return prefix
    up = from_up or DEFAULT_DIR / STATE_NAME
    if up.exists():
        try:
            found = (json.loads(up.read_text()).get("netns") or {}).get("prefix")
        except (OSError, ValueError) as e:
            raise NetnsError(f"cannot read {up}: {e}") from e
        if found and PREFIX_RE.match(found) and found in clusters():
            return str(found)
        if from_up is not None:
            raise NetnsError(f"{up} names no running --netns cluster (stack not started with --netns, or gone)")
    live = [p for p, alive in clusters().items() if alive]
    if len(live) != 1:
        raise NetnsError(f"{'no' if not live else len(live)} running namespace clusters"
                         f"{': ' + ', '.join(live) if live else ''}; name one with --cluster PREFIX")
    return live[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier chaos", description="Inject a fault into a running --netns cluster.",
                                epilog="node: node-K or K; ctl (the master and router's namespace) for "
                                "partition/heal. Undo with link-up, rate NODE none, heal, cont.")
    p.add_argument("fault", choices=(*CHAOS_FAULTS, "status"))
    p.add_argument("node", nargs="?", help="node-K (or K)")
    p.add_argument("arg", nargs="?", help="rate: RATE (e.g. 50mbit) or none; partition/heal: the other node")
    p.add_argument("--cluster", default=None, metavar="PREFIX", help="the cluster's prefix, e.g. kvt1a2b3c")
    p.add_argument("--from-up", type=Path, default=None, metavar="UP_JSON",
                   help=f"a `kvtier up --netns` state file (default {DEFAULT_DIR / STATE_NAME} if it names a live one)")
    p.add_argument("--kind", choices=("blackhole", "prohibit"), default="blackhole",
                   help="partition: blackhole drops packets (calls time out), prohibit refuses at once")
    p.add_argument("--process", choices=tuple(PROCESSES), default="worker",
                   help="kill/stop/cont: which of the node's processes, with the process group each leads "
                   "(a replica's engine processes too; default: its l2fs worker)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        c = NetnsCluster.attach(find_cluster(args.cluster, args.from_up))
        if args.fault == "status":
            print(json.dumps({"prefix": c.prefix, "nodes": c.fault_state()}, indent=1))
            return 0
        if args.node is None:
            raise NetnsError(f"{args.fault} needs a node (node-K)")
        done, message = chaos(c, args.fault, args.node, args.arg, kind=args.kind, match=PROCESSES[args.process],
                              group=True)
    except NetnsError as e:
        print(f"kvtier chaos: {e}", file=sys.stderr)
        return 2
    print(f"{c.prefix}: {message}")
    return 0 if done else 1
