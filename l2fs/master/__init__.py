"""The l2fs master: `service` (MasterService, assembled from `namespace`, `quotas`, `pusher` (pending
deletes/renames and seals pushed to workers), `writes` (allocate/commit/delete/rename) and `registry`
(workers, heartbeats, the sweeper) over the shared `state`), `journal` (PendingOps on disk), `identity`
(Kubernetes TokenReview of worker/mount tokens) and `main` (`l2fs master`)."""

from l2fs.master.main import build_parser, main
from l2fs.master.service import MasterService, serve

__all__ = ["MasterService", "build_parser", "main", "serve"]
