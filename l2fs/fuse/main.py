"""`l2fs mount`: flags, the pyfuse3 mount loop, and spawn/stop helpers that start a mount as a child process."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import stat as st
import subprocess
import sys
import time
from collections.abc import Sequence

import pyfuse3
import trio

from l2fs.client import (
    Client,
    L2fsError,
)
from l2fs.common import DEFAULT_MAX_FILE_SIZE, parse_size
from l2fs.fuse.operations import READ_CACHE, L2Operations
from l2fs.options import ClientOptions, add_client_args

log = logging.getLogger("l2fs.fuse")


# -------------------------------------------------------------------- child-process helpers
def spawn(mountpoint: str | os.PathLike[str], master: str, *args: str, log: str | os.PathLike[str] | None = None,
          timeout: float = 20.0) -> subprocess.Popen:
    """Start `l2fs mount MOUNTPOINT --master MASTER ARGS...` as a child process (its own session) and
    return once the kernel shows the mount; raises with the log tail if it exits or times out."""
    mp = os.path.abspath(mountpoint)
    if mount_type(mp) == "fuse.l2fs":
        raise RuntimeError(f"{mp} already has an l2fs mount; unmount it first: fusermount3 -u {mp}")
    os.makedirs(mp, exist_ok=True)
    cmd = [sys.executable, "-m", "l2fs.cli", "mount", mp, "--master", master, *args]
    if log:
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while mount_type(mp) != "fuse.l2fs":
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            tail = open(log, errors="replace").read()[-2000:] if log else ""
            raise RuntimeError(f"l2fs mount of {mp} did not come up (rc {proc.returncode}): {tail}")
        time.sleep(0.05)
    return proc


def mount_type(mountpoint: str | os.PathLike[str]) -> str | None:
    """File system type of the topmost mount at this path (e.g. "fuse.l2fs"), or None. Unlike
    os.path.ismount this also sees a FUSE mount whose daemon died (where stat fails with ENOTCONN)."""
    mp = os.path.abspath(mountpoint)
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split(" ")
            target = fields[1]
            if "\\" in target:  # octal escapes for space, tab, newline, backslash
                target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), target)
            if target == mp:
                found = fields[2]
    return found


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether the kernel lists any mount at this path, dead FUSE mounts included."""
    return mount_type(mountpoint) is not None


