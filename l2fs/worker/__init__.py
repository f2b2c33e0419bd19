"""The l2fs worker: `service` (the WorkerService RPCs), `store` (blocks on disk, tiers, reservations,
manifests), `registration` (links to the masters: register, report, heartbeat), `fdserver` (the same-node
fd-passing socket) and `main` (`l2fs worker`: the Worker process and its flags)."""

from l2fs.worker.main import Worker, build_parser, main

__all__ = ["Worker", "build_parser", "main"]
