"""`kvtier` command: one entry point, each subcommand owned by the module that implements it.

Each target module exposes `main(argv: list[str] | None) -> int | None`; imports are lazy so that
`kvtier router` never imports vLLM and `kvtier up` starts fast.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvtier.up", "start a local cluster: l2fs master + workers, vLLM CPU replicas, router"),
    "bench": ("kvtier.bench", "benchmarks: cross-pod | l2 | routing"),
    "router": ("router.cli", "cache-aware OpenAI-compatible router"),
    "lmcache-config": ("connector.config", "print/write LMCache YAML + vLLM args/env for a replica"),
    "model": ("connector.tiny_model", "build a tiny local test model (no download)"),
    "operator-patch": ("operator_patch.cli", "apply|verify|revert the HyperPod inference-operator patch"),
    "webhook": ("operator_patch.webhook", "serve the mutating admission webhook (TLS)"),
}


def _usage() -> str:
    lines = ["usage: kvtier <command> [args...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"kvtier: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    rc = module.main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
