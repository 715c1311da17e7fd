"""A server-side HTTP/2 connection (RFC 9113) on the asyncio loop, sized for gRPC.

Why not grpc.aio: it hands every call between grpc core's threads and the event loop
(eventfd writes, futexes), several times the CPU per trivial RPC of a frame parser on the
loop itself (docs/benchmarks.md, "Figures behind design choices"). Only what a gRPC server
needs is here: prior-knowledge h2c or h2 over TLS (TlsH2Connection), HEADERS/CONTINUATION
(HPACK decoding by the `hpack` package), DATA with flow control both ways, SETTINGS, PING,
WINDOW_UPDATE, RST_STREAM, GOAWAY. No server push, no priorities (PRIORITY frames are
checked, counted and otherwise ignored).

The application gets one object per stream from ``open_stream(conn, stream_id, headers)``
with three methods: ``data(view)`` (a memoryview into the received bytes), ``end()`` (the
peer half-closed) and ``reset()`` (the peer cancelled, or the connection is gone). It answers
through ``send_headers`` / ``send_data`` / ``send_trailers``; frames produced during one loop
iteration leave in one write.

Owning the server means owning its limits (grpc/limits.py has each one, its default and where
the figure comes from): every buffer here grows with bytes received, never with a size a peer
declares; streams, header blocks and control frames are counted per connection; a peer that
does not read stops being read; every connection has a handshake, an idle and a keepalive
timeout. The counters are plain ints touched only by the frames they count, so well-formed
traffic pays nothing for them.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from hpack import Decoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from services.frontend.grpc.limits import GrpcLimits

log = logging.getLogger(__name__)

__all__ = ["H2Connection", "TlsH2Connection", "encode_literal_headers"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# Error codes (RFC 9113 §7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, \
    FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = range(10)
ENHANCE_YOUR_CALM = 11

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

# grpc core's ping policy: with no call open (and keepalive_permit_without_calls off) a
# client may PING once per 2 hours, RFC 1122's TCP keepalive interval (ping_abuse_policy.cc).
IDLE_PING_INTERVAL_S = 7200.0
KEEPALIVE_OPAQUE = b"trireme!"       # the payload of our keepalive PINGs
HEADER_CACHE_MAX_BLOCK = 1024        # header blocks cached by _decode_headers: at most this long
_NEVER = float("-inf")

DEFAULT_LIMITS = GrpcLimits()


@functools.lru_cache(maxsize=16)
def _preamble(limits: GrpcLimits) -> bytes:
    """Our SETTINGS frame and the connection WINDOW_UPDATE that follows it."""
    settings = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in (
        (S_ENABLE_PUSH, 0), (S_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
        (S_INITIAL_WINDOW_SIZE, RECV_WINDOW), (S_MAX_FRAME_SIZE, RECV_MAX_FRAME),
        (S_MAX_HEADER_LIST_SIZE, limits.max_header_list_size)))
    return (frame_header(len(settings), SETTINGS, 0, 0) + settings
            + frame_header(4, WINDOW_UPDATE, 0, 0) + (RECV_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))


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

    # Slots: a plain instance would outgrow CPython's shared-key dicts (30 keys) and every
    # attribute access on the hot path would get slower.
    __slots__ = (
        "_blocked", "_buf", "_closed", "_ctrl", "_ctrl_limit", "_ctrl_since", "_ctrl_window",
        "_data_end", "_data_left", "_data_sid", "_decoder", "_failed", "_flush_scheduled",
        "_goaway_sent", "_hcache", "_header_block", "_headers_flags", "_headers_sid",
        "_htable_state", "_idle_since", "_initial_window", "_last_opened", "_last_ping",
        "_last_stream", "_limits", "_loop", "_max_frame", "_max_header_block", "_max_ping_strikes",
        "_max_streams", "_need", "_on_close", "_open_stream", "_out", "_permit_without_calls",
        "_ping_interval", "_ping_strikes", "_pings_without_data", "_preface", "_reading_paused",
        "_recv_consumed", "_reset_budget", "_reset_budget_max", "_send_window", "_settings_seen",
        "_streams", "_timers", "_transport", "_write_closed", "_wrote", "idle",
    )

    def __init__(self, open_stream: Callable[[H2Connection, int, list], Any],
                 on_close: Callable[[H2Connection], None] | None = None,
                 limits: GrpcLimits | None = None) -> None:
        self._open_stream = open_stream
        self._on_close = on_close
        self._limits = limits = limits or DEFAULT_LIMITS
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._need = len(PREFACE)
        self._preface = False
        self._settings_seen = False           # the client's first SETTINGS (handshake done)
        self._decoder = Decoder()
        self._decoder.max_header_list_size = limits.max_header_list_size
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0                 # highest stream id the client has used
        self._last_opened = 0                 # highest one handed to the application (GOAWAY)
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
        self._failed = False                  # closed for an error: read nothing more
        self._write_closed = False            # ... and write nothing more (lingering close)
        self._closed = False
        self._reading_paused = False          # the peer does not read what we write
        self._timers: dict[str, asyncio.TimerHandle] = {}
        # Limits, copied to plain attributes (grpc/limits.py says where each comes from).
        self._max_streams = limits.max_concurrent_streams
        self._max_header_block = limits.max_header_list_size
        self._ctrl = 0                        # control frames in the current window
        self._ctrl_limit = limits.max_control_frames
        self._ctrl_window = limits.control_frame_window_s
        self._ctrl_since = 0.0
        self._reset_budget = self._reset_budget_max = limits.reset_budget
        self._ping_interval = limits.min_recv_ping_interval_without_data_ms / 1000
        self._max_ping_strikes = limits.max_ping_strikes
        self._permit_without_calls = limits.keepalive_permit_without_calls
        self._ping_strikes = 0
        self._last_ping = _NEVER
        self._pings_without_data = 0          # keepalive PINGs we sent since our last HEADERS/DATA
        self._wrote = False                   # HEADERS/DATA sent since the ping counters reset
        self._idle_since = 0.0
        self.idle = asyncio.Event()           # no open streams (for graceful shutdown)
        self.idle.set()

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = t = cast(asyncio.Transport, transport)
        limits = self._limits
        t.set_write_buffer_limits(high=limits.write_buffer_high, low=limits.write_buffer_low)
        self._emit(_preamble(limits))
        now = self._loop.time()
        self._idle_since = self._ctrl_since = now
        if limits.handshake_timeout_s:
            self._arm("handshake", limits.handshake_timeout_s, self._handshake_expired)
        if limits.idle_timeout_s:
            self._arm("idle", limits.idle_timeout_s, self._check_idle)
        if limits.keepalive_time_ms:
            self._arm("keepalive", limits.keepalive_time_ms / 1000, self._keepalive)
        if limits.max_connection_age_ms:
            self._arm("age", limits.max_connection_age_ms / 1000, self._age_reached)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        timers, self._timers = self._timers, {}
        for handle in timers.values():
            handle.cancel()
        self._reset_all()
        if self._on_close is not None:
            self._on_close(self)

    def _reset_all(self) -> None:
        """Every open stream is over: its call is cancelled."""
        streams, self._streams = self._streams, {}
        self._blocked.clear()
        for st in streams.values():
            if st.app is not None:
                st.app.reset()
        self.idle.set()

    def pause_writing(self) -> None:
        """More than the high-water mark of our output waits in the transport: the peer is
        not reading. Stop reading it (no more requests, PINGs or SETTINGS to answer) until
        that output drains; cut it if it does not within the send timeout."""
        t = self._transport
        if t is not None and not t.is_closing() and not self._write_closed:
            t.pause_reading()
            self._reading_paused = True
        if self._limits.send_timeout_s:
            self._arm("send", self._limits.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        self._disarm("send")
        t = self._transport
        if self._reading_paused and t is not None and not t.is_closing():
            t.resume_reading()
        self._reading_paused = False

    def data_received(self, data: bytes | memoryview) -> None:
        if self._failed:
            return
        try:
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
            rest = self._parse(data)
        except _ConnectionError as e:
            self._fail(e.code, str(e), e.debug)
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
                if ftype != DATA:
                    self._check_declared(ftype, length)   # refuse it before buffering it
                self._need = 9 + length
                break
            payload = mv[pos + 9:end]
            pos = end
            if self._headers_sid and ftype != CONTINUATION:
                raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
            if ftype == DATA:
                if not length and not flags & END_STREAM:
                    self._control("empty DATA")
                self._on_data(sid, flags, payload)
            elif ftype == HEADERS:
                self._on_headers(sid, flags, payload)
            elif ftype == CONTINUATION:
                self._on_continuation(sid, flags, payload)
            elif ftype == WINDOW_UPDATE:
                self._on_window_update(sid, payload)
            elif ftype == SETTINGS:
                self._on_settings(sid, flags, payload)
            elif ftype == PING:
                self._on_ping(sid, flags, payload)
            elif ftype == RST_STREAM:
                self._on_reset(sid, payload)
            elif ftype == PRIORITY:
                self._on_priority(sid, payload)
            elif ftype == GOAWAY:
                self._on_goaway(sid, payload)
            elif ftype == PUSH_PROMISE:
                raise _ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            else:                              # unknown types are ignored (RFC 9113 §4.1)...
                self._control("unknown frame type")   # ... but not without limit
        return mv[pos:] if pos < n else None

    def _check_declared(self, ftype: int, length: int) -> None:
        """RFC 9113's frame-size rules and the header-block limit, applied to a frame whose
        header has arrived but whose payload has not: the payload is never buffered."""
        if ftype == HEADERS or ftype == CONTINUATION:
            # a HEADERS frame may carry up to 261 bytes of padding and priority
            slack = 261 if ftype == HEADERS else 0
            if len(self._header_block) + length > self._max_header_block + slack:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                       f"SETTINGS_MAX_HEADER_LIST_SIZE ({self._max_header_block})")
        elif (ftype == PING and length != 8) or (ftype == SETTINGS and length % 6) or \
                ((ftype == WINDOW_UPDATE or ftype == RST_STREAM) and length != 4):
            raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of type {ftype} with {length} bytes")

    def _control(self, what: str) -> None:
        """Count a control frame; more than the limit within one window is a flood. The
        clock is read once per `max_control_frames` frames, not per frame."""
        self._ctrl += 1
        if self._ctrl >= self._ctrl_limit:
            now = self._loop.time()
            if now - self._ctrl_since < self._ctrl_window:
                raise _ConnectionError(
                    ENHANCE_YOUR_CALM, f"flood: {self._ctrl} control frames in "
                    f"{now - self._ctrl_since:.3f} s (the last: {what})")
            self._ctrl = 0
            self._ctrl_since = now

    def _on_data(self, sid: int, flags: int, payload: memoryview) -> None:
        if flags & PADDED:
            if not len(payload) or payload[0] >= len(payload):
                raise _ConnectionError(PROTOCOL_ERROR, "DATA padding longer than the frame")
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
        elif not sid or sid > self._last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        return st

    def _on_headers(self, sid: int, flags: int, payload: memoryview) -> None:
        if not sid & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"bad stream id {sid}")
        if flags & PADDED:
            if not len(payload) or payload[0] >= len(payload):
                raise _ConnectionError(PROTOCOL_ERROR, "HEADERS padding longer than the frame")
            payload = payload[1:len(payload) - payload[0]]
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if len(payload) > self._max_header_block:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                   f"SETTINGS_MAX_HEADER_LIST_SIZE ({self._max_header_block})")
        if flags & END_HEADERS:
            self._headers_complete(sid, flags, bytes(payload))
        else:
            self._headers_sid, self._headers_flags = sid, flags
            self._header_block = bytearray(payload)

    def _on_continuation(self, sid: int, flags: int, payload: memoryview) -> None:
        if not self._headers_sid or sid != self._headers_sid:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without a header block")
        self._control("CONTINUATION")
        if len(self._header_block) + len(payload) > self._max_header_block:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                   f"SETTINGS_MAX_HEADER_LIST_SIZE ({self._max_header_block})")
        self._header_block += payload
        if flags & END_HEADERS:
            self._headers_sid = 0
            block, self._header_block = bytes(self._header_block), bytearray()
            self._headers_complete(sid, self._headers_flags, block)

    def _headers_complete(self, sid: int, flags: int, block: bytes) -> None:
        headers = self._decode_headers(block)
        st = self._streams.get(sid)
        if st is not None:                    # trailers from the client: only ends the stream
            if flags & END_STREAM:
                st.app.end()
            return
        if sid <= self._last_stream:
            self._control("HEADERS on a closed stream")
            return                            # a late frame for a stream we already closed
        self._last_stream = sid
        if self._goaway_sent:
            self._emit_reset(sid, REFUSED_STREAM)   # the client may retry it elsewhere
            return
        if len(self._streams) >= self._max_streams:
            self._emit_reset(sid, REFUSED_STREAM)   # RFC 9113 §5.1.2
            self._control("stream beyond SETTINGS_MAX_CONCURRENT_STREAMS")
            return
        st = _Stream(self._initial_window)
        self._streams[sid] = st
        self._last_opened = sid
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
        except OversizedHeaderListError as e:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "header list larger than "
                                   f"SETTINGS_MAX_HEADER_LIST_SIZE ({self._max_header_block})"
                                   ) from e
        except HPACKError as e:
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {e}") from e
        entries = table.dynamic_entries
        # An insertion puts a new tuple first; holding the old first one makes `is` exact.
        state = (entries[0] if entries else None, len(entries), table.maxsize)
        last = self._htable_state
        if last is None or state[0] is not last[0] or state[1:] != last[1:]:
            self._hcache.clear()
            self._htable_state = state
        elif len(self._hcache) < 64 and len(block) <= HEADER_CACHE_MAX_BLOCK:
            self._hcache[block] = headers
        return headers

    def _on_window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"WINDOW_UPDATE of {len(payload)} bytes")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if not inc:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            if not self._streams:
                self._control("WINDOW_UPDATE")   # nothing of ours waits for it
            self._send_window += inc
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
            for blocked in list(self._blocked):
                self._drain(blocked)
            return
        st = self._streams.get(sid)
        if st is None:
            if sid > self._last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            self._control("WINDOW_UPDATE")       # a closed stream: ignored, but counted
            return
        if not inc:
            self._stream_error(sid, PROTOCOL_ERROR)
            return
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            self._stream_error(sid, FLOW_CONTROL_ERROR)
            return
        self._drain(sid)

    def _on_settings(self, sid: int, flags: int, payload: memoryview) -> None:
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if len(payload):
                raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR,
                                   f"SETTINGS of {len(payload)} bytes, not a multiple of 6")
        self._control("SETTINGS")
        if not self._settings_seen:
            self._settings_seen = True
            self._disarm("handshake")
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._initial_window
                self._initial_window = value
                for st in self._streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        raise _ConnectionError(FLOW_CONTROL_ERROR, "stream window overflow")
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise _ConnectionError(PROTOCOL_ERROR, f"bad max frame size {value}")
                self._max_frame = value
            elif key == S_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, f"bad ENABLE_PUSH {value}")
        self._emit(frame_header(0, SETTINGS, ACK, 0))
        for blocked in list(self._blocked):
            self._drain(blocked)

    def _on_ping(self, sid: int, flags: int, payload: memoryview) -> None:
        if len(payload) != 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"PING of {len(payload)} bytes")
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream")
        self._control("PING")
        if flags & ACK:
            if payload == KEEPALIVE_OPAQUE and "ack" in self._timers:
                self._disarm("ack")                  # the keepalive PING was answered
                self._arm("keepalive", self._limits.keepalive_time_ms / 1000, self._keepalive)
            return
        # grpc core's ping policy (Chttp2PingAbusePolicy::ReceivedOnePing): a PING sooner
        # than the interval after the previous one, with none of our HEADERS/DATA between
        # them, is a strike; one strike more than allowed closes the connection.
        if self._wrote:
            self._data_sent()
        now = self._loop.time()
        interval = self._ping_interval if (self._streams or self._permit_without_calls) \
            else IDLE_PING_INTERVAL_S
        last, self._last_ping = self._last_ping, now
        if now < last + interval:
            self._ping_strikes += 1
            if self._max_ping_strikes and self._ping_strikes > self._max_ping_strikes:
                raise _ConnectionError(ENHANCE_YOUR_CALM, f"{self._ping_strikes} ping strikes",
                                       b"too_many_pings")
        self._emit(frame_header(8, PING, ACK, 0) + bytes(payload))

    def _data_sent(self) -> None:
        """We sent HEADERS or DATA since the ping counters were last reset: reset them (grpc
        core's ResetPingStrikes, and its pings-without-data count for our keepalive)."""
        self._wrote = False
        self._ping_strikes = 0
        self._last_ping = _NEVER
        self._pings_without_data = 0

    def _on_reset(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"RST_STREAM of {len(payload)} bytes")
        if not sid or sid > self._last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        self._control("RST_STREAM")
        st = self._streams.pop(sid, None)
        self._blocked.discard(sid)
        if st is not None:
            if st.app is not None:
                st.app.reset()
            # Reset before we answered it: rapid reset (CVE-2023-44487) spends the budget.
            self._reset_budget -= 1
            if self._reset_budget <= 0:
                raise _ConnectionError(ENHANCE_YOUR_CALM,
                                       "rapid reset: too many streams cancelled by the client")
        self._maybe_close()

    def _on_priority(self, sid: int, payload: memoryview) -> None:
        if not sid:
            raise _ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
        self._control("PRIORITY")
        if len(payload) != 5:
            self._stream_error(sid, FRAME_SIZE_ERROR)   # RFC 9113 §6.3: a stream error

    def _on_goaway(self, sid: int, payload: memoryview) -> None:
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"GOAWAY of {len(payload)} bytes")
        self._control("GOAWAY")
        self._goaway_sent = True      # no new streams either way; finish the open ones
        self._maybe_close()

    def _stream_error(self, sid: int, code: int) -> None:
        """End one stream with RST_STREAM ``code``; the connection goes on."""
        st = self._streams.pop(sid, None)
        self._blocked.discard(sid)
        if st is not None and st.app is not None:
            st.app.reset()
        self._emit_reset(sid, code)
        self._maybe_close()

    # -- sending ----------------------------------------------------------------------------
    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        """Send a header block (response headers, or trailers with ``end_stream``)."""
        st = self._streams.get(sid)
        if st is None or st.closed_local:
            return
        self._wrote = True
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
        self._wrote = True
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
            if self._reset_budget < self._reset_budget_max:
                self._reset_budget += 1           # an answered stream earns back a reset
            self._maybe_close()

    def _emit_reset(self, sid: int, code: int) -> None:
        self._emit(frame_header(4, RST_STREAM, 0, sid) + code.to_bytes(4, "big"))

    def _emit_goaway(self, code: int, debug: bytes = b"") -> None:
        self._emit(frame_header(8 + len(debug), GOAWAY, 0, 0) + self._last_opened.to_bytes(4, "big")
                   + code.to_bytes(4, "big") + debug)

    def _emit(self, chunk: Any) -> None:
        self._out.append(chunk)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        t = self._transport
        if t is not None and not self._write_closed and not t.is_closing():
            t.writelines(out)

    # -- timers -----------------------------------------------------------------------------
    def _arm(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        old = self._timers.get(name)
        if old is not None:
            old.cancel()
        if not self._closed:
            self._timers[name] = self._loop.call_later(delay, callback)

    def _disarm(self, name: str) -> None:
        handle = self._timers.pop(name, None)
        if handle is not None:
            handle.cancel()

    def _handshake_expired(self) -> None:
        self._timers.pop("handshake", None)
        if not self._settings_seen:
            self._fail(SETTINGS_TIMEOUT, "no HTTP/2 preface and SETTINGS within "
                       f"{self._limits.handshake_timeout_s:g} s")

    def _check_idle(self) -> None:
        """Every idle timeout: close the connection if no stream was open all along."""
        timeout = self._limits.idle_timeout_s
        delay = timeout
        if not self._streams:
            idle_for = self._loop.time() - self._idle_since
            if idle_for >= timeout:
                self._timers.pop("idle", None)
                log.info("closing HTTP/2 connection idle for %.0f s", idle_for)
                self.goaway(b"idle_timeout")
                return
            delay = timeout - idle_for
        self._arm("idle", delay, self._check_idle)

    def _keepalive(self) -> None:
        """grpc core's server keepalive: PING after keepalive_time, when a call is open (or
        always, with permit_without_calls), at most max_pings_without_data PINGs between two
        of our HEADERS/DATA frames; no answer within keepalive_timeout closes."""
        self._timers.pop("keepalive", None)
        limits = self._limits
        if self._streams or limits.keepalive_permit_without_calls:
            if self._wrote:
                self._data_sent()
            cap = limits.max_pings_without_data
            if not cap or self._pings_without_data < cap:
                self._pings_without_data += 1
                self._emit(frame_header(8, PING, 0, 0) + KEEPALIVE_OPAQUE)
                self._arm("ack", limits.keepalive_timeout_ms / 1000, self._keepalive_expired)
                return                         # the next one is armed by the ACK
        self._arm("keepalive", limits.keepalive_time_ms / 1000, self._keepalive)

    def _keepalive_expired(self) -> None:
        self._timers.pop("ack", None)
        self._fail(NO_ERROR, "keepalive watchdog timeout: no PING ACK within "
                   f"{self._limits.keepalive_timeout_ms} ms", b"keepalive_timeout")

    def _age_reached(self) -> None:
        self._timers.pop("age", None)
        self.goaway(b"max_age")
        grace = self._limits.max_connection_age_grace_ms
        if grace:
            self._arm("age_grace", grace / 1000, self.close)

    def _send_timed_out(self) -> None:
        self._timers.pop("send", None)
        log.info("closing HTTP/2 connection: the client read nothing for %g s",
                 self._limits.send_timeout_s)
        self._abort()

    def _abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.abort()

    # -- lifecycle --------------------------------------------------------------------------
    def goaway(self, debug: bytes = b"") -> None:
        """Refuse new streams and close once the open ones are done (graceful shutdown)."""
        if self._closed:
            return
        if not self._goaway_sent:
            self._goaway_sent = True
            self._emit_goaway(NO_ERROR, debug)
        self._maybe_close()

    def close(self) -> None:
        """Close after what is queued is written; cut after close_linger_s if the peer
        does not take it."""
        if self._transport is not None and not self._closed:
            self._flush()
            self._transport.close()
            if self._limits.close_linger_s and "linger" not in self._timers:
                self._arm("linger", self._limits.close_linger_s, self._abort)

    def _maybe_close(self) -> None:
        if not self._streams:
            self._idle_since = self._loop.time()
            self.idle.set()
            if self._goaway_sent:
                self._loop.call_soon(self.close)   # after the last frames are flushed

    def _fail(self, code: int, why: str, debug: bytes = b"") -> None:
        """GOAWAY ``code`` and close. A lingering close, as nginx's lingering_close: our side
        is shut for writing after the GOAWAY, and what the peer still sends is read and
        dropped until it closes too (or close_linger_s passes). Closed with unread bytes, the
        socket would send RST, and the peer's kernel could drop the GOAWAY unread."""
        if self._failed:
            return
        self._failed = True
        log.info("closing HTTP/2 connection: %s", why)
        if self._preface:
            self._emit_goaway(code, debug)
        self._goaway_sent = True
        self._reset_all()                      # no answer can reach the peer any more
        t = self._transport
        if t is None or self._closed or t.is_closing() or not t.can_write_eof():
            self.close()
            return
        self._flush()
        self._write_closed = True
        t.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        self._arm("linger", self._limits.close_linger_s, self._abort)


class TlsH2Connection(H2Connection):
    """HTTP/2 over TLS. Created at accept, made (connection_made) once the TLS handshake is
    done: the handshake timeout covers both, the TLS handshake (create_server's
    ssl_handshake_timeout, the same figure) and then what is left of it for the preface and
    SETTINGS. A connection that did not select "h2" by ALPN, one whose client offered none
    included, is closed before we send a byte: RFC 9113 §3.3 negotiates HTTP/2 over TLS by
    ALPN only (prior knowledge is for cleartext), and grpc core refuses such a peer too."""
    __slots__ = ("_accepted",)

    def __init__(self, open_stream: Callable[[H2Connection, int, list], Any],
                 on_close: Callable[[H2Connection], None] | None = None,
                 limits: GrpcLimits | None = None) -> None:
        super().__init__(open_stream, on_close, limits)
        self._accepted = self._loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = transport.get_extra_info("ssl_object")
        if tls is None or tls.selected_alpn_protocol() != "h2":
            log.info('closing TLS connection: the client did not negotiate "h2" by ALPN '
                     "(RFC 9113 §3.3)")
            self._failed = True                # read nothing; connection_lost cleans up
            transport.close()
            return
        super().connection_made(transport)
        timeout = self._limits.handshake_timeout_s
        if timeout and "handshake" in self._timers:
            left = timeout - (self._loop.time() - self._accepted)
            self._arm("handshake", max(left, 0.0), self._handshake_expired)


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str, debug: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.debug = debug
