"""Node-bound worker (and FUSE mount) identity from Kubernetes projected ServiceAccount tokens (issue 13).

Why: a DaemonSet's pods all see the same Secrets, so a per-node secret cannot be handed to one pod; whatever
the worker pod of node A can read, the one of node B can too. The kubelet, however, gives each pod its own
short-lived ServiceAccount token bound to the pod (and, since Kubernetes 1.32, naming its node). The worker
sends that token (re-read from its projected volume at each registration/heartbeat, since the kubelet rotates
it) as its bearer token; the master asks the API server about it with a TokenReview and, when it is
authenticated, for the expected ServiceAccount and audience, and names a node, treats the caller as a worker
credential bound to that node (Credential.may_be_worker): node A's token cannot register or heartbeat node B's
worker ids, before or after a master restart, and no worker pod holds anything that lets it act as another.

The same review names the FUSE mounts (master --mount-sa): a mount pod's projected token becomes the mount
credential "mount@<node>" (prefixes from --mount-prefixes), so each node's mount has its own name and may
overwrite, rename or delete only the files written through it (Credential.may_replace), not another node's;
the interceptor then also reviews unknown tokens on the client methods a mount may call (same admission
limits below). Without --mount-sa no client-method call ever causes a review.

The node comes from the review's user.extra["authentication.kubernetes.io/node-name"] (set for pod-bound
tokens by Kubernetes >= 1.32). A review without it is refused (no pod lookup fallback: a cluster older than
1.32 keeps the tokens-file workers, `--worker-identity tokens`).

Positive reviews are cached (by the token's SHA-256) until min(the token's exp, CACHE_TTL) and at most
CACHE_MAX of them; a token the API server refused is refused again without asking for REFUSED_TTL s. Reviews
of unknown tokens are admitted at most REVIEWS_IN_FLIGHT at a time and REVIEW_RATE/s (burst REVIEW_BURST), so a
stranger's made-up tokens cannot hold the master's threads or flood the API server; beyond, and when a review
cannot be made (API server down, no RBAC), the call is refused: the worker retries at its next heartbeat. The `kubernetes` client is
imported only when this is configured.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import threading
import time
from typing import Any

from l2fs.common import Credential, token_digest

log = logging.getLogger("l2fs.master.identity")

NODE_KEY = "authentication.kubernetes.io/node-name"
CACHE_TTL = 60.0  # seconds a positive review is trusted (less when the token expires sooner)
CACHE_MAX = 4096  # cached reviews (one per live worker token; oldest dropped first)
# Reviews of tokens not in the cache are an API round trip (up to 5 s) on a master handler thread, asked for by
# anyone who can reach the port: bounded so that strangers with made-up tokens can neither hold the master's
# threads nor make it flood the API server. Workers need about one review per node per CACHE_TTL.
REVIEWS_IN_FLIGHT = 4  # concurrent reviews; beyond: refused at once (the worker retries at its next heartbeat)
REVIEW_RATE, REVIEW_BURST = 20.0, 100.0  # reviews/s admitted on average, and in a burst (token bucket)
REFUSED_TTL = 10.0  # seconds a refused token is refused again without asking (bounded like the cache)


def _jwt_exp(token: str) -> float | None:
    """The `exp` claim of a JWT, unverified (the TokenReview verifies; this only bounds the cache)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        exp = claims.get("exp")
        return float(exp) if isinstance(exp, (int, float)) else None
    except (IndexError, ValueError, AttributeError):
        return None


def _username(service_account: str) -> str:
    ns, sep, name = service_account.partition(":")
    if not sep or not ns or not name or ":" in name:
        raise ValueError(f"service account {service_account!r}: want NAMESPACE:NAME")
    return f"system:serviceaccount:{ns}:{name}"


