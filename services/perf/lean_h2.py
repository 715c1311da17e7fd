"""The lean gRPC path: ModelInfer over our own few lines of HTTP/2 client. Each request's
ModelInferRequest is serialised once (by tritonclient.grpc's own encoder, so the message is
the one its infer() sends), framed once (the gRPC length prefix; compressed once with
--grpc-compression-algorithm), and its header block is one HPACK literal block built once:
a request costs two frame headers and one write. Why not grpcio's aio channel with a generic
unary call and identity serialisers (bytes in and out, no protobuf work): at c64 against the
ONNX identity model on the 2-core box, one process each, 59-66 µs of client CPU per call
and 8.7-9.4k calls/s there, 17-18 µs and 14-15k calls/s here (same server, alternated).

    LeanLoad ──send(i)──▶ H2Connection ──HEADERS + DATA──▶ server
        ▲                     │ data_received: frames; DATA counted, never kept;
        └── done / failed ────┘ header blocks decoded once each (HPACK, cached)

What it speaks of HTTP/2 (RFC 9113): the preface and SETTINGS (ours: no push, a header table
of 0 so the server's header blocks decode the same every time and are cached by their
bytes, the largest receive windows), flow control both ways (a request larger than the
server's windows waits for its WINDOW_UPDATEs), PING, RST_STREAM, GOAWAY, CONTINUATION,
padding. A call succeeds on `:status` 200 and `grpc-status` 0; anything else fails with
tritonclient's text, "[StatusCode.NAME] message".

The client's time split on this path: "send" is handing the frames to the socket, "receive"
is from the response's HEADERS to its END_STREAM; no output is decoded.
"""
from __future__ import annotations

import asyncio
import gzip
import struct
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from services.perf.inputs import Sample
from services.perf.worker_core import WorkerSpec, now_ns

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, \
    S_MAX_FRAME_SIZE = range(1, 6)
DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
RECV_MAX_FRAME = 1 << 20          # the largest frame we accept (a header block's, in practice)
DEFAULT_STREAMS = 100             # streams per connection when the server sets no limit
CACHED_BLOCKS = 256
METHOD = b"/inference.GRPCInferenceService/ModelInfer"
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
_FRAME = struct.Struct(">HBBBI")  # (length's top 16 bits, its low 8), type, flags, stream id


class ProtocolError(Exception):
    """The connection cannot go on (the server broke HTTP/2, or went away)."""


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 8, n & 0xFF, ftype, flags, sid) + payload


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """HPACK 'literal header field without indexing, new name' for each pair (RFC 7541
    §6.2.2): touches no dynamic table, so one block serves every request on any connection."""
    return b"".join(b"\x00" + _hpack_int(len(k), 7) + k + _hpack_int(len(v), 7) + v
                    for k, v in headers)


def status_text(code: int, message: str) -> str:
    """tritonclient's text for a failed call."""
    name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else str(code)
    return f"[StatusCode.{name}] {message}"


def grpc_message(spec: WorkerSpec, sample: Sample) -> bytes:
    """One request's gRPC message (length prefix and ModelInferRequest), compressed as
    --grpc-compression-algorithm says."""
    import tritonclient.grpc as grpcclient  # type: ignore[import-untyped]
    from tritonclient.grpc._utils import _get_inference_request  # type: ignore[import-untyped]
    dtypes = {t.name: t.datatype for t in spec.inputs}
    inputs = []
    for name, arr in sample.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtypes[name])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    msg = _get_inference_request(
        model_name=spec.model, inputs=inputs, model_version=spec.version, request_id="",
        outputs=None, sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
        timeout=None, parameters=spec.parameters or None).SerializeToString()
    flag = 0
    if spec.grpc_compression == "gzip":
        msg, flag = gzip.compress(msg), 1
    elif spec.grpc_compression == "deflate":
        msg, flag = zlib.compress(msg), 1
    return bytes((flag,)) + len(msg).to_bytes(4, "big") + msg


def request_block(spec: WorkerSpec, host: str, port: int) -> bytes:
    """The header block of every ModelInfer call: a gRPC client's, with -H as metadata."""
    authority = f"[{host}]" if ":" in host else host
    headers = [(b":method", b"POST"), (b":scheme", b"https" if spec.ssl.grpc_use_ssl else b"http"),
               (b":path", METHOD), (b":authority", f"{authority}:{port}".encode()),
               (b"content-type", b"application/grpc"), (b"te", b"trailers"),
               (b"grpc-accept-encoding", b"identity,deflate,gzip"),
               (b"user-agent", b"trireme-perf")]
    if spec.grpc_compression in ("gzip", "deflate"):
        headers.append((b"grpc-encoding", spec.grpc_compression.encode()))
    headers += [(k.lower().encode(), v.encode()) for k, v in spec.headers.items()]
    return literal_block(headers)


