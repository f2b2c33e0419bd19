"""Fuzz every l2fs gRPC method with hypothesis: typed random requests and raw garbage bytes.

Pass criteria: every call ends with a deliberate status (OK or a clear client error: INVALID_ARGUMENT,
NOT_FOUND, ...), never UNKNOWN (an unhandled exception in a handler) and never a hang; both servers
stay up and keep serving real data; their memory stays bounded; the data dir stays within capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_faults import DEADLINE, dir_bytes, payload, proc_pid, rss_bytes

from l2fs.proto import l2fs_pb2 as pb

# Statuses that are a deliberate answer to bad input (or a legit result).
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
    # the cluster runs with a block key (capability mode): a well-formed block call without its capability
    grpc.StatusCode.PERMISSION_DENIED,
}
CAPACITY = 8 << 20
MAX_EXAMPLES = 60

_INTS = st.one_of(st.integers(0, 16), st.sampled_from([255, 4096, 1 << 20, 1 << 31, (1 << 32) - 1]))
_U64 = st.one_of(_INTS, st.sampled_from([1 << 40, (1 << 63) - 1, (1 << 64) - 1]))
_I64 = st.one_of(_INTS, st.sampled_from([-1, -(1 << 63), (1 << 63) - 1]))
_PATHS = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["/", "/a", "/a/b", "/a/../b", "//", "/a\x00", "..", "/" + "x" * 300, "/fz/k"]),
    st.lists(st.sampled_from(["a", "..", ".", "", "b", "\x00", "é"]), max_size=6).map(lambda p: "/" + "/".join(p)),
)
_FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def _field(f: Any) -> st.SearchStrategy:
    """A strategy for one proto field (scalars biased to the edge values that break servers)."""
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        inner = _message(f.message_type._concrete_class)
        return st.lists(inner, max_size=3) if _repeated(f) else inner
    base = {
        FieldDescriptor.TYPE_STRING: _PATHS,
        FieldDescriptor.TYPE_BYTES: st.binary(max_size=256),
        FieldDescriptor.TYPE_BOOL: st.booleans(),
        FieldDescriptor.TYPE_UINT64: _U64, FieldDescriptor.TYPE_UINT32: st.integers(0, (1 << 32) - 1),
        FieldDescriptor.TYPE_INT64: _I64, FieldDescriptor.TYPE_INT32: st.integers(-(1 << 31), (1 << 31) - 1),
        FieldDescriptor.TYPE_DOUBLE: _FLOATS, FieldDescriptor.TYPE_FLOAT: _FLOATS,
    }[f.type]
    return st.lists(base, max_size=5) if _repeated(f) else base


def _repeated(f: Any) -> bool:
    return getattr(f, "is_repeated", None) if hasattr(f, "is_repeated") else f.label == FieldDescriptor.LABEL_REPEATED


def _message(cls: Any) -> st.SearchStrategy:
    fields = {f.name: _field(f) for f in cls.DESCRIPTOR.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def _methods(service: str) -> list[tuple[str, Any, bool, bool]]:
    """(name, request class, client-streaming, server-streaming) for each method of a service."""
    out = []
    for m in pb.DESCRIPTOR.services_by_name[service].methods:
        out.append((m.name, m.input_type._concrete_class, m.client_streaming, m.server_streaming))
    return out


@pytest.fixture(scope="module")
def fuzz_cluster(cluster_factory: Callable[..., Any]) -> Iterator[Any]:
    cluster = cluster_factory(1, name="fuzz", capacity=str(CAPACITY))
    c = cluster.client(timeout=DEADLINE)
    data = payload(1, 128 * 1024, "/fz/keep")
    assert c.put("/fz/keep", data) is True
    cluster.fz_keep = data  # the object every fuzz round must leave intact and readable
    cluster.fz_pids = [proc_pid(cluster.master_proc), proc_pid(cluster.workers[0])]
    cluster.fz_rss0 = [rss_bytes(p) for p in cluster.fz_pids]
    cluster.fz_worker = c.report().workers[0].address
    yield cluster
    c.close()


def _call(channel: grpc.Channel, service: str, name: str, req: Any, cstream: bool, sstream: bool) -> Any:
    path = f"/l2fs.{service}/{name}"
    ser, de = (lambda m: m.SerializeToString()), (lambda b: b)
    if cstream and not sstream:
        return channel.stream_unary(path, ser, de)(iter(req if isinstance(req, list) else [req]), timeout=DEADLINE)
    if sstream:
        return list(channel.unary_stream(path, ser, de)(req, timeout=DEADLINE))
    return channel.unary_unary(path, ser, de)(req, timeout=DEADLINE)


def _status(fn: Any) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


# Worker registration from a fuzzer would hand real clients fake workers: those two are fuzzed last,
# in their own test, so the data checks of the others stay meaningful.
_MASTER = [m for m in _methods("Master") if m[0] not in ("RegisterWorker", "Heartbeat")]
_WORKER = _methods("Worker")


@pytest.mark.parametrize("service,method", [("Master", m) for m in _MASTER] + [("Worker", m) for m in _WORKER],
                         ids=lambda v: v if isinstance(v, str) else v[0])
def test_fuzz_typed_requests(fuzz_cluster: Any, service: str, method: tuple) -> None:
    name, cls, cstream, sstream = method
    address = fuzz_cluster.master if service == "Master" else fuzz_cluster.fz_worker
    channel = grpc.insecure_channel(address)
    req_strategy = st.lists(_message(cls), min_size=1, max_size=4) if cstream else _message(cls)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(req_strategy)
    def run(req: Any) -> None:
        code, details = _status(lambda: _call(channel, service, name, req, cstream, sstream))
        assert code in ALLOWED, f"{service}.{name}({req!r}) -> {code} {details}"
        if code != grpc.StatusCode.OK:
            assert details, f"{service}.{name} failed with {code} but no message"

    run()
    channel.close()
    _still_healthy(fuzz_cluster)


@pytest.mark.parametrize("service", ["Master", "Worker"])
def test_fuzz_garbage_bytes(fuzz_cluster: Any, service: str) -> None:
    """Undecodable request bodies: gRPC itself refuses them; the server must stay up."""
    address = fuzz_cluster.master if service == "Master" else fuzz_cluster.fz_worker
    channel = grpc.insecure_channel(address)
    # Random bytes often decode as a valid RegisterRequest; registration is fuzzed last, on its own.
    methods = _MASTER if service == "Master" else _WORKER

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.sampled_from(methods), st.binary(max_size=512))
    def run(method: tuple, body: bytes) -> None:
        name, _, cstream, sstream = method
        path = f"/l2fs.{service}/{name}"
        ident = lambda b: b  # noqa: E731
        if cstream:
            fn = lambda: channel.stream_unary(path, ident, ident)(iter([body]), timeout=DEADLINE)  # noqa: E731
        elif sstream:
            fn = lambda: list(channel.unary_stream(path, ident, ident)(body, timeout=DEADLINE))  # noqa: E731
        else:
            fn = lambda: channel.unary_unary(path, ident, ident)(body, timeout=DEADLINE)  # noqa: E731
        code, details = _status(fn)
        # INTERNAL is what grpcio answers for a body it cannot deserialize, before our handler runs.
        assert code in ALLOWED | {grpc.StatusCode.INTERNAL}, f"{name}({body!r}) -> {code} {details}"

    run()
    channel.close()
    _still_healthy(fuzz_cluster)


def test_fuzz_data_plane(fuzz_cluster: Any) -> None:
    """Random bytes (raw, or behind a valid magic) at the worker's raw-TCP data plane: it answers with an
    error status or closes; it never crashes, hangs or stores anything."""
    import socket

    c = fuzz_cluster.client(timeout=DEADLINE)
    addr = pbg_stat(fuzz_cluster.master, "/fz/keep").locations[0].data_address
    c.close()
    assert addr, "worker offers no raw data plane"
    host, port = addr.rsplit(":", 1)

    @settings(max_examples=MAX_EXAMPLES * 2, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.booleans(), st.sampled_from([b"R", b"W", b"X"]), st.binary(max_size=300))
    def run(magic: bool, op: bytes, body: bytes) -> None:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            try:
                s.sendall((b"L2D1" + op if magic else b"") + body)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the worker may already have refused and closed
            try:
                first = s.recv(1)  # an error status, or EOF; a timeout here would be a hang
            except ConnectionResetError:
                first = b""
            assert first in (b"", b"\x01", b"\x02", b"\x03", b"\x00"), first

    run()
    _still_healthy(fuzz_cluster)


def pbg_stat(master: str, path: str) -> Any:
    """Master Stat over a raw channel (the location, including the data-plane address)."""
    ch = grpc.insecure_channel(master)
    try:
        return ch.unary_unary("/l2fs.Master/Stat", lambda m: m.SerializeToString(),
                              pb.FileStat.FromString)(pb.PathRequest(path=path), timeout=DEADLINE)
    finally:
        ch.close()


def test_fuzz_registration_last(fuzz_cluster: Any) -> None:
    """RegisterWorker/Heartbeat with random fields: clear statuses, and the master survives."""
    channel = grpc.insecure_channel(fuzz_cluster.master)
    for name, cls, _cs, _ss in _methods("Master"):
        if name in ("RegisterWorker", "Heartbeat"):
            _fuzz_one(channel, name, cls)
    channel.close()
    stub_report = grpc.insecure_channel(fuzz_cluster.master).unary_unary(
        "/l2fs.Master/Report", lambda m: m.SerializeToString(), pb.ReportResponse.FromString)
    assert stub_report(pb.Empty(), timeout=DEADLINE).workers


def _fuzz_one(channel: grpc.Channel, name: str, cls: Any) -> None:
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(_message(cls))
    def run(req: Any) -> None:
        code, details = _status(lambda: _call(channel, "Master", name, req, False, False))
        assert code in ALLOWED, f"{name}({req!r}) -> {code} {details}"

    run()


def _still_healthy(cluster: Any) -> None:
    """After a fuzz round: real data still reads back, memory and disk are bounded."""
    c = cluster.client(timeout=DEADLINE)
    try:
        assert c.get("/fz/keep") == cluster.fz_keep, "fuzzing damaged or dropped a real object"
        assert c.put("/fz/probe", b"p" * 100, if_absent=False) is not None
    finally:
        c.close()
    for pid, rss0 in zip(cluster.fz_pids, cluster.fz_rss0, strict=True):
        rss = rss_bytes(pid)
        assert rss > 0, f"process {pid} died during fuzzing"
        assert rss - rss0 < 128 << 20, f"process {pid} grew by {(rss - rss0) >> 20} MiB while fuzzed"
    assert dir_bytes(cluster.workers[0].data_dir) <= CAPACITY + (1 << 20)


def test_register_rejects_malformed_addresses(make_cluster: Any) -> None:
    """A registration whose address is not host:port must be refused with INVALID_ARGUMENT; otherwise
    the master hands clients an unusable worker (found by the garbage-bytes fuzzer)."""
    cluster = make_cluster(0)
    ch = grpc.insecure_channel(cluster.master)
    for addr, data_addr in (("/b/./\x00/a", ""), ("127.0.0.1:1", "not-an-address"), ("host:port", ""),
                            ("127.0.0.1:99999", "")):
        req = pb.RegisterRequest(worker_id=f"w-{len(addr)}-{len(data_addr)}", node_id="n", address=addr,
                                 capacity=1 << 30)
        if data_addr:
            req.data_address = data_addr
        code, details = _status(lambda req=req: _call(ch, "Master", "RegisterWorker", req, False, False))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (addr, data_addr, code, details)
    ch.close()
