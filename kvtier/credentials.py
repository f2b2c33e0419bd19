"""`kvtier tokens`: scoped l2fs credentials for a cluster, and the worker's pick of its own.

Why a generator: l2fs checks each call's token against a tokens file (docs/l2fs.md, "Scoped tokens"). Which pod
holds what (deploy/base):
- the master: the whole file (Secret l2fs-tokens): it calls workers with the "master" entry's token;
- workers: the verifier file only (Secret l2fs-token-verifiers: each token's SHA-256, no token), enough to check
  the tokens of the master and of clients but useless to act as any of them; a worker proves who it is with its
  pod's projected ServiceAccount token, which the master checks with a TokenReview and binds to the node the
  review names (`l2fs master --worker-identity k8s`, l2fs/master/identity.py);
- clients never see either file: engines and the router get one token each, in their own Secrets;
- engine tokens read only their own prefix and the key-compat records (`read_prefixes`, docs/l2fs.md "Read
  scopes"): an endpoint cannot list, look up or read another's KV; router and admin tokens read everything;
- the FUSE mount DaemonSet of deploy/base holds one mount-role token per endpoint (`mount-<endpoint>`, prefixes
  and read_prefixes: that endpoint's prefix only; Secret l2fs-endpoint-mounts) and serves each endpoint at
  <mount path>/<endpoint> with `--root` its prefix; the webhook gives an endpoint's vLLM pods only their own
  endpoint's directory. Why per endpoint: one node-wide mount credential covered every endpoint's KV, so a pod
  of endpoint A planted chunks under B's prefix that B's engine then loaded. Every --engine gets one (unused
  in plugin mode, where the mounts are read-only). `--mount` (one mount-role token for every kvtier prefix,
  Secret l2fs-mount-token) is for mounts outside Kubernetes: every holder of it is the same credential.

Clusters without TokenReview node names (Kubernetes < 1.32) can keep tokens-file workers: `--workers NODE...`
adds one entry per node, named `worker-<node name>` and bound to it ("node"), and each worker container starts
through `kvtier tokens exec --entry worker-$(NODE_NAME)`, which exports its own token as L2FS_TOKEN (those pods
then need the whole file, so one node's pod can act as another's: prefer the ServiceAccount identity).

The master's block key (l2fs master --block-key-file) is written next to the tokens file (`block-key`, kept
when it exists: a new key unpublishes every cached block) and, with --secret-yaml, as Secret
`l2fs-block-key` that only the master mounts.

  kvtier tokens generate --engine qwen2-7b@team-a --router team-a --admin \
      -o tokens.json --secret-yaml secrets.yaml      # also token-verifiers.json next to tokens.json
  kvtier tokens exec --entry worker-node-a --role worker -- l2fs worker ...   # tokens-file workers only
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

from kvtier import contract

TOKENS_SECRET = "l2fs-tokens"  # namespace kvtier: the whole file (master + workers only)
TOKENS_KEY = "tokens.json"
VERIFIERS_SECRET = "l2fs-token-verifiers"  # namespace kvtier: every token's SHA-256 only (workers)
VERIFIERS_KEY = "verifiers.json"
MOUNT_SECRET = "l2fs-mount-token"  # namespace kvtier: the FUSE mount's mount-role token
# namespace kvtier: one key per endpoint, {"root": its prefix, "token": its mount-role token}, read by the mount
# DaemonSet (l2fs mount --endpoints), which serves each endpoint's prefix alone at <mount path>/<endpoint>/<endpoint>
ENDPOINT_MOUNTS_SECRET = "l2fs-endpoint-mounts"
ROUTER_SECRET = "kvtier-router-l2fs-token"  # the router's namespace: its router-role token
ENGINE_SECRET = "{endpoint}-l2fs-token"  # the endpoint's namespace: its engine-role token (webhook default)
TOKEN_KEY = "token"
BLOCK_KEY_SECRET = "l2fs-block-key"  # namespace kvtier: the master's block-id MAC key (master only)
BLOCK_KEY_KEY = "block-key"
MOUNT_ENTRY = "mount-"  # + endpoint: the endpoint's own mount credential
MASTER_ENTRY = "master"  # worker role, first in the file: the token the master calls workers with


def _token() -> str:
    return secrets.token_hex(32)


def _node(name: str) -> str:
    """`kubectl get nodes -o name` prints node/<name>; accept both."""
    return name.removeprefix("node/").strip()


ENDPOINT_NAME = re.compile(r"[A-Za-z0-9][-._A-Za-z0-9]{0,252}")


def parse_engine(spec: str, namespace: str) -> tuple[str, str, str]:
    """ENDPOINT[:PREFIX][@NAMESPACE] -> (endpoint, prefix, namespace). The default prefix is the one the webhook
    files the endpoint under (<KV prefix>/<endpoint>/<revision>/...), so one token covers every revision."""
    rest, _, ns = spec.partition("@")
    endpoint, _, prefix = rest.partition(":")
    if not ENDPOINT_NAME.fullmatch(endpoint):  # also a Secret key and a directory name (ENDPOINT_MOUNTS_SECRET)
        raise ValueError(f"--engine {spec!r}: want ENDPOINT[:PREFIX][@NAMESPACE], ENDPOINT a name like an "
                         f"InferenceEndpointConfig's (letters, digits, '-', '.', '_')")
    prefix = prefix or f"{contract.KV_PREFIX.rstrip('/')}/{endpoint}"
    if not prefix.startswith("/") or prefix.rstrip("/") == "":
        raise ValueError(f"--engine {spec!r}: the prefix must be an absolute l2fs directory other than /")
    return endpoint, prefix.rstrip("/"), ns or namespace


def generate(workers: list[str], engines: list[tuple[str, str, str]], routers: list[str], mount: bool, admin: bool,
             keep: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The tokens file entries. `keep` (an earlier file) lends its tokens to entries of the same name and role,
    so adding a node does not rotate everyone; entries it has that are not asked for are dropped (revoked)."""
    old = {(e.get("name"), e.get("role")): e.get("token") for e in keep or []}
    entries: list[dict[str, Any]] = []

    def add(name: str, role: str, prefixes: list[str] | None = None, node: str = "",
            reads: list[str] | None = None) -> None:
        if any(e["name"] == name for e in entries):
            raise ValueError(f"entry {name!r} asked for twice")
        entry: dict[str, Any] = {"name": name, "token": old.get((name, role)) or _token(), "role": role}
        if prefixes:
            entry["prefixes"] = prefixes
        if reads is not None:
            entry["read_prefixes"] = reads
        if node:
            entry["node"] = node
        entries.append(entry)

    add(MASTER_ENTRY, "worker")
    for node in workers:
        add(f"worker-{_node(node)}", "worker", node=_node(node))
    # Read scopes, written out (l2fs's default for an entry without them is the same for engines): an engine
    # reads its own prefix and every replica's key-compat record (connector.fingerprint), no other endpoint's KV
    for endpoint, prefix, _ in engines:
        add(f"engine-{endpoint}", "engine", [prefix], reads=[prefix, contract.META_PREFIX])
    for endpoint, prefix, _ in engines:  # the endpoint's mount (mount mode): its prefix, nothing else
        add(f"{MOUNT_ENTRY}{endpoint}", "mount", [prefix], reads=[prefix])
    for ns in routers:  # reads everything: it looks every endpoint's chunks up
        add(f"router-{ns}", "router")
    if mount:  # creates under kvtier's prefixes; replaces, renames and deletes only files it wrote itself
        every = [contract.KV_PREFIX, contract.MP_PREFIX, contract.META_PREFIX]
        add("mount", "mount", every, reads=every)
    if admin:
        add("admin", "admin")
    return entries


