"""`l2fs` command: servers (master, worker, local, mount) and file commands (put, get, cat, ls, stat, rm,
mkdir, mv, report). File commands find the master in --master or $L2FS_MASTER."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

USAGE = """usage: l2fs <command> [args]

servers:
  master   --port 8995 [--heartbeat-timeout 10] [--metrics-port 0] [--token T] [--shard K/N]
  worker   --master HOST:PORT --data-dir PATH[:CAP] [--data-dir ...] --node-id NAME [--port 8997]
  local    --workers 2 --dir ./.l2fs [--shards N]  (master(s) + N workers on loopback until Ctrl-C)
--master everywhere: HOST:PORT, failover masters "H1:P,H2:P", shards "M0:P;M1:P" (';' between shards,
  each shard's master started with --shard K/N; paths are routed by crc32(path) % N)
  mount    see `l2fs mount --help`              (FUSE mount)
  netns    up|down|cleanup|exec|list|chaos      (network-namespace nodes, see docs/netns.md)
files (--master HOST:PORT or $L2FS_MASTER):
  put LOCAL_FILE|- PATH [--overwrite]   get PATH [LOCAL_FILE]   cat PATH
  ls [PATH] [--json]   stat PATH [--json]   rm PATH   mkdir PATH   mv SRC DST   report [--json]
"""


def _client_parser(prog: str) -> argparse.ArgumentParser:
    from l2fs.options import add_client_args

    p = argparse.ArgumentParser(prog=f"l2fs {prog}")
    add_client_args(p, timeout=10.0)
    return p


def _files(cmd: str, argv: list[str]) -> int:
    from l2fs.client import Client, L2fsError
    from l2fs.options import ClientOptions

    p = _client_parser(cmd)
    if cmd == "put":
        p.add_argument("src", help="local file or - for stdin")
        p.add_argument("path")
        p.add_argument("--overwrite", action="store_true", help="replace an existing file")
        p.add_argument("--order-hint", type=int, default=None)
    elif cmd == "get":
        p.add_argument("path")
        p.add_argument("dst", nargs="?", help="local file (default: basename of PATH)")
    elif cmd in ("cat", "rm", "mkdir"):
        p.add_argument("path")
    elif cmd in ("ls", "stat"):
        p.add_argument("path", nargs="?" if cmd == "ls" else None, default="/")
        p.add_argument("--json", action="store_true")
    elif cmd == "mv":
        p.add_argument("src")
        p.add_argument("dst")
        p.add_argument("--no-overwrite", action="store_true")
    elif cmd == "report":
        p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.master:
        print(f"l2fs {cmd}: give --master HOST:PORT or set L2FS_MASTER", file=sys.stderr)
        return 2
    try:
        with Client(args.master, **ClientOptions.from_args(args).client_kwargs()) as c:
            return _run(c, cmd, args)
    except L2fsError as e:
        print(f"l2fs {cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"l2fs {cmd}: {e}", file=sys.stderr)
        return 1


def _run(c: object, cmd: str, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from l2fs.client import Client

    assert isinstance(c, Client)
    if cmd == "put":
        data = sys.stdin.buffer.read() if args.src == "-" else Path(args.src).read_bytes()
        published = c.put(args.path, data, if_absent=not args.overwrite, order_hint=args.order_hint)
        print(f"{args.path}: {'published' if published else 'already exists (kept)'} ({len(data)} bytes)")
        return 0
    if cmd in ("get", "cat"):
        data = c.get(args.path)
        if data is None:
            print(f"l2fs {cmd}: {args.path}: not found (miss)", file=sys.stderr)
            return 1
        if cmd == "cat":
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            dst = args.dst or os.path.basename(args.path)
            with open(dst, "wb") as f:
                f.write(data)
            print(f"{args.path} -> {dst} ({len(data)} bytes)")
        return 0
    if cmd == "ls":
        infos = c.ls(args.path)
        if args.json:
            print(json.dumps([asdict(i) for i in infos], indent=1))
        for i in infos if not args.json else []:
            kind = "d" if i.is_dir else "-"
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.mtime)) if i.mtime else "-" * 19
            print(f"{kind} {i.size:>12} {when} {i.path}{'/' if i.is_dir else ''}  {','.join(i.nodes)}")
        return 0
    if cmd == "stat":
        info = c.stat(args.path)
        if info is None:
            print(f"l2fs stat: {args.path}: not found", file=sys.stderr)
            return 1
        print(json.dumps(asdict(info), indent=1 if args.json else None))
        return 0
    if cmd == "rm":
        removed = c.rm(args.path)
        print(f"{args.path}: {'removed' if removed else 'not found'}")
        return 0 if removed else 1
    if cmd == "mkdir":
        c.mkdir(args.path)
        return 0
    if cmd == "mv":
        c.rename(args.src, args.dst, overwrite=not args.no_overwrite)
        return 0
    if cmd == "report":
        rep = c.report()
        if args.json:
            print(json.dumps(asdict(rep), indent=1))
            return 0
        print(f"files {rep.files}  capacity {rep.capacity}  used {rep.used}"
              f" ({100 * rep.used / rep.capacity if rep.capacity else 0:.1f}%)"
              + (f"  duplicate-content files {rep.duplicate_files} (diverging cache keys?)"
                 if rep.duplicate_files else ""))
        for w in rep.workers:
            print(f"  {w.worker_id:<24} node={w.node_id:<12} {w.address:<21} "
                  f"{'alive' if w.alive else 'DEAD ':<5} used {w.used}/{w.capacity} blocks {w.blocks}")
        return 0
    raise AssertionError(cmd)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch `l2fs <command> ...`; server modules are imported lazily."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "master":
        from l2fs.master.main import main as run
    elif cmd == "worker":
        from l2fs.worker.main import main as run
    elif cmd == "local":
        from l2fs.testing.cluster import main as run
    elif cmd == "mount" and "--passthrough" in rest and not any(r.split("=")[0] == "--endpoints" for r in rest):
        # the native-protocol passthrough server (docs/mount.md); with --endpoints the supervisor starts those
        from l2fs.fuse.passthrough import main as run
    elif cmd == "mount":
        from l2fs.fuse.main import main as run
    elif cmd == "netns":
        from l2fs.testing.netns import main as run
    elif cmd in ("put", "get", "cat", "ls", "stat", "rm", "mkdir", "mv", "report"):
        return _files(cmd, rest)
    else:
        print(f"l2fs: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