def stop(proc: subprocess.Popen, mountpoint: str | os.PathLike[str], sig: int = signal.SIGTERM,
         timeout: float = 15.0) -> int | None:
    """Signal a spawned mount and wait for it to unmount and exit; kill and lazy-unmount as a last resort."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for _ in range(4):  # FUSE mounts stacked by mistake: peel them all (never the volume underneath)
        if not (mount_type(mountpoint) or "").startswith("fuse"):
            break
        subprocess.run(["fusermount3", "-u", "-z", os.fspath(mountpoint)], capture_output=True)
    return proc.returncode


# -------------------------------------------------------------------- CLI
def stat_is_dir(path: str) -> bool:
    """True for a directory, False for anything else or nothing; other OSErrors (ENOTCONN...) propagate."""
    try:
        return st.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="l2fs mount", description="Mount an l2fs cluster with FUSE (foreground; "
                                "SIGTERM/SIGINT unmount cleanly).")
    p.add_argument("mountpoint")
    add_client_args(p, timeout=2.0, help={"token_file": (
                   "read the bearer token from this file at every call instead ($L2FS_TOKEN_FILE): the pod's "
                        "projected ServiceAccount token, which the kubelet rotates and the master reviews "
                        "(master --mount-sa); wins over --token. Workers do not know such a token: writes go over the "
                        "workers' raw-TCP data plane with the master's capabilities (needs a master with a block "
                        "key and no TLS); same-node reads still short-circuit")})
    p.add_argument("--root", default="/", help="l2fs directory shown at the mountpoint (default /)")
    p.add_argument("--read-only", action="store_true", help="mount read-only (writes fail with EROFS)")
    p.add_argument("--cache-timeout", type=float, default=1.0,
                   help="kernel entry/attr cache seconds, at most 1 (default 1)")
    p.add_argument("--page-cache", action="store_true",
                   help="read-only opens use the kernel page cache; an open of an unchanged file keeps its pages "
                        "(re-reads without a fetch; cold reads are slower than with the default direct_io)")
    p.add_argument("--threads", type=int, default=16, help="concurrent RPCs (default 16)")
    p.add_argument("--max-file-size", default=str(DEFAULT_MAX_FILE_SIZE),
                   help="largest file a write or truncate may make, EFBIG beyond (default 1G, as the master)")
    p.add_argument("--write-buffer", default=None,
                   help="cap on the bytes buffered for unfinished writes across the mount, ENOSPC beyond "
                        "(default 2x --max-file-size)")
    p.add_argument("--read-cache", default=str(READ_CACHE),
                   help="cap on the bytes of read snapshots held for open read-only files (least recently read "
                        "dropped first, fetched again at the next read; default 256M)")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount")
    p.add_argument("--uid", type=int, default=None,
                   help="owner of every file and directory (default: the mounting user); implies --allow-other")
    p.add_argument("--gid", type=int, default=None,
                   help="group of every file and directory (default: the mounting group); implies --allow-other")
    p.add_argument("--umask", type=lambda v: int(v, 8), default=0o022,
                   help="octal umask applied to 0777 (dirs) and 0666 (files), enforced by the kernel (default 022)")
    p.add_argument("-o", dest="options", action="append", default=[], help="extra FUSE mount option")
    p.add_argument("--endpoints", metavar="DIR",
                   help="serve one mount per endpoint instead: DIR holds a file per endpoint ({\"root\": its "
                        "prefix, \"token\": its mount-role token}; Secret l2fs-endpoint-mounts of `kvtier tokens "
                        "generate`), each mounted at MOUNTPOINT/<endpoint>/<endpoint> (inside the plain directory "
                        "MOUNTPOINT/<endpoint>: give pods that, not the mount) showing only its root, with only its "
                        "token; DIR is re-read (new endpoints mounted, removed ones unmounted, others untouched)")
    p.add_argument("--endpoints-poll", type=float, default=5.0, metavar="SECONDS",
                   help="with --endpoints: seconds between re-reads of DIR (default 5)")
    p.add_argument("--status-file", metavar="PATH",
                   help="with --endpoints: rewritten every pass, first line 'ready' once every endpoint's mount "
                        "is live (else 'waiting'): for the probes")
    p.add_argument("--passthrough", nargs="?", const="on", choices=("on", "auto"), default=None,
                   help="with --endpoints: each endpoint's mount is the passthrough server (`l2fs mount --passthrough "
                        "--help`; Linux >= 6.9), its temp and cross-node files under --cache-dir; "
                        "--passthrough=auto: where a probe at start finds the kernel offering FUSE passthrough, "
                        "else the pyfuse3 mount (older kernels keep it)")
    p.add_argument("--cache-dir", default=None,
                   help="with --passthrough: where each endpoint's mount keeps its files being written and its "
                        "cross-node copies, each in its own private subdirectory (default: $TMPDIR or /tmp); "
                        "its file system's free space bounds the bytes written but not yet published")
    p.add_argument("--cache-size", default=None,
                   help="with --passthrough: bound on each endpoint mount's cross-node copies (default 4G)")
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)
    if not a.master:
        p.error("--master HOST:PORT (or $L2FS_MASTER) is required")
    if a.cache_timeout < 0 or a.cache_timeout > 1:
        p.error("--cache-timeout must be within 0..1 s (cross-node visibility)")
    if a.threads < 1:
        p.error("--threads must be >= 1")
    try:
        a.max_file_size = parse_size(a.max_file_size)
        a.write_buffer = 2 * a.max_file_size if a.write_buffer is None else parse_size(a.write_buffer)
        a.read_cache = parse_size(a.read_cache)
    except ValueError as e:
        p.error(f"bad size: {e}")
    if not 0 <= a.umask <= 0o777:
        p.error("--umask must be an octal mode within 000..777")
    if a.max_file_size < 1 or a.write_buffer < 1 or a.read_cache < 1:
        p.error("--max-file-size, --write-buffer and --read-cache must be positive")
    try:
        kind = mount_type(a.mountpoint)  # a volume mount (k8s emptyDir, hostPath) is fine to mount over
        if kind and kind.startswith("fuse"):
            p.error(f"{a.mountpoint} already has a {kind} mount (live or dead); unmount it first: "
                    f"fusermount3 -u {a.mountpoint}")
        if not stat_is_dir(a.mountpoint):
            p.error(f"mountpoint {a.mountpoint!r} is not a directory")
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            p.error(f"{a.mountpoint} is a dead FUSE mount (its daemon exited): run fusermount3 -u {a.mountpoint}")
        p.error(f"mountpoint {a.mountpoint!r}: {e.strerror}")
    if not a.root.startswith("/"):
        p.error("--root must be an absolute l2fs path")
    if a.endpoints:
        if a.root != "/" or a.token or a.token_file:
            p.error("--endpoints takes each endpoint's root and token from its file: no --root, --token, "
                    "--token-file ($L2FS_TOKEN, $L2FS_TOKEN_FILE)")
        if a.endpoints_poll <= 0:
            p.error("--endpoints-poll must be positive")
    elif a.status_file:
        p.error("--status-file needs --endpoints")
    if a.passthrough and not a.endpoints:
        p.error("--passthrough without --endpoints is `l2fs mount --passthrough` (its own server)")
    if (a.cache_dir or a.cache_size) and not a.passthrough:
        p.error("--cache-dir and --cache-size need --passthrough")
    if a.passthrough and a.options:
        p.error("-o is not taken by the passthrough mount")
    if a.passthrough and a.cache_size:
        try:
            parse_size(a.cache_size)
        except ValueError as e:
            p.error(f"bad size: {e}")
    return a


async def _serve() -> None:
    """Run the FUSE loop until unmounted or signalled."""
    async with trio.open_nursery() as nursery:
        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for s in sigs:
                    log.info("signal %d: unmounting", s)
                    pyfuse3.terminate()
                    return
        nursery.start_soon(on_signal)
        await pyfuse3.main(min_tasks=2, max_tasks=64)
        nursery.cancel_scope.cancel()


def resolve_auto_passthrough(a: argparse.Namespace) -> None:
    """--passthrough=auto: "on" where this kernel offers FUSE passthrough (a throwaway mount's INIT, in a
    scratch directory under $TMPDIR), else None, the pyfuse3 mount, without the passthrough-only cache flags.
    Decided once, before any endpoint is mounted, so every endpoint's mount is of the same kind."""
    import tempfile

    from l2fs.fuse.kernel import passthrough_offered

    scratch = tempfile.mkdtemp(prefix="l2fs-probe-")
    try:
        offered, why = passthrough_offered(scratch), "the kernel does not offer FUSE passthrough"
    except OSError as e:
        offered, why = False, f"the probe mount failed ({e})"
    finally:
        os.rmdir(scratch)
    if offered:
        log.info("--passthrough=auto: kernel %s offers FUSE passthrough: passthrough mounts", os.uname().release)
        a.passthrough = "on"
    else:
        log.warning("--passthrough=auto: %s (kernel %s): pyfuse3 mounts", why, os.uname().release)
        a.passthrough = a.cache_dir = a.cache_size = None