def verifiers(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verifier file of `entries`: the same entries with each token replaced by its SHA-256 (l2fs accepts
    the token, but a holder of this file cannot present one)."""
    from l2fs.common import token_digest

    return [{k: v for k, v in {**e, "sha256": token_digest(e["token"])}.items() if k != "token"} for e in entries]


def _secret(name: str, namespace: str, data: dict[str, str], what: str, field: str = "stringData") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "kvtier"},
                         "annotations": {"kvtier.io/holds": what}},
            field: data}


def secrets_for(entries: list[dict[str, Any]], engines: list[tuple[str, str, str]], namespace: str,
                block_key: bytes | None = None) -> list[dict[str, Any]]:
    """The Secrets deploy/ and the webhook reference: the whole file for master/workers, the block key for the
    master alone, one token each for the mount, every engine (in its namespace) and every router namespace."""
    by_name = {e["name"]: e["token"] for e in entries}
    out = [_secret(TOKENS_SECRET, namespace, {TOKENS_KEY: json.dumps(entries)},
                   "every l2fs token: the l2fs master only (tokens-file workers too)"),
           _secret(VERIFIERS_SECRET, namespace, {VERIFIERS_KEY: json.dumps(verifiers(entries))},
                   "SHA-256 of every l2fs token, no token: l2fs workers")]
    if block_key is not None:  # base64 `data`: the key file's bytes exactly, whatever they are
        out.append(_secret(BLOCK_KEY_SECRET, namespace, {BLOCK_KEY_KEY: base64.b64encode(block_key).decode()},
                           "l2fs master's block-id MAC key: the master only, never workers", field="data"))
    if "mount" in by_name:
        out.append(_secret(MOUNT_SECRET, namespace, {TOKEN_KEY: by_name["mount"]}, "mount-role token of the FUSE mount (its own files only)"))
    if engines:
        out.append(_secret(ENDPOINT_MOUNTS_SECRET, namespace,
                           {endpoint: json.dumps({"root": prefix, "token": by_name[f"{MOUNT_ENTRY}{endpoint}"]})
                            for endpoint, prefix, _ in engines},
                           "one mount-role token per endpoint (its prefix only): the l2fs-mount DaemonSet only"))
    for endpoint, _, ns in engines:
        out.append(_secret(ENGINE_SECRET.format(endpoint=endpoint), ns, {TOKEN_KEY: by_name[f"engine-{endpoint}"]},
                           f"engine token of endpoint {endpoint}"))
    for e in entries:
        if e["role"] == "router":
            out.append(_secret(ROUTER_SECRET, e["name"].removeprefix("router-"), {TOKEN_KEY: e["token"]},
                               "router token (reads only)"))
    return out


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # secrets: owner only
    with os.fdopen(fd, "w") as f:
        f.write(text)


def cmd_generate(ns: argparse.Namespace) -> int:
    import yaml

    from l2fs.common import (
        BlockKeyError,
        TokensFileError,
        ensure_block_key,
        load_block_key,
        load_tokens_file,
        new_block_key,
    )

    if not ns.output and not ns.secret_yaml:
        print("kvtier tokens generate: give -o FILE and/or --secret-yaml FILE ('-' = stdout)", file=sys.stderr)
        return 2
    key_path = ns.block_key or (str(Path(ns.output).with_name("block-key")) if ns.output and ns.output != "-"
                                else None)
    try:
        keep = json.loads(Path(ns.keep).read_text()) if ns.keep else None
        engines = [parse_engine(s, ns.endpoint_namespace) for s in ns.engine]
        entries = generate(ns.workers, engines, ns.router, ns.mount, ns.admin, keep)
        # kept when it exists: a new key would unpublish every block the cluster has cached
        block_key = load_block_key(str(ensure_block_key(key_path))) if key_path else new_block_key()
    except (OSError, ValueError, BlockKeyError) as e:
        print(f"kvtier tokens generate: {e}", file=sys.stderr)
        return 2
    text = json.dumps(entries, indent=1) + "\n"
    check = Path(ns.output) if ns.output and ns.output != "-" else None
    ver = ns.verifiers or (str(check.with_name("token-verifiers.json")) if check is not None else None)
    if ns.output:
        _write(ns.output, text)
    if ver:
        _write(ver, json.dumps(verifiers(entries), indent=1) + "\n")
    for path in (check, Path(ver) if ver and ver != "-" else None):
        try:  # what master and workers will load: a file they refuse must not leave here
            if path is not None:
                load_tokens_file(str(path))
        except TokensFileError as e:
            print(f"kvtier tokens generate: {e}", file=sys.stderr)
            return 2
    if ns.secret_yaml:
        _write(ns.secret_yaml, yaml.safe_dump_all(secrets_for(entries, engines, ns.namespace, block_key),
                                                  sort_keys=False))
    return 0


def pick(path: str, entry: str, role: str | None = None) -> str:
    """The token of entry `entry` in tokens file `path`; ValueError saying what to do when it is not there."""
    from l2fs.common import TokensFileError, load_tokens_file

    try:
        loaded = load_tokens_file(path)
    except TokensFileError as e:
        raise ValueError(str(e)) from None
    for token, cred in loaded:
        if cred.name == entry:
            if role and role not in cred.roles:
                raise ValueError(f"entry {entry!r} of {path} has role {', '.join(sorted(cred.roles))}, not {role}")
            return token
    names = ", ".join(c.name for _, c in loaded)
    raise ValueError(f"no entry {entry!r} in {path} (it has: {names}); a node added after the tokens were made "
                     f"needs its own: kvtier tokens generate --keep OLD --workers ... (docs/deploy.md, Tokens)")


def cmd_exec(ns: argparse.Namespace) -> int:
    """Export the entry's token as L2FS_TOKEN and become the command (no wrapper process stays behind)."""
    from l2fs import envs as l2fs_envs

    path = ns.file or l2fs_envs.get("L2FS_TOKENS_FILE") or ""
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    if not cmd:
        print("kvtier tokens exec: no command after --", file=sys.stderr)
        return 2
    if not path:
        print("kvtier tokens exec: no tokens file (--file or $L2FS_TOKENS_FILE)", file=sys.stderr)
        return 2
    try:
        token = pick(path, ns.entry, ns.role)
    except ValueError as e:
        print(f"kvtier tokens exec: {e}", file=sys.stderr)
        return 2
    os.environ["L2FS_TOKEN"] = token
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"kvtier tokens exec: {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier tokens", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate", help="make a tokens file (and the Secrets) for a cluster")
    g.add_argument("--workers", nargs="*", default=[], metavar="NODE",
                   help="node names that run an l2fs worker (kubectl get nodes -l kvtier.io/l2fs=true -o name)")
    g.add_argument("--engine", action="append", default=[], metavar="ENDPOINT[:PREFIX][@NAMESPACE]",
                   help=f"an endpoint's engine token and its mount token (mount-ENDPOINT, Secret "
                        f"{ENDPOINT_MOUNTS_SECRET}); PREFIX default {contract.KV_PREFIX}/ENDPOINT (repeatable)")
    g.add_argument("--router", action="append", default=[], metavar="NAMESPACE",
                   help="a router-role token (reads only) for the kvtier router in NAMESPACE (repeatable)")
    g.add_argument("--mount", action="store_true", help="one mount-role token for FUSE mounts outside Kubernetes "
                   "(deploy/base's mount DaemonSet uses the per-endpoint mount tokens every --engine gets, Secret "
                   f"{ENDPOINT_MOUNTS_SECRET}): writes under kvtier's prefixes; overwrites, renames (onto free "
                   "paths) and deletes only files it wrote, i.e. that any holder of this one token wrote")
    g.add_argument("--admin", action="store_true", help="an admin token for people (rm, rename, overwrite)")
    g.add_argument("--keep", metavar="FILE", help="reuse the tokens of same-name entries of this earlier file")
    g.add_argument("--namespace", default="kvtier", help="namespace of l2fs (the tokens file and mount Secrets)")
    g.add_argument("--endpoint-namespace", default="default", help="namespace of engines given without @NAMESPACE")
    g.add_argument("-o", "--output", help="tokens file to write (mode 0600; '-' = stdout)")
    g.add_argument("--verifiers", metavar="FILE", help="the verifier file workers mount (each token's SHA-256 "
                   "only; mode 0600; '-' = stdout); default token-verifiers.json next to -o")
    g.add_argument("--block-key", metavar="FILE",
                   help="the master's block key (l2fs master --block-key-file): used when it exists, else made "
                        "(32 random bytes as hex, mode 0600); default: block-key next to -o; with --secret-yaml "
                        "also Secret l2fs-block-key")
    g.add_argument("--secret-yaml", metavar="FILE", help="Kubernetes Secrets to write ('-' = stdout)")
    e = sub.add_parser("exec", help="run a command with L2FS_TOKEN set to one entry's token (worker pods)")
    e.add_argument("--entry", required=True, help="entry name, e.g. worker-$(NODE_NAME)")
    e.add_argument("--role", default=None, help="refuse unless the entry has this role")
    e.add_argument("--file", default=None, help="tokens file (default $L2FS_TOKENS_FILE)")
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command args...")
    ns = p.parse_args(argv)
    return cmd_generate(ns) if ns.what == "generate" else cmd_exec(ns)


if __name__ == "__main__":
    sys.exit(main())