class K8sIdentity:
    """TokenReview-backed identity: `review(token)` -> the Credential of the token's ServiceAccount, bound to
    the token's node, or None. A table maps each accepted ServiceAccount ("NAMESPACE:NAME") to a role: the
    workers' (`service_account`) to a worker credential "k8s-node/<node>", the FUSE mounts' (`mount_sa`) to a
    mount credential "mount@<node>" with `mount_prefixes` (so a mount pod may replace or delete only files
    written through the mount of its own node: Credential.may_replace compares names). `roles` is what it can
    grant: the interceptor asks for a review only on methods one of them may call. `kubeconfig` None =
    $KUBECONFIG, else in-cluster config."""

    def __init__(self, service_account: str | None, audience: str, kubeconfig: str | None = None,
                 cache_ttl: float = CACHE_TTL, cache_max: int = CACHE_MAX, *, mount_sa: str | None = None,
                 mount_prefixes: tuple[str, ...] = ()) -> None:
        self.accounts: dict[str, tuple[str, tuple[str, ...]]] = {}  # username -> (role, prefixes)
        if service_account:
            self.accounts[_username(service_account)] = ("worker", ())
        if mount_sa:
            if not mount_prefixes:
                raise ValueError("mount service account: needs at least one prefix the mounts may write under")
            if _username(mount_sa) in self.accounts:
                raise ValueError(f"mount service account {mount_sa!r} is the workers' too: want its own")
            self.accounts[_username(mount_sa)] = ("mount", tuple(mount_prefixes))
        if not self.accounts:
            raise ValueError("k8s identity: no service account to accept")
        self.roles = frozenset(role for role, _ in self.accounts.values())
        if not audience:
            raise ValueError("k8s token audience must not be empty")
        self.audience = audience
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        self.cache_ttl, self.cache_max = cache_ttl, cache_max
        self._cache: collections.OrderedDict[str, tuple[Credential, float]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._api: Any = None
        self.reviews = 0  # TokenReviews sent (tests read it: the cache works)
        self.shed = 0  # reviews not asked for: too many in flight, over the rate, or refused recently
        self._in_flight = threading.BoundedSemaphore(REVIEWS_IN_FLIGHT)
        self._bucket, self._bucket_t = REVIEW_BURST, time.monotonic()
        self._refused: collections.OrderedDict[str, float] = collections.OrderedDict()

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config  # lazy: only masters with --worker-identity k8s need it

            cfg = client.Configuration()
            if self.kubeconfig:
                config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
            else:
                config.load_incluster_config(client_configuration=cfg)
            self._api = client.AuthenticationV1Api(client.ApiClient(cfg))
        return self._api

    def _ask(self, token: str) -> Any:
        from kubernetes import client

        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[self.audience]))
        self.reviews += 1
        return self._client().create_token_review(body, _request_timeout=5)

    def review(self, token: str) -> Credential | None:
        key = token_digest(token)
        now = time.time()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                if hit[1] > now:
                    return hit[0]
                del self._cache[key]
            if not self._admit(key, now):
                self.shed += 1
                return None
        if not self._in_flight.acquire(blocking=False):
            self.shed += 1
            log.warning("k8s identity: %d TokenReviews already in flight: refusing this one at once",
                        REVIEWS_IN_FLIGHT)
            return None
        try:
            status = self._ask(token).status
        except Exception as e:  # noqa: BLE001 (API down, no RBAC, bad config: whatever it is, refuse loudly)
            log.error("k8s identity: TokenReview failed (%s): refusing the call (a worker retries at its "
                      "next heartbeat)", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        finally:
            self._in_flight.release()
        cred = self._judge(status)
        if cred is None:
            self._remember(self._refused, key, time.monotonic() + REFUSED_TTL)
            return None
        exp = _jwt_exp(token)
        until = min(now + self.cache_ttl, exp if exp is not None else now + self.cache_ttl)
        self._remember(self._cache, key, (cred, until))
        return cred

    def _remember(self, table: collections.OrderedDict[str, Any], key: str, value: Any) -> None:
        """Put key -> value into one of the bounded tables (cache, refused), dropping the oldest past cache_max."""
        with self._lock:
            table[key] = value
            while len(table) > self.cache_max:
                table.popitem(last=False)

    def _admit(self, key: str, now: float) -> bool:
        """Whether a token not in the cache may be reviewed now (lock held): not refused in the last
        REFUSED_TTL s, and a token of the rate bucket left."""
        mono = time.monotonic()
        until = self._refused.get(key)
        if until is not None:
            if until > mono:
                return False
            del self._refused[key]
        self._bucket = min(REVIEW_BURST, self._bucket + (mono - self._bucket_t) * REVIEW_RATE)
        self._bucket_t = mono
        if self._bucket < 1.0:
            return False
        self._bucket -= 1.0
        return True

    def _judge(self, status: Any) -> Credential | None:
        if status is None or not status.authenticated:
            log.warning("k8s identity: token not authenticated (%s)", getattr(status, "error", None) or "no error")
            return None
        user = status.user
        account = self.accounts.get(getattr(user, "username", None) or "")
        if user is None or account is None:
            log.warning("k8s identity: token of %r, want one of %s: refused", getattr(user, "username", None),
                        sorted(self.accounts))
            return None
        if self.audience not in (status.audiences or []):
            log.warning("k8s identity: token audiences %s lack %r: refused", status.audiences, self.audience)
            return None
        nodes = (user.extra or {}).get(NODE_KEY) or []
        if len(nodes) != 1 or not nodes[0]:
            log.warning("k8s identity: review names no node (%s; Kubernetes >= 1.32 puts it in pod-bound "
                        "tokens): refused", NODE_KEY)
            return None
        node = nodes[0]
        role, prefixes = account
        if role == "mount":
            return Credential(f"mount@{node}", frozenset({"mount"}), prefixes, node)
        return Credential(f"k8s-node/{node}", frozenset({"worker"}), (), node)
