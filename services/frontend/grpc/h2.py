"""A server-side HTTP/2 connection (RFC 9113) on the asyncio loop, sized for gRPC.

Why not grpc.aio: it hands every call between grpc core's threads and the event loop
(eventfd writes, futexes), several times the CPU per trivial RPC of a frame parser on the
loop itself (docs/benchmarks.md, "Figures behind design choices"). Only what a gRPC server
needs is here: prior-knowledge h2c, HEADERS/CONTINUATION (HPACK decoding by the `hpack`
package), DATA with flow control both ways, SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY. No
server push, no priorities (PRIORITY frames are read and ignored).

The application gets one object per stream from ``open_stream(conn, stream_id, headers)``
with three methods: ``data(view)`` (a memoryview into the received bytes), ``end()`` (the
peer half-closed) and ``reset()`` (the peer cancelled, or the connection is gone). It answers
through ``send_headers`` / ``send_data`` / ``send_trailers``; frames produced during one loop
iteration leave in one write.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from hpack import Decoder
from hpack.exceptions import HPACKError

log = logging.getLogger(__name__)

__all__ = ["H2Connection", "encode_literal_headers"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# Error codes.
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0, 1, 3, 6, 9
CANCEL = 8

# Settings identifiers.
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, \
    S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = range(1, 7)

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
# What we accept: big frames mean fewer parser iterations for large tensors; windows at the
# maximum so that a client never stalls on us (memory is bounded by max message size).
RECV_MAX_FRAME = 1 << 20
RECV_WINDOW = MAX_WINDOW
WINDOW_REFILL = 1 << 30      # re-open a receive window once this much has been consumed

_OUR_SETTINGS = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in (
    (S_ENABLE_PUSH, 0), (S_INITIAL_WINDOW_SIZE, RECV_WINDOW), (S_MAX_FRAME_SIZE, RECV_MAX_FRAME),
    (S_MAX_HEADER_LIST_SIZE, 1 << 20)))


def frame_header(length: int, ftype: int, flags: int, stream_id: int) -> bytes:
    return (length.to_bytes(3, "big") + bytes((ftype, flags)) + stream_id.to_bytes(4, "big"))


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """HPACK 'literal header field without indexing' for each pair (RFC 7541 §6.2.2): the
    block never touches either side's dynamic table, so it can be built once and reused on
    any connection."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value
    return bytes(out)


class _Stream:
    __slots__ = ("app", "closed_local", "pending", "recv_consumed", "send_window")

    def __init__(self, send_window: int) -> None:
        self.app: Any = None
        self.send_window = send_window
        # Frames waiting for flow-control credit: ("d", memoryview, end) / ("h", block, end).
        self.pending: deque = deque()
        self.recv_consumed = 0
        self.closed_local = False


