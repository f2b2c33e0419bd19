"""SPOP, haproxy's Stream Processing Offload Protocol (doc/SPOE.txt, version 2.0): the agent side.

haproxy sends a NOTIFY frame with the messages its `spoe-message` sections describe (here: a request's path,
headers and body); the agent answers an ACK whose actions set haproxy variables (here: which replica to send the
request to, or the answer to give instead). It is how an external program decides for haproxy per request, the
haproxy counterpart of Envoy's ext_proc that the Gateway API Inference Extension's endpoint picker speaks. No
maintained Python implementation exists (PyPI has none), so the codec is here: frames, varints, typed data.

Only what kvtier needs: HELLO / NOTIFY / ACK / DISCONNECT, pipelining (ACKs in any order on the NOTIFY's
connection), no fragmentation (not announced, so haproxy never fragments)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kvtier.router.spop")

HAPROXY_HELLO, HAPROXY_DISCONNECT, NOTIFY = 1, 2, 3
AGENT_HELLO, AGENT_DISCONNECT, ACK = 101, 102, 103
FIN = 1
T_NULL, T_BOOL, T_INT32, T_UINT32, T_INT64, T_UINT64, T_IPV4, T_IPV6, T_STR, T_BIN = range(10)
SCOPE_TXN = 2
SET_VAR = 1
VERSION = "2.0"
# status codes of a DISCONNECT (SPOE.txt 3.5)
E_NONE, E_IO, E_TOO_BIG, E_INVALID, E_NO_VERSION, E_BAD_VERSION, E_FRAG = 0, 1, 3, 4, 5, 8, 10


class SpopError(ValueError):
    """A malformed or unexpected frame: the connection is closed with a DISCONNECT carrying `code`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def enc_varint(x: int) -> bytes:
    """haproxy's "peers" varint: < 240 in one byte, else 4 bits in the first byte and 7 per byte after."""
    if x < 0:
        raise ValueError("varints are unsigned")
    if x < 240:
        return bytes((x,))
    out = bytearray(((x & 0xFF) | 240,))
    x = (x - 240) >> 4
    while x >= 128:
        out.append((x & 0xFF) | 128)
        x = (x - 128) >> 7
    out.append(x)
    return bytes(out)


def dec_varint(buf: bytes | memoryview, i: int) -> tuple[int, int]:
    """(value, next index); IndexError when buf ends inside it."""
    b = buf[i]
    if b < 240:
        return b, i + 1
    x, shift = b, 4
    while True:
        i += 1
        b = buf[i]
        x += b << shift
        shift += 7
        if b < 128:
            return x, i + 1


def enc_str(s: bytes) -> bytes:
    """An untyped string (message, KV and variable names): varint length, bytes."""
    return enc_varint(len(s)) + s


def enc_typed(v: Any) -> bytes:
    """TYPED-DATA for the Python values an agent sends: None, bool, int (uint32/int64), str, bytes, an ip."""
    if v is None:
        return bytes((T_NULL,))
    if isinstance(v, bool):
        return bytes((T_BOOL | (0x10 if v else 0),))
    if isinstance(v, int):
        return bytes((T_UINT32,)) + enc_varint(v) if 0 <= v < 1 << 32 else bytes((T_INT64,)) + enc_varint(v & (1 << 64) - 1)
    if isinstance(v, ipaddress.IPv4Address):
        return bytes((T_IPV4,)) + v.packed
    if isinstance(v, ipaddress.IPv6Address):
        return bytes((T_IPV6,)) + v.packed
    if isinstance(v, str):
        return bytes((T_STR,)) + enc_str(v.encode())
    if isinstance(v, bytes | bytearray):
        return bytes((T_BIN,)) + enc_str(bytes(v))
    raise TypeError(f"no SPOP type for {type(v).__name__}")


def dec_typed(buf: bytes | memoryview, i: int) -> tuple[Any, int]:
    """(value, next index): strings and binaries as bytes, ints as int, ips as ipaddress objects, NULL as None."""
    t = buf[i] & 0x0F
    i += 1
    if t == T_NULL:
        return None, i
    if t == T_BOOL:
        return bool(buf[i - 1] & 0x10), i
    if t in (T_INT32, T_UINT32, T_INT64, T_UINT64):
        v, i = dec_varint(buf, i)
        if t == T_INT32 and v >= 1 << 31:
            v -= 1 << 32
        elif t == T_INT64 and v >= 1 << 63:
            v -= 1 << 64
        return v, i
    if t == T_IPV4:
        return ipaddress.IPv4Address(bytes(buf[i:i + 4])), i + 4
    if t == T_IPV6:
        return ipaddress.IPv6Address(bytes(buf[i:i + 16])), i + 16
    if t in (T_STR, T_BIN):
        n, i = dec_varint(buf, i)
        if i + n > len(buf):
            raise IndexError("data runs past the frame")
        return bytes(buf[i:i + n]), i + n
    raise SpopError(E_INVALID, f"unknown data type {t}")