class _Call:
    __slots__ = ("first", "grpc_status", "message", "sent", "status", "t0", "token", "window")

    def __init__(self, token: Any, window: int) -> None:
        self.token = token
        self.window = window          # what we may still send on it
        self.t0 = self.sent = self.first = 0
        self.status = b""             # :status
        self.grpc_status = b""
        self.message = b""


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection, up to `capacity` calls in flight. ``done(conn, token, start,
    end, send_ns, recv_ns)`` for a call that succeeded, ``failed(conn, token, text)`` for one
    that did not (or was cut by the connection's end)."""

    def __init__(self, messages: list[bytes], block: bytes, done: Callable, failed: Callable,
                 loop: asyncio.AbstractEventLoop) -> None:
        import hpack
        self.messages, self.block, self.done, self.failed = messages, block, done, failed
        self.decoder = hpack.Decoder()
        self.transport: Any = None
        self.ready: asyncio.Future = loop.create_future()   # done at the server's SETTINGS
        self.open = False
        self.calls: dict[int, _Call] = {}
        self.next_sid = 1
        self.capacity = DEFAULT_STREAMS
        self.max_frame = 16_384
        self.initial_window = DEFAULT_WINDOW   # the server's, for each new stream
        self.window = DEFAULT_WINDOW           # the connection's send window
        self.pending: deque[tuple[int, memoryview]] = deque()   # DATA waiting for credit
        self.consumed = 0                      # received DATA not yet credited back
        self.now = 0
        self._buf = b""
        self._skip = self._skip_sid = self._skip_end = 0   # the unread rest of a DATA frame
        self._fragments: list[bytes] = []      # a header block awaiting CONTINUATION
        self._block_sid = self._block_end = 0
        self._cache: dict[bytes, tuple[bytes, bytes, bytes]] = {}

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    # ---- asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        settings = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in (
            (S_HEADER_TABLE_SIZE, 0), (S_ENABLE_PUSH, 0), (S_INITIAL_WINDOW_SIZE, MAX_WINDOW),
            (S_MAX_FRAME_SIZE, RECV_MAX_FRAME)))
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings) + frame(
            WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_all(f"the server closed the connection{f': {exc}' if exc else ''}")

    def data_received(self, data: bytes) -> None:
        self.now = now_ns()
        if self._buf:
            data, self._buf = self._buf + data, b""
        try:
            self._frames(data)
        except ProtocolError as e:
            self._end_all(str(e))
        except Exception as e:   # noqa: BLE001  (hpack's errors: the connection is unusable)
            self._end_all(f"bad HTTP/2 from the server: {type(e).__name__}: {e}")

    # ---- the load's side
    def send(self, data: int, token: Any) -> None:
        sid = self.next_sid
        self.next_sid += 2
        call = self.calls[sid] = _Call(token, self.initial_window)
        msg = self.messages[data]
        n = len(msg)
        block = self.block
        head = _FRAME.pack(len(block) >> 8, len(block) & 0xFF, HEADERS, END_HEADERS, sid) + block
        t0 = now_ns()
        if n <= self.max_frame and n <= self.window and n <= call.window and not self.pending:
            self.window -= n
            call.window -= n
            self.transport.write(head + _FRAME.pack(n >> 8, n & 0xFF, DATA, END_STREAM, sid) + msg)
        else:
            self.transport.write(head)
            self.pending.append((sid, memoryview(msg)))
            self._flush()
        call.t0, call.sent = t0, now_ns() - t0

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    # ---- frames in
    def _frames(self, data: bytes) -> None:
        pos, n = 0, len(data)
        calls = self.calls
        while True:
            if self._skip:                       # the rest of a DATA frame: counted, not kept
                k = min(self._skip, n - pos)
                pos += k
                self._skip -= k
                if self._skip:
                    return
                if self._skip_end:
                    self._end(self._skip_sid)
            if n - pos < 9:
                break
            hi, lo, ftype, flags, sid = _FRAME.unpack_from(data, pos)
            length, sid = (hi << 8) | lo, sid & 0x7FFFFFFF
            if length > RECV_MAX_FRAME:
                raise ProtocolError(f"a frame of {length} bytes (we accept {RECV_MAX_FRAME})")
            if ftype == DATA:
                pos += 9
                self._credit(length)
                k = min(length, n - pos)
                pos += k
                if k < length:
                    self._skip, self._skip_sid, self._skip_end = length - k, sid, flags & END_STREAM
                    return
                if flags & END_STREAM:
                    self._end(sid)
                continue
            if n - pos - 9 < length:
                break
            payload = data[pos + 9:pos + 9 + length]
            pos += 9 + length
            if ftype == HEADERS:
                call = calls.get(sid)
                if call is not None and not call.first:
                    call.first = self.now
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self._block_sid, self._block_end = sid, flags & END_STREAM
                if flags & END_HEADERS:
                    self._headers(payload)
                else:
                    self._fragments = [payload]
            elif ftype == CONTINUATION:
                if not self._fragments or sid != self._block_sid:
                    raise ProtocolError("an unexpected CONTINUATION frame")
                self._fragments.append(payload)
                if flags & END_HEADERS:
                    block, self._fragments = b"".join(self._fragments), []
                    self._headers(block)
            else:
                self._control(ftype, flags, sid, payload)
        self._buf = data[pos:]

    def _decode(self, block: bytes) -> tuple[bytes, bytes, bytes]:
        """(:status, grpc-status, grpc-message) of a header block, b"" where absent; cached
        by the block's bytes while the decoder's dynamic table is (and stays) empty."""
        table = self.decoder.header_table
        cacheable = not table.dynamic_entries and block[:1] and block[0] & 0xE0 != 0x20
        if cacheable:
            hit = self._cache.get(block)
            if hit is not None:
                return hit
        status = grpc_status = message = b""
        for k, v in self.decoder.decode(block, raw=True):
            if k == b":status":
                status = bytes(v)
            elif k == b"grpc-status":
                grpc_status = bytes(v)
            elif k == b"grpc-message":
                message = bytes(v)
        got = (status, grpc_status, message)
        if cacheable and not table.dynamic_entries and len(self._cache) < CACHED_BLOCKS:
            self._cache[block] = got
        return got

    def _headers(self, block: bytes) -> None:
        status, grpc_status, message = self._decode(block)   # (every block: it moves the table)
        call = self.calls.get(self._block_sid)
        if call is not None:
            if status:
                call.status = status
            if grpc_status:
                call.grpc_status, call.message = grpc_status, message
        if self._block_end:
            self._end(self._block_sid)

    def _control(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == SETTINGS:
            if flags & ACK:
                return
            for i in range(0, len(payload) - 5, 6):
                key = int.from_bytes(payload[i:i + 2], "big")
                value = int.from_bytes(payload[i + 2:i + 6], "big")
                if key == S_INITIAL_WINDOW_SIZE:
                    for c in self.calls.values():
                        c.window += value - self.initial_window
                    self.initial_window = value
                elif key == S_MAX_FRAME_SIZE:
                    self.max_frame = value
                elif key == S_MAX_CONCURRENT_STREAMS:
                    self.capacity = max(1, min(value, 1000))
            self.transport.write(frame(SETTINGS, ACK, 0))
            self._flush()
            if not self.ready.done():
                self.open = True
                self.ready.set_result(None)
        elif ftype == WINDOW_UPDATE:
            grow = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if sid == 0:
                self.window += grow
            elif (call := self.calls.get(sid)) is not None:
                call.window += grow
            self._flush()
        elif ftype == PING:
            if not flags & ACK:
                self.transport.write(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            call = self.calls.pop(sid, None)
            if call is not None:
                code = int.from_bytes(payload[:4], "big")
                self.failed(self, call.token, status_text(
                    13, f"the server reset the stream (HTTP/2 error code {code})"))
        elif ftype == GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            code = int.from_bytes(payload[4:8], "big")
            self.open = False    # (no new streams; those the server took may still end)
            for s in [s for s in self.calls if s > last]:
                self.failed(self, self.calls.pop(s).token, status_text(
                    14, f"the server went away (GOAWAY, HTTP/2 error code {code})"))
        elif ftype == PUSH_PROMISE:
            raise ProtocolError("a PUSH_PROMISE (push is off)")

    def _credit(self, n: int) -> None:
        self.consumed += n
        if self.consumed > MAX_WINDOW // 2:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, self.consumed.to_bytes(4, "big")))
            self.consumed = 0

    def _end(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is None:
            return
        if call.status == b"200" and call.grpc_status == b"0":
            self.done(self, call.token, call.t0, self.now, call.sent,
                      self.now - call.first if call.first else 0)
            return
        if call.grpc_status:
            text = status_text(int(call.grpc_status), unquote(call.message.decode("utf-8",
                                                                               "replace")))
        else:
            text = status_text(2, f"HTTP status {call.status.decode() or 'missing'}")
        self.failed(self, call.token, text)

    def _end_all(self, text: str) -> None:
        self.close()
        calls, self.calls = self.calls, {}
        self.pending.clear()
        for call in calls.values():
            self.failed(self, call.token, status_text(14, text))
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(text))

    # ---- frames out, within the server's windows
    def _flush(self) -> None:
        while self.pending:
            sid, rest = self.pending[0]
            call = self.calls.get(sid)
            if call is None:                     # (the call ended: reset, or went away)
                self.pending.popleft()
                continue
            n = min(len(rest), self.window, call.window, self.max_frame)
            if n <= 0:
                return
            last = n == len(rest)
            self.transport.write(frame(DATA, END_STREAM if last else 0, sid, bytes(rest[:n])))
            self.window -= n
            call.window -= n
            if last:
                self.pending.popleft()
            else:
                self.pending[0] = (sid, rest[n:])
