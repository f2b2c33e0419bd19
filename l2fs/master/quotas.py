"""Per-prefix byte quotas (--prefix-quota): published bytes, in-flight allocations, the refusal check."""

from __future__ import annotations

import grpc

from l2fs.common import (
    RpcError,
)
from l2fs.master.state import PREFIX_USED, QUOTA_REFUSED, MasterBase


class QuotaOps(MasterBase):
    """Quota bookkeeping (call with the lock held)."""


    def _quotas_of(self, path: str) -> list[str]:
        return [q for q in self.quotas if path == q or path.startswith(q.rstrip("/") + "/")]


    def _charge(self, path: str, size: int) -> None:
        for q in self._quotas_of(path):
            self.quota_used[q] += size
            PREFIX_USED.labels(q).set(self.quota_used[q])


    def _uncharge_allocation(self, bid: str) -> None:
        """An allocation under a quota prefix was committed, refused or given up: its bytes are no longer
        in flight."""
        charged = self._alloc_charge.pop(bid, None)
        if charged is not None:
            for q in self._quotas_of(charged[0]):
                self.quota_inflight[q] -= charged[1]


    def _check_quota(self, moves: list[tuple[str | None, str | None, int]]) -> None:
        """Refuse (RESOURCE_EXHAUSTED, EDQUOT) when (old path | None, new path | None, bytes) moves would take
        a prefix that grows past its quota; a prefix may always shrink."""
        if not self.quotas:
            return
        delta: dict[str, int] = {}
        for old, new, size in moves:
            for q in self._quotas_of(old) if old else ():
                delta[q] = delta.get(q, 0) - size
            for q in self._quotas_of(new) if new else ():
                delta[q] = delta.get(q, 0) + size
        for q, d in delta.items():
            if d > 0 and self.quota_used[q] + self.quota_inflight[q] + d > self.quotas[q]:
                QUOTA_REFUSED.labels(q).inc()
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"prefix {q} is at its quota ({self.quota_used[q]} of {self.quotas[q]} bytes used, "
                               f"{d} more asked): a write miss", "EDQUOT")