def dec_kv(buf: bytes | memoryview, i: int, end: int, n: int | None = None) -> tuple[dict[str, Any], int]:
    """A KV-LIST: n entries, or up to end."""
    out: dict[str, Any] = {}
    while (i < end) if n is None else (len(out) < n):
        k, i = dec_varint(buf, i)
        name = bytes(buf[i:i + k]).decode()
        v, i = dec_typed(buf, i + k)
        out[name] = v
    return out, i


def enc_kv(items: dict[str, Any]) -> bytes:
    return b"".join(enc_str(k.encode()) + enc_typed(v) for k, v in items.items())


def frame(ftype: int, payload: bytes, stream_id: int = 0, frame_id: int = 0) -> bytes:
    """<length:4><type:1><flags:4><stream-id><frame-id><payload>, FIN set (never fragmented)."""
    body = struct.pack("!BI", ftype, FIN) + enc_varint(stream_id) + enc_varint(frame_id) + payload
    return struct.pack("!I", len(body)) + body


def set_vars(variables: dict[str, Any]) -> bytes:
    """ACK actions setting txn-scoped variables (haproxy adds the agent's var-prefix)."""
    return b"".join(bytes((SET_VAR, 3, SCOPE_TXN)) + enc_str(k.encode()) + enc_typed(v) for k, v in variables.items())


def parse_messages(buf: bytes | memoryview, i: int, end: int) -> dict[str, dict[str, Any]]:
    """A NOTIFY's LIST-OF-MESSAGES: {message name: {argument: value}}."""
    out: dict[str, dict[str, Any]] = {}
    while i < end:
        k, i = dec_varint(buf, i)
        name = bytes(buf[i:i + k]).decode()
        nargs = buf[i + k]
        out[name], i = dec_kv(buf, i + k + 1, end, nargs)
    return out


Handler = Callable[[dict[str, dict[str, Any]]], Awaitable[dict[str, Any]]]


class AgentProtocol(asyncio.Protocol):
    """One haproxy -> agent connection. Each NOTIFY runs `handler(messages)` in its own task (pipelining: a
    request waiting at the router's admission gate holds no other); the variables it returns go back in the
    ACK. A handler that raises acks with no variables, which haproxy's config turns into an error answer."""

    def __init__(self, handler: Handler, max_frame: int) -> None:
        self.handler = handler
        self.max_frame = max_frame
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.hello = False
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for t in self.tasks:
            t.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            while len(self.buf) >= 4:
                n = struct.unpack_from("!I", self.buf)[0]
                if n > self.max_frame:
                    raise SpopError(E_TOO_BIG, f"frame of {n} bytes over the {self.max_frame} agreed")
                if len(self.buf) < 4 + n:
                    return
                f = memoryview(self.buf[4:4 + n])  # the slice is a copy: self.buf stays resizable
                del self.buf[:4 + n]
                self._frame(f)
        except (SpopError, IndexError, struct.error, UnicodeDecodeError) as e:
            self._disconnect(e.code if isinstance(e, SpopError) else E_INVALID, str(e) or "invalid frame")

    def _frame(self, f: memoryview) -> None:
        ftype, flags = f[0], struct.unpack_from("!I", f, 1)[0]
        sid, i = dec_varint(f, 5)
        fid, i = dec_varint(f, i)
        if not flags & FIN:
            raise SpopError(E_FRAG, "fragmented frames are not supported")
        if ftype == HAPROXY_HELLO:
            self._hello(dec_kv(f, i, len(f))[0])
        elif ftype == HAPROXY_DISCONNECT:
            self._disconnect(E_NONE, "")
        elif ftype == NOTIFY:
            if not self.hello:
                raise SpopError(E_INVALID, "NOTIFY before HELLO")
            task = asyncio.get_running_loop().create_task(self._notify(sid, fid, parse_messages(f, i, len(f))))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        # other frame types are skipped (SPOE.txt 3.2.2)

    def _hello(self, kv: dict[str, Any]) -> None:
        versions = kv.get("supported-versions")
        if not isinstance(versions, bytes):
            raise SpopError(E_NO_VERSION, "no supported-versions")
        if not any(v.strip().startswith(b"2.") for v in versions.split(b",")):
            raise SpopError(E_BAD_VERSION, f"unsupported SPOP versions {versions.decode()}")
        theirs = kv.get("max-frame-size")
        size = min(self.max_frame, theirs if isinstance(theirs, int) else self.max_frame)
        self.max_frame = size
        assert self.transport is not None
        self.transport.write(frame(AGENT_HELLO, enc_kv({"version": VERSION, "max-frame-size": size,
                                                        "capabilities": "pipelining"})))
        self.hello = True
        if kv.get("healthcheck") is True:
            self.transport.close()

    async def _notify(self, sid: int, fid: int, messages: dict[str, dict[str, Any]]) -> None:
        try:
            variables = await self.handler(messages)
        except Exception:  # noqa: BLE001 - ack without variables: haproxy answers its configured error
            log.exception("SPOE handler failed")
            variables = {}
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(ACK, set_vars(variables), sid, fid))

    def _disconnect(self, code: int, message: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(AGENT_DISCONNECT, enc_kv({"status-code": code, "message": message})))
            self.transport.close()
