"""gRPC bootstrap shared by master and worker: channel/server options, handler decorator, TLS, servers."""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from l2fs.common.auth import Credentials, TokenInterceptor
from l2fs.common.errors import ERROR_KIND_KEY, PathError, RpcError

FRAME = 4 << 20  # gRPC data frame size
MAX_MSG = 64 << 20  # gRPC max message size (frames are well under it)
# Items one batched master call (StatMany, PrefixLookup, AllocateMany, CommitMany) may carry: the master works
# through a batch under its namespace lock, and a 64 MiB message holds ~3.4M paths (one StatMany of 1M copies
# of a path held the lock 32 s). Clients split longer batches (put_many sends 256 at a time anyway).
MAX_BATCH_ITEMS = 4096


def check_batch(n: int, what: str) -> None:
    """INVALID_ARGUMENT for a batch of more than MAX_BATCH_ITEMS items, before any of them is looked at."""
    if n > MAX_BATCH_ITEMS:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{what}: {n} items, at most {MAX_BATCH_ITEMS} per call (split the batch)")
MAX_STREAMS = 256  # concurrent calls on one client connection (our clients keep <= 64 in flight)
# Server options. The receive limit stays MAX_MSG for every method because gRPC Python has no per-method
# limit and RegisterWorker carries the worker's whole block report in one message (~250 B per block:
# 64 MiB is ~250k blocks) until it is paged; unauthenticated calls never get that far (TokenInterceptor).
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
    ("grpc.max_concurrent_streams", MAX_STREAMS),
    ("grpc.so_reuseport", 0),
]
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
    ("grpc.enable_retries", 1),
    # gRPC's default reconnect backoff grows to 120 s: after a master outage the workers' heartbeat
    # channels would wait that long to re-register (13.6 s measured after a 25 s outage). Cap it at 1 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def rpc_handler(latency: Any, errors: Any | None = None) -> Callable[[Callable], Callable]:
    """Decorator for servicer methods: time each call (`latency` histogram, labelled by method), count
    errors (`errors` counter, by method and code) and map RpcError/PathError to a gRPC status."""

    def decorate(method: Callable) -> Callable:
        name = method.__name__
        # the labelled child once, not a labels() lookup per call (13 % of the master's GIL time per put)
        observe = latency.labels(name).observe

        @functools.wraps(method)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            try:
                return method(self, request, context)
            except PathError as e:
                if errors is not None:
                    errors.labels(name, "INVALID_ARGUMENT").inc()
                context.set_trailing_metadata(((ERROR_KIND_KEY, "path"), ("l2fs-errno", e.errno_name)))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RpcError as e:
                if errors is not None:
                    errors.labels(name, e.code.name).inc()
                trailers = ((("l2fs-errno", e.errno_name),) if e.errno_name else ()) + (
                    ((ERROR_KIND_KEY, e.kind),) if e.kind else ())
                if trailers:
                    context.set_trailing_metadata(trailers)
                context.abort(e.code, str(e))
            finally:
                observe(time.perf_counter() - t0)

        return wrapper

    return decorate


def wait_for_stop_signal() -> None:
    """Block until SIGTERM or SIGINT: servers then shut down cleanly on either."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the bearer token (None when no token is configured)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials | None:
    """TLS server credentials when both --tls-cert and --tls-key are given."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def grpc_server(host: str, port: int, add_servicer: Callable[[grpc.Server], None], *, name: str,
                token: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                threads: int = 32, creds: Credentials | None = None,
                policy: dict[str, frozenset[str]] | None = None) -> tuple[grpc.Server, int, bool]:
    """A bound, not yet started gRPC server for master or worker: thread pool, message limits, bearer-token
    and role check (`creds`, else the single `token`) when configured, TLS when cert and key are given.
    Returns (server, bound port, TLS on)."""
    creds = creds if creds is not None else Credentials(token)
    interceptors = [TokenInterceptor(creds, policy)] if creds.enabled else []
    server = grpc.server(futures.ThreadPoolExecutor(threads, thread_name_prefix=name),
                         interceptors=interceptors, options=GRPC_OPTIONS)
    add_servicer(server)
    creds = server_credentials(tls_cert, tls_key)
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"could not bind {addr}")
    return server, bound, creds is not None


def make_channel(address: str, tls_ca: str | None) -> grpc.Channel:
    """A client channel (TLS when a CA bundle is given) with large message limits."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.secure_channel(address, creds, options=CLIENT_OPTIONS)
    return grpc.insecure_channel(address, options=CLIENT_OPTIONS)
