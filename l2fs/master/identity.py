"""Node-bound worker (and FUSE mount) identity from Kubernetes projected ServiceAccount tokens.

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
cannot be made (API server down, no RBAC), the call is refused: the worker retries at its next heartbeat.

Known identities never wait behind strangers: a token reviewed positively is re-reviewed (renewed) once two
thirds of its cache time have passed, while its cached review still answers, and that renewal, like any
review of a token that was accepted before (its cache entry expired), comes out of a budget of its own
(KNOWN_IN_FLIGHT, KNOWN_RATE/KNOWN_BURST) that made-up tokens never reach. Before, one shared budget served
both: ~7,000 made-up tokens/s kept it empty, and once the workers' 60 s cache expired their reviews were shed
and they were declared dead. A renewal the API server cannot answer keeps the cached review until it expires;
one it refuses drops it at once. The `kubernetes` client is imported only when this is configured.

Unknown tokens are also limited per source (the caller's address, which the interceptor takes from the call's
context: l2fs.common.auth.TokenInterceptor reviews inside the handler for that reason): SOURCE_IN_FLIGHT at a
time and SOURCE_RATE/s (burst SOURCE_BURST) from one address, checked before the shared budget, so one address
flooding made-up tokens takes at most its own share of the unknown-token budget and a new node's worker (or a
restarted master's first reviews, about one or two tokens per node) from another address is still reviewed.
Many addresses flooding together can still drain the shared budget; they cannot reach the known tokens' one.
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

from l2fs.common import WORKER_ID_SEP, Credential, token_digest

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
# Tokens accepted before (renewals, re-reviews after the cache expired): their own budget, unreachable by
# strangers. A node's worker needs about 1.5 reviews per CACHE_TTL, so this covers thousands of nodes.
KNOWN_IN_FLIGHT = 4
KNOWN_RATE, KNOWN_BURST = 20.0, 100.0
RENEW_AFTER = 2 / 3  # fraction of a cached review's time after which it is renewed
KNOWN_KEEP = 10  # an accepted token stays "known" for this many cache TTLs after its last positive review
# Unknown tokens from one source address (a node's worker and mount pods share one in hostNetwork; a restarted
# master reviews one or two tokens per node at once): checked before the shared budget, which it never reaches
# beyond this share (a quarter of its rate; in flight, at least one of REVIEWS_IN_FLIGHT stays for others).
SOURCE_IN_FLIGHT = 3
SOURCE_RATE, SOURCE_BURST = 5.0, 20.0


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
        self._cache: collections.OrderedDict[str, tuple[Credential, float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._api: Any = None
        self.reviews = 0  # TokenReviews sent (tests read it: the cache works)
        self.shed = 0  # reviews not asked for: too many in flight, over the rate, or refused recently
        self._in_flight = threading.BoundedSemaphore(REVIEWS_IN_FLIGHT)
        self._bucket, self._bucket_t = REVIEW_BURST, time.monotonic()
        self._refused: collections.OrderedDict[str, float] = collections.OrderedDict()
        # known identities: digest -> until when it counts as known (its own review budget, see the module doc)
        self._known: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._known_in_flight = threading.BoundedSemaphore(KNOWN_IN_FLIGHT)
        self._known_bucket, self._known_t = KNOWN_BURST, time.monotonic()
        self._renewing: set[str] = set()
        self.renewed = 0  # renewals made (tests read it)
        # unknown tokens per source address: source -> [bucket, its time, reviews in flight] (bounded like the cache)
        self._sources: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self.shed_source = 0  # of `shed`: over a source's own share

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

    def review(self, token: str, source: str | None = None) -> Credential | None:
        """The token's credential, or None (refused, or not reviewed now: over a budget). `source`: the
        caller's address (l2fs.common.auth.peer_source); None only where no call context exists."""
        key = token_digest(token)
        now = time.time()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                cred, until, renew_at = hit
                if now < renew_at or (now < until and key in self._renewing):
                    return cred
                if now < until:  # due for renewal: this caller renews, the others keep the cached answer
                    self._renewing.add(key)
                else:
                    del self._cache[key]
                    hit = None
            known = hit is not None or self._known.get(key, 0.0) > time.monotonic()
            if not (self._admit_known() if known else self._admit(key, now, source)):
                self._renewing.discard(key)
                if hit is not None:
                    return hit[0]  # renewal shed: the cached review stands until it expires
                self.shed += 1
                return None
            per_source = None if known else self._source_enter(source)
        try:
            return self._review(token, key, now, known, hit[0] if hit is not None else None)
        finally:
            with self._lock:
                self._renewing.discard(key)
                if per_source is not None:
                    per_source[2] -= 1

    def _review(self, token: str, key: str, now: float, known: bool, cached: Credential | None) -> Credential | None:
        """Ask the API server (admitted already); `cached`: the still valid review this renews."""
        sem = self._known_in_flight if known else self._in_flight
        if not sem.acquire(blocking=False):
            if cached is not None:
                return cached
            self.shed += 1
            log.warning("k8s identity: %d TokenReviews already in flight: refusing this one at once",
                        KNOWN_IN_FLIGHT if known else REVIEWS_IN_FLIGHT)
            return None
        try:
            status = self._ask(token).status
        except Exception as e:  # noqa: BLE001 (API down, no RBAC, bad config: whatever it is, refuse loudly)
            if cached is not None:  # a renewal that failed: the cached review stands until it expires
                log.warning("k8s identity: renewing a TokenReview failed (%s): the cached one stands",
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                return cached
            log.error("k8s identity: TokenReview failed (%s): refusing the call (a worker retries at its "
                      "next heartbeat)", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        finally:
            sem.release()
        cred = self._judge(status)
        if cred is None:
            with self._lock:
                self._cache.pop(key, None)
                self._known.pop(key, None)
            self._remember(self._refused, key, time.monotonic() + REFUSED_TTL)
            return None
        if cached is not None:
            self.renewed += 1
        exp = _jwt_exp(token)
        until = min(now + self.cache_ttl, exp if exp is not None else now + self.cache_ttl)
        self._remember(self._cache, key, (cred, until, now + (until - now) * RENEW_AFTER))
        self._remember(self._known, key, time.monotonic() + KNOWN_KEEP * self.cache_ttl)
        return cred

    def _remember(self, table: collections.OrderedDict[str, Any], key: str, value: Any) -> None:
        """Put key -> value into one of the bounded tables (cache, refused), dropping the oldest past cache_max."""
        with self._lock:
            table[key] = value
            while len(table) > self.cache_max:
                table.popitem(last=False)

    def _admit_known(self) -> bool:
        """Whether a token accepted before may be reviewed now (lock held): its own bucket, never drained
        by tokens nobody issued."""
        mono = time.monotonic()
        self._known_bucket = min(KNOWN_BURST, self._known_bucket + (mono - self._known_t) * KNOWN_RATE)
        self._known_t = mono
        if self._known_bucket < 1.0:
            return False
        self._known_bucket -= 1.0
        return True

    def _source(self, source: str | None, mono: float) -> list[float] | None:
        """The per-source state of `source` (lock held; refilled to `mono`), None without a source."""
        if source is None:
            return None
        st = self._sources.get(source)
        if st is None:
            st = self._sources[source] = [SOURCE_BURST, mono, 0.0]
            while len(self._sources) > self.cache_max:  # least recently seen first
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
            st[0] = min(SOURCE_BURST, st[0] + (mono - st[1]) * SOURCE_RATE)
            st[1] = mono
        return st

    def _source_enter(self, source: str | None) -> list[float] | None:
        """Count a review of an unknown token in flight for its source (lock held; admitted already)."""
        st = self._sources.get(source) if source is not None else None
        if st is not None:
            st[2] += 1
        return st

    def _admit(self, key: str, now: float, source: str | None = None) -> bool:
        """Whether a token not in the cache may be reviewed now (lock held): not refused in the last
        REFUSED_TTL s, within its source's own share (in flight and rate), and a token of the shared rate
        bucket left. A source's share is checked first, so a flood over it never reaches the shared bucket."""
        mono = time.monotonic()
        until = self._refused.get(key)
        if until is not None:
            if until > mono:
                return False
            del self._refused[key]
        st = self._source(source, mono)
        if st is not None and (st[2] >= SOURCE_IN_FLIGHT or st[0] < 1.0):
            self.shed_source += 1
            return False
        self._bucket = min(REVIEW_BURST, self._bucket + (mono - self._bucket_t) * REVIEW_RATE)
        self._bucket_t = mono
        if self._bucket < 1.0:
            return False
        self._bucket -= 1.0
        if st is not None:
            st[0] -= 1.0
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
        if WORKER_ID_SEP in node:  # no Kubernetes node name holds it; a name that did could extend another's ids
            log.warning("k8s identity: review names node %r, which holds %r: refused", node, WORKER_ID_SEP)
            return None
        role, prefixes = account
        if role == "mount":
            return Credential(f"mount@{node}", frozenset({"mount"}), prefixes, node)
        return Credential(f"k8s-node/{node}", frozenset({"worker"}), (), node)
