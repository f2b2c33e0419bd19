"""`kvtier` command: one entry point, each subcommand owned by the module that implements it.

Each target module exposes `main(argv: list[str] | None) -> int | None`; imports are lazy so that
`kvtier router` never imports vLLM and `kvtier up` starts fast.
"""

from __future__ import annotations

import importlib
import sys

from kvtier.bench import BENCHES  # names and one-line helps only: kvtier/bench/__init__.py imports nothing

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvtier.up", "start a local cluster: l2fs master + workers, vLLM CPU replicas, router"),
    "bench": ("kvtier.bench", f"benchmarks: {' | '.join(BENCHES)} (kvtier bench <name> --help)"),
    "chaos": ("kvtier.chaos", "faults on a running --netns cluster: link down/up, rate, partition, kill/stop/cont"),
    "router": ("router.cli", "cache-aware OpenAI-compatible router"),
    "lmcache-config": ("connector.config", "print/write LMCache YAML + vLLM args/env for a replica"),
    "model": ("kvtier.devstack.tiny_model", "build a tiny local test model (no download)"),
    "operator-patch": ("operator_patch.cli", "apply|verify|revert the HyperPod inference-operator patch"),
    "webhook": ("operator_patch.webhook", "serve the mutating admission webhook (TLS)"),
    "tokens": ("kvtier.credentials", "scoped l2fs credentials: generate a tokens file + Secrets; exec with one entry"),
}


def dispatch(prog: str, table: dict[str, tuple[str, str]], argv: list[str] | None,
             noun: str = "command") -> int:
    """Run `<prog> <name> args...` by calling `<module>.main(args)` for the table's entry; lazy imports."""
    argv = list(sys.argv[1:] if argv is None else argv)
    width = max(map(len, table)) + 2
    usage = "\n".join([f"usage: {prog} <{noun}> [args...]", "", f"{noun}s:"]
                      + [f"  {name:<{width}} {help_}" for name, (_, help_) in table.items()])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if argv[0] not in table:
        print(f"{prog}: unknown {noun} {argv[0]!r}\n\n{usage}", file=sys.stderr)
        return 2
    rc = importlib.import_module(table[argv[0]][0]).main(argv[1:])
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    return dispatch("kvtier", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