class H2Connection(asyncio.Protocol):
    """One client connection. ``open_stream(conn, stream_id, headers)`` -> stream app."""

    def __init__(self, open_stream: Callable[[H2Connection, int, list], Any],
                 on_close: Callable[[H2Connection], None] | None = None) -> None:
        self._open_stream = open_stream
        self._on_close = on_close
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._need = len(PREFACE)
        self._preface = False
        self._decoder = Decoder()
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._headers_sid = 0                 # a header block is being continued
        self._headers_flags = 0
        self._header_block = bytearray()
        self._send_window = DEFAULT_WINDOW    # connection-level credit from the peer
        self._initial_window = DEFAULT_WINDOW
        self._max_frame = 16_384              # the peer's SETTINGS_MAX_FRAME_SIZE
        self._recv_consumed = 0
        self._data_left = 0                   # payload bytes still to come of a large DATA frame
        self._data_sid = 0
        self._data_end = False
        self._hcache: dict[bytes, list] = {}  # header block -> headers, see _decode_headers
        self._htable_state: Any = None
        self._out: list[Any] = []
        self._flush_scheduled = False
        self._blocked: set[int] = set()       # streams waiting for window credit
        self._goaway_sent = False
        self._closed = False
        self.idle = asyncio.Event()           # no open streams (for graceful shutdown)
        self.idle.set()

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._emit(frame_header(len(_OUR_SETTINGS), SETTINGS, 0, 0) + _OUR_SETTINGS)
        self._emit(frame_header(4, WINDOW_UPDATE, 0, 0)
                   + (RECV_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        streams, self._streams = self._streams, {}
        for st in streams.values():
            if st.app is not None:
                st.app.reset()
        self.idle.set()
        if self._on_close is not None:
            self._on_close(self)

    def data_received(self, data: bytes | memoryview) -> None:
        if self._data_left:
            rest = self._continue_data(data)
            if rest is None:
                return
            data = rest
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:
                return
            data = bytes(self._buf)
            self._buf = bytearray()
        elif len(data) < self._need:
            self._buf += data
            return
        try:
            rest = self._parse(data)
        except _ConnectionError as e:
            self._fail(e.code, str(e))
            return
        if rest is not None:
            self._buf += rest

    def _continue_data(self, data: bytes | memoryview) -> memoryview | None:
        """The next piece of a large DATA frame's payload goes straight to its stream (a
        4 MiB tensor is not gathered here first); returns what follows the frame, if any."""
        take = min(len(data), self._data_left)
        self._data_left -= take
        last = self._data_left == 0
        self._deliver(self._data_sid, memoryview(data)[:take], last and self._data_end)
        if not last or take == len(data):
            return None
        return memoryview(data)[take:]

    # -- parsing ----------------------------------------------------------------------------
    def _parse(self, data: bytes | memoryview) -> memoryview | None:
        """Handle every complete frame in ``data``; return the incomplete tail, if any."""
        mv = memoryview(data)
        n = len(data)
        pos = 0
        if not self._preface:
            if data[:24] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 client preface")
            self._preface = True
            pos = 24
        while True:
            if n - pos < 9:
                self._need = 9
                break
            length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            if length > RECV_MAX_FRAME:
                raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
            end = pos + 9 + length
            ftype = data[pos + 3]
            flags = data[pos + 4]
            sid = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            if end > n:
                if ftype == DATA and not flags & PADDED and not self._headers_sid:
                    self._data_left, self._data_sid = length, sid
                    self._data_end = bool(flags & END_STREAM)
                    self._need = 9
                    rest = self._continue_data(mv[pos + 9:])
                    assert rest is None
                    return None
                self._need = 9 + length
                break
            payload = mv[pos + 9:end]
            pos = end
            if self._headers_sid and ftype != CONTINUATION:
                raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
            if ftype == DATA:
                self._on_data(sid, flags, payload)
            elif ftype == HEADERS:
                self._on_headers(sid, flags, payload)
            elif ftype == CONTINUATION:
                self._on_continuation(sid, flags, payload)
            elif ftype == WINDOW_UPDATE:
                self._on_window_update(sid, payload)
            elif ftype == SETTINGS:
                self._on_settings(flags, payload)
            elif ftype == PING:
                if not flags & ACK:
                    self._emit(frame_header(8, PING, ACK, 0) + bytes(payload))
            elif ftype == RST_STREAM:
                self._on_reset(sid)
            elif ftype == GOAWAY:
                self._goaway_sent = True      # no new streams either way; finish the open ones
                self._maybe_close()
            elif ftype == PUSH_PROMISE:
                raise _ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # PRIORITY and unknown frame types are ignored, as RFC 9113 requires.
        return mv[pos:] if pos < n else None

    def _on_data(self, sid: int, flags: int, payload: memoryview) -> None:
        if flags & PADDED:
            pad = payload[0] + 1
            self._credit(sid, pad)             # padding counts against flow control too
            payload = payload[1:len(payload) - payload[0]]
        self._deliver(sid, payload, bool(flags & END_STREAM))

    def _deliver(self, sid: int, payload: memoryview, end_stream: bool) -> None:
        st = self._credit(sid, len(payload))
        if st is None:
            return   # a stream we already closed; its credit was returned
        if len(payload):
            st.app.data(payload)
        if end_stream:
            st.app.end()

    def _credit(self, sid: int, size: int) -> _Stream | None:
        """Account for received DATA bytes; re-open the windows before they run low."""
        self._recv_consumed += size
        if self._recv_consumed >= WINDOW_REFILL:
            self._emit(frame_header(4, WINDOW_UPDATE, 0, 0) + self._recv_consumed.to_bytes(4, "big"))
            self._recv_consumed = 0
        st = self._streams.get(sid)
        if st is not None:
            st.recv_consumed += size
            if st.recv_consumed >= WINDOW_REFILL:
                self._emit(frame_header(4, WINDOW_UPDATE, 0, sid)
                           + st.recv_consumed.to_bytes(4, "big"))
                st.recv_consumed = 0
        return st

    def _on_headers(self, sid: int, flags: int, payload: memoryview) -> None:
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._headers_complete(sid, flags, bytes(payload))
        else:
            self._headers_sid, self._headers_flags = sid, flags
            self._header_block = bytearray(payload)

    def _on_continuation(self, sid: int, flags: int, payload: memoryview) -> None:
        if sid != self._headers_sid:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION for another stream")
        self._header_block += payload
        if flags & END_HEADERS:
            self._headers_sid = 0
            self._headers_complete(sid, self._headers_flags, bytes(self._header_block))
            self._header_block = bytearray()

    def _headers_complete(self, sid: int, flags: int, block: bytes) -> None:
        headers = self._decode_headers(block)
        st = self._streams.get(sid)
        if st is not None:                    # trailers from the client: only ends the stream
            if flags & END_STREAM:
                st.app.end()
            return
        if sid <= self._last_stream:
            return                            # a late frame for a stream we already closed
        if sid % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"bad stream id {sid}")
        self._last_stream = sid
        if self._goaway_sent:
            self._emit_reset(sid, 7)          # REFUSED_STREAM: the client may retry it
            return
        st = _Stream(self._initial_window)
        self._streams[sid] = st
        self.idle.clear()
        st.app = self._open_stream(self, sid, headers)
        if flags & END_STREAM:
            st.app.end()

    def _decode_headers(self, block: bytes) -> list:
        """HPACK-decode a header block. A client sends the same block for every call of a
        method once its headers sit in the dynamic table, and decoding such a block leaves
        the table as it was: its result is cached until the table changes."""
        cached = self._hcache.get(block)
        if cached is not None:
            return cached
        table = self._decoder.header_table
        try:
            # a list (the stub says Iterable): the cache below hands it out again
            headers = cast(list, self._decoder.decode(block, raw=True))
        except HPACKError as e:
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {e}") from e
        entries = table.dynamic_entries
        # An insertion puts a new tuple first; holding the old first one makes `is` exact.
        state = (entries[0] if entries else None, len(entries), table.maxsize)
        last = self._htable_state
        if last is None or state[0] is not last[0] or state[1:] != last[1:]:
            self._hcache.clear()
            self._htable_state = state
        elif len(self._hcache) < 64:
            self._hcache[block] = headers
        return headers

    def _on_window_update(self, sid: int, payload: memoryview) -> None:
        inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        if sid == 0:
            self._send_window += inc
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
            for blocked in list(self._blocked):
                self._drain(blocked)
            return
        st = self._streams.get(sid)
        if st is not None:
            st.send_window += inc
            self._drain(sid)

    def _on_settings(self, flags: int, payload: memoryview) -> None:
        if flags & ACK:
            return
        for i in range(0, len(payload) - 5, 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._initial_window
                self._initial_window = value
                for st in self._streams.values():
                    st.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise _ConnectionError(PROTOCOL_ERROR, f"bad max frame size {value}")
                self._max_frame = value
        self._emit(frame_header(0, SETTINGS, ACK, 0))
        for sid in list(self._blocked):
            self._drain(sid)

    def _on_reset(self, sid: int) -> None:
        st = self._streams.pop(sid, None)
        self._blocked.discard(sid)
        if st is not None and st.app is not None:
            st.app.reset()
        self._maybe_close()

    # -- sending ----------------------------------------------------------------------------
    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        """Send a header block (response headers, or trailers with ``end_stream``)."""
        st = self._streams.get(sid)
        if st is None or st.closed_local:
            return
        if st.pending:                         # trailers wait behind queued data
            st.pending.append(("h", block, end_stream))
            if end_stream:
                st.closed_local = True
            return
        self._emit_headers(sid, block, end_stream)
        if end_stream:
            self._close_stream(sid, st)

    def send_data(self, sid: int, data: Any, end_stream: bool = False) -> None:
        """Send bytes on a stream within the peer's flow-control windows; what does not fit
        waits for WINDOW_UPDATE. ``data`` is kept, not copied, until written."""
        st = self._streams.get(sid)
        if st is None or st.closed_local:
            return
        st.pending.append(("d", memoryview(data).cast("B"), end_stream))
        if end_stream:
            st.closed_local = True
        self._drain(sid)

    def send_trailers(self, sid: int, block: bytes) -> None:
        self.send_headers(sid, block, end_stream=True)

    def reset_stream(self, sid: int, code: int = CANCEL) -> None:
        """RST_STREAM after whatever was already sent on it (NO_ERROR after a complete
        response asks the client to stop sending its request)."""
        st = self._streams.pop(sid, None)
        self._blocked.discard(sid)
        self._emit_reset(sid, code)
        if st is not None:
            self._maybe_close()

    def _drain(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            self._blocked.discard(sid)
            return
        pending = st.pending
        while pending:
            kind, item, end = pending[0]
            if kind == "h":
                pending.popleft()
                self._emit_headers(sid, item, end)
                continue
            while True:
                n = min(len(item), self._send_window, st.send_window, self._max_frame)
                if n <= 0 and len(item):
                    pending[0] = ("d", item, end)   # the rest waits for WINDOW_UPDATE
                    self._blocked.add(sid)
                    return
                last = n == len(item)
                self._emit(frame_header(n, DATA, END_STREAM if (last and end) else 0, sid))
                if n:
                    self._emit(item[:n])
                self._send_window -= n
                st.send_window -= n
                if last:
                    break
                item = item[n:]
            pending.popleft()
        self._blocked.discard(sid)
        if st.closed_local:
            self._close_stream(sid, st)

    def _emit_headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        limit = self._max_frame
        if len(block) <= limit:
            self._emit(frame_header(len(block), HEADERS, flags, sid) + block)
            return
        first, rest = block[:limit], block[limit:]
        self._emit(frame_header(len(first), HEADERS, flags & ~END_HEADERS, sid) + first)
        while rest:
            chunk, rest = rest[:limit], rest[limit:]
            self._emit(frame_header(len(chunk), CONTINUATION, 0 if rest else END_HEADERS, sid)
                       + chunk)

    def _close_stream(self, sid: int, st: _Stream) -> None:
        if st.pending:
            return
        if self._streams.pop(sid, None) is not None:
            self._maybe_close()

    def _emit_reset(self, sid: int, code: int) -> None:
        self._emit(frame_header(4, RST_STREAM, 0, sid) + code.to_bytes(4, "big"))

    def _emit(self, chunk: Any) -> None:
        self._out.append(chunk)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if self._transport is not None and not self._closed:
            self._transport.writelines(out)

    # -- lifecycle --------------------------------------------------------------------------
    def goaway(self) -> None:
        """Refuse new streams and close once the open ones are done (graceful shutdown)."""
        if self._closed:
            return
        if not self._goaway_sent:
            self._goaway_sent = True
            self._emit(frame_header(8, GOAWAY, 0, 0) + self._last_stream.to_bytes(4, "big")
                       + NO_ERROR.to_bytes(4, "big"))
        self._maybe_close()

    def close(self) -> None:
        if self._transport is not None and not self._closed:
            self._flush()
            self._transport.close()

    def _maybe_close(self) -> None:
        if not self._streams:
            self.idle.set()
            if self._goaway_sent:
                self._loop.call_soon(self.close)   # after the last frames are flushed

    def _fail(self, code: int, why: str) -> None:
        log.info("closing HTTP/2 connection: %s", why)
        if self._preface:
            self._emit(frame_header(8, GOAWAY, 0, 0) + self._last_stream.to_bytes(4, "big")
                       + code.to_bytes(4, "big"))
        self._goaway_sent = True
        self.close()


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