def main(argv: Sequence[str] | None = None) -> int:
    """`l2fs mount MOUNTPOINT --master HOST:PORT [...]`; returns the exit status."""
    a = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.INFO,
                        format="%(asctime)s l2fs-mount %(levelname)s %(message)s")
    if a.endpoints:
        from l2fs.fuse.endpoints import EndpointMounts, child_args

        if a.passthrough == "auto":
            resolve_auto_passthrough(a)

        return EndpointMounts(a.mountpoint, a.endpoints, child_args(a), poll=a.endpoints_poll,
                              status_file=a.status_file).run()
    copts = ClientOptions.from_args(a)
    # A ServiceAccount token is known to the master (TokenReview), not to the workers (they hold token digests
    # only): writes then move with the master's per-block capabilities over the data plane (same-node
    # ReserveLocal/AdoptLocal need a token the worker knows); same-node reads still take fds from the worker's
    # socket, which checks capabilities only.
    client = Client(a.master, **copts.client_kwargs(), local_writes=False if copts.token_file else None)
    root = a.root.rstrip("/") or "/"
    if root != "/" and not a.read_only:
        try:
            client.mkdir(root, parents=True, exist_ok=True)
        except L2fsError as e:
            log.warning("could not create --root %s now (%s); it must exist for the mount to work", root, e)
    ops = L2Operations(client, root=root, read_only=a.read_only, timeout=a.cache_timeout,
                       direct_io=not a.page_cache, threads=a.threads, max_file_size=a.max_file_size,
                       write_buffer=a.write_buffer, uid=a.uid, gid=a.gid, umask=a.umask, read_cache=a.read_cache)
    opts = set(pyfuse3.default_options)
    opts |= {f"fsname=l2fs:{a.master.split(',')[0]}{root}", "subtype=l2fs", "noatime"}
    if a.read_only:
        opts.add("ro")
    if a.allow_other or a.uid is not None or a.gid is not None:  # another owner must be let in
        opts.add("allow_other")
    opts.update(a.options)
    mp = os.path.abspath(a.mountpoint)
    try:
        pyfuse3.init(ops, mp, opts)
    except RuntimeError as e:
        print(f"l2fs mount: cannot mount {mp}: {e} (is it already mounted? try fusermount3 -u {mp})",
              file=sys.stderr)
        client.close()
        return 1
    log.info("mounted l2fs %s%s at %s (node %s%s)", a.master, root, mp, a.node_id or "-",
             ", read-only" if a.read_only else "")
    rc = 0
    try:
        trio.run(_serve)
    except BaseException as e:  # noqa: BLE001 - unmount whatever happened
        log.exception("FUSE loop failed: %r", e)
        rc = 1
    finally:
        pyfuse3.close(unmount=True)
        client.close()
        log.info("unmounted %s", mp)
    return rc


if __name__ == "__main__":
    sys.exit(main())
