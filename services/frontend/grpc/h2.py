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

A connection owns two collaborators, a module each, each with its own state:
``receiver`` (grpc/h2_receive.py: frames in, the receive windows, header blocks; it is the
connection's ``data_received``) and ``guards`` (grpc/h2_guards.py: control-frame and reset
accounting, ping policy, timers). grpc/h2_frames.py has the wire format. Here: the
connection's streams, sending within the peer's flow control (with the WINDOW_UPDATE and
SETTINGS frames that govern it), the transport's reading and writing, closing; and
TlsH2Connection.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, cast

from services.frontend.grpc.h2_frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    SETTINGS,
    _ConnectionError,
    _preamble,
    _Stream,
    frame_header,
)
from services.frontend.grpc.h2_frames import _hpack_int as _hpack_int  # tests reach it here
from services.frontend.grpc.h2_guards import H2Guards
from services.frontend.grpc.h2_receive import H2Receiver
from services.frontend.grpc.limits import GrpcLimits

log = logging.getLogger(__name__)

__all__ = ["H2Connection", "TlsH2Connection"]

DEFAULT_LIMITS = GrpcLimits()


class H2Connection(asyncio.BaseProtocol):
    """One client connection. ``open_stream(conn, stream_id, headers)`` -> stream app;
    ``on_open(conn)`` once it is made, ``on_close(conn)`` once it is lost. Over TLS it is
    made only when the handshake succeeds: one that fails, or a peer that leaves during
    it, neither makes nor loses it (asyncio and uvloop call neither), so whoever keeps
    connections must take them from ``on_open``, not from the protocol factory."""

    # Slots: a plain instance would outgrow CPython's shared-key dicts (30 keys) and every
    # attribute access on the hot path would get slower. ``data_received``, ``hold`` and
    # ``taken`` are the receiver's own methods, bound once (no call in between per read;
    # uvloop, too, takes ``data_received`` once, when the transport is made).
    __slots__ = (
        "_blocked", "_closed", "_failed", "_flush_scheduled", "_initial_window", "_last_opened",
        "_limits", "_loop", "_max_frame", "_max_streams", "_on_close", "_on_open", "_open_stream",
        "_out", "_queued", "_reading_paused", "_send_window", "_stream_answered", "_streams",
        "_transport", "_waiters", "_write_closed", "data_received", "goaway_sent", "guards",
        "hold", "idle", "idle_since", "receiver", "taken", "wrote",
    )

    def __init__(self, open_stream: Callable[[H2Connection, int, list], Any],
                 on_close: Callable[[H2Connection], None] | None = None,
                 limits: GrpcLimits | None = None,
                 on_open: Callable[[H2Connection], None] | None = None) -> None:
        self._open_stream = open_stream
        self._on_open = on_open
        self._on_close = on_close
        self._limits = limits = limits or DEFAULT_LIMITS
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._streams: dict[int, _Stream] = {}   # (the receiver and the guards read it too)
        self._out: list[Any] = []
        self._flush_scheduled = False
        self._blocked: set[int] = set()       # streams waiting for window credit
        self._queued = 0                      # DATA bytes of all streams waiting for credit
        self._waiters: list[Callable[[], None]] = []   # called once when _queued falls
        self._send_window = DEFAULT_WINDOW    # connection-level credit from the peer
        self._initial_window = DEFAULT_WINDOW   # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self._max_frame = 16_384              # the peer's SETTINGS_MAX_FRAME_SIZE
        self._max_streams = limits.max_concurrent_streams
        self._last_opened = 0                 # highest stream id handed to the application
        self._failed = False                  # closed for an error: read nothing more
        self._write_closed = False            # ... and write nothing more (lingering close)
        self._closed = False
        self._reading_paused = False          # the peer does not read what we write
        self.goaway_sent = False              # no new streams (our GOAWAY, or the client's)
        self.wrote = False                    # HEADERS/DATA sent since the guards' ping reset
        self.idle_since = 0.0                 # when the last stream ended
        self.idle = asyncio.Event()           # no open streams (for graceful shutdown)
        self.idle.set()
        self.guards = guards = H2Guards(self, self._streams, limits)
        self._stream_answered = guards.stream_answered
        self.receiver = receiver = H2Receiver(self, guards, self._streams, limits)
        self.data_received = receiver.data_received
        self.hold, self.taken = receiver.hold, receiver.taken

    # -- asyncio's protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = t = cast(asyncio.Transport, transport)
        if self._on_open is not None:
            self._on_open(self)
        limits = self._limits
        t.set_write_buffer_limits(high=limits.write_buffer_high, low=limits.write_buffer_low)
        self.emit(_preamble(limits))
        self.idle_since = now = self._loop.time()
        self.guards.start(now)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.guards.stop()
        self._reset_all()
        self.receiver.close()
        if self._on_close is not None:
            self._on_close(self)

    def eof_received(self) -> None:
        """The peer sends nothing more: the transport closes (as asyncio.Protocol's)."""

    def pause_writing(self) -> None:
        """More than the high-water mark of our output waits in the transport: the peer is
        not reading. Stop reading it (no more requests, PINGs or SETTINGS to answer) until
        that output drains; cut it if it does not within the send timeout."""
        t = self._transport
        if t is not None and not t.is_closing() and not self._write_closed:
            t.pause_reading()
            self._reading_paused = True
        if self._limits.send_timeout_s:
            self.guards.arm("send", self._limits.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        self.guards.disarm("send")
        t = self._transport
        if self._reading_paused and t is not None and not t.is_closing():
            t.resume_reading()
        self._reading_paused = False

    def _reset_all(self) -> None:
        """Every open stream is over: its call is cancelled."""
        streams = list(self._streams.values())
        self._streams.clear()                 # (the same dict stays: others hold it)
        self._blocked.clear()
        self._queued = 0
        for st in streams:
            st.pending.clear()
            if st.app is not None:
                st.app.reset()
        self.idle.set()
        self._wake()

    # -- streams the peer opens and ends (for the receiver) ---------------------------------
    def accept(self, sid: int, headers: list) -> _Stream | None:
        """A stream the client opened with ``headers``, handed to the application; None
        when it is refused (REFUSED_STREAM): we are going away, or at the stream limit."""
        if self.goaway_sent:
            self._emit_reset(sid, REFUSED_STREAM)   # the client may retry it elsewhere
            return None
        if len(self._streams) >= self._max_streams:
            self._emit_reset(sid, REFUSED_STREAM)   # RFC 9113 §5.1.2
            self.guards.control("stream beyond SETTINGS_MAX_CONCURRENT_STREAMS")
            return None
        st = _Stream(self._initial_window)
        self._streams[sid] = st
        self._last_opened = sid
        self.idle.clear()
        st.app = self._open_stream(self, sid, headers)
        return st

    def drop_stream(self, sid: int) -> _Stream | None:
        """Stream ``sid`` is over before its end (reset): its call is cancelled."""
        st = self._streams.pop(sid, None)
        self._blocked.discard(sid)
        if st is not None:
            self._dropped(st)
            if st.app is not None:
                st.app.reset()
        return st

    def stream_error(self, sid: int, code: int) -> None:
        """End one stream with RST_STREAM ``code``; the connection goes on."""
        self.drop_stream(sid)
        self._emit_reset(sid, code)
        self.maybe_close()

    def peer_goaway(self) -> None:
        """The client's GOAWAY: no new streams either way; the open ones finish."""
        self.goaway_sent = True
        self.maybe_close()

    # -- the frames that govern our sending (for the receiver) ------------------------------
    def on_window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"WINDOW_UPDATE of {len(payload)} bytes")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if not inc:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            if not self._streams:
                self.guards.control("WINDOW_UPDATE")   # nothing of ours waits for it
            self._send_window += inc
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
            for blocked in list(self._blocked):
                self._drain(blocked)
            return
        st = self._streams.get(sid)
        if st is None:
            if sid > self.receiver.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            self.guards.control("WINDOW_UPDATE")   # a closed stream: ignored, but counted
            return
        if not inc:
            self.stream_error(sid, PROTOCOL_ERROR)
            return
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            self.stream_error(sid, FLOW_CONTROL_ERROR)
            return
        self._drain(sid)

    def on_settings(self, sid: int, flags: int, payload: memoryview) -> None:
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if len(payload):
                raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR,
                                   f"SETTINGS of {len(payload)} bytes, not a multiple of 6")
        self.guards.control("SETTINGS")
        self.guards.handshake_done()
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
        self.emit(frame_header(0, SETTINGS, ACK, 0))
        for blocked in list(self._blocked):
            self._drain(blocked)

    # -- sending ----------------------------------------------------------------------------
    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        """Send a header block (response headers, or trailers with ``end_stream``)."""
        st = self._streams.get(sid)
        if st is None or st.closed_local:
            return
        self.wrote = True
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
        self.wrote = True
        view = memoryview(data).cast("B")
        st.pending.append(("d", view, end_stream))
        st.queued += len(view)
        self._queued += len(view)
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
            self._dropped(st)
            self.maybe_close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this connection runs on (held: asyncio.get_running_loop() costs a
        getpid syscall a call on 3.11)."""
        return self._loop

    # -- answers waiting for the client (backpressure) ---------------------------------------
    def writable(self, sid: int) -> bool:
        """Whether stream ``sid`` may take a new request: its answers, and the connection's,
        waiting for the client's credit are below their bounds (GrpcLimits)."""
        if self._queued >= self._limits.max_pending_connection_bytes:
            return False
        st = self._streams.get(sid)
        return st is None or st.queued < self._limits.max_pending_stream_bytes

    @property
    def queued_bytes(self) -> int:
        """Answer bytes of every stream waiting for the client's credit."""
        return self._queued

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, the next time waiting answers leave (or are dropped)."""
        self._waiters.append(callback)

    async def wait_writable(self, sid: int) -> None:
        """Until stream ``sid`` is writable(), or gone."""
        while not self.writable(sid) and sid in self._streams:
            fut: asyncio.Future[None] = self._loop.create_future()
            self.when_drained(functools.partial(_resolve, fut))
            await fut

    def _wake(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for callback in waiters:
                callback()

    def _dropped(self, st: _Stream) -> None:
        """A stream left with answers still queued: they will never be sent."""
        if st.queued:
            self._queued -= st.queued
            st.queued = 0
            st.pending.clear()
            self._wake()

    def _drain(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            self._blocked.discard(sid)
            return
        pending = st.pending
        sent = False
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
                    self._stall(sid, st)
                    if sent:
                        self._sent()
                    return
                last = n == len(item)
                self.emit(frame_header(n, DATA, END_STREAM if (last and end) else 0, sid))
                if n:
                    self.emit(item[:n])
                    st.queued -= n
                    self._queued -= n
                    sent = True
                self._send_window -= n
                st.send_window -= n
                if last:
                    break
                item = item[n:]
            pending.popleft()
        self._blocked.discard(sid)
        st.stalled = 0.0
        if sent:
            self._sent()
        if st.closed_local:
            self._close_stream(sid, st)

    def _sent(self) -> None:
        """Queued answers left: re-open the windows held shut at a bound, wake waiters."""
        receiver = self.receiver
        if receiver.withheld:
            receiver.return_credit()
        if self._waiters:
            self._wake()

    def _stall(self, sid: int, st: _Stream) -> None:
        """Stream ``sid`` waits for the client's credit; past the send timeout it is reset."""
        self._blocked.add(sid)
        if not st.stalled:
            st.stalled = self._loop.time()
            timeout = self._limits.send_timeout_s
            if timeout and not self.guards.armed("stall"):
                self.guards.arm("stall", timeout, self._check_stalls)

    def _emit_headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        limit = self._max_frame
        if len(block) <= limit:
            self.emit(frame_header(len(block), HEADERS, flags, sid) + block)
            return
        first, rest = block[:limit], block[limit:]
        self.emit(frame_header(len(first), HEADERS, flags & ~END_HEADERS, sid) + first)
        while rest:
            chunk, rest = rest[:limit], rest[limit:]
            self.emit(frame_header(len(chunk), CONTINUATION, 0 if rest else END_HEADERS, sid)
                      + chunk)

    def _close_stream(self, sid: int, st: _Stream) -> None:
        if st.pending:
            return
        if self._streams.pop(sid, None) is not None:
            self._stream_answered()               # (it earns back a reset)
            self.maybe_close()

    def _emit_reset(self, sid: int, code: int) -> None:
        self.emit(frame_header(4, RST_STREAM, 0, sid) + code.to_bytes(4, "big"))

    def _emit_goaway(self, code: int, debug: bytes = b"") -> None:
        self.emit(frame_header(8 + len(debug), GOAWAY, 0, 0) + self._last_opened.to_bytes(4, "big")
                  + code.to_bytes(4, "big") + debug)

    def emit(self, chunk: Any) -> None:
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

    # -- lifecycle --------------------------------------------------------------------------
    def goaway(self, debug: bytes = b"") -> None:
        """Refuse new streams and close once the open ones are done (graceful shutdown)."""
        if self._closed:
            return
        if not self.goaway_sent:
            self.goaway_sent = True
            self._emit_goaway(NO_ERROR, debug)
        self.maybe_close()

    def close(self) -> None:
        """Close after what is queued is written; cut after close_linger_s if the peer
        does not take it."""
        if self._transport is not None and not self._closed:
            self._flush()
            self._transport.close()
            if self._limits.close_linger_s and not self.guards.armed("linger"):
                self.guards.arm("linger", self._limits.close_linger_s, self._abort)

    def maybe_close(self) -> None:
        if not self._streams:
            self.idle_since = self._loop.time()
            self.idle.set()
            if self.goaway_sent:
                self._loop.call_soon(self.close)   # after the last frames are flushed

    def fail(self, code: int, why: str, debug: bytes = b"") -> None:
        """GOAWAY ``code`` and close. A lingering close, as nginx's lingering_close: our side
        is shut for writing after the GOAWAY, and what the peer still sends is read and
        dropped until it closes too (or close_linger_s passes). Closed with unread bytes, the
        socket would send RST, and the peer's kernel could drop the GOAWAY unread."""
        if self._failed:
            return
        self._failed = True
        self.receiver.stop()
        log.info("closing HTTP/2 connection: %s", why)
        if self.receiver.preface:
            self._emit_goaway(code, debug)
        self.goaway_sent = True
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
        self.guards.arm("linger", self._limits.close_linger_s, self._abort)

    def _check_stalls(self) -> None:
        """Reset every stream whose answer has waited for the client's credit longer than
        the send timeout (what it held is dropped); look again for the others."""
        self.guards.forget("stall")
        timeout = self._limits.send_timeout_s
        now = self._loop.time()
        first = now
        for sid in list(self._blocked):
            st = self._streams.get(sid)
            if st is None or not st.stalled:
                continue
            if now - st.stalled >= timeout:
                log.info("resetting HTTP/2 stream %d: the client read nothing of its answer "
                         "for %g s", sid, timeout)
                self.stream_error(sid, CANCEL)
            else:
                first = min(first, st.stalled)
        if first < now:
            self.guards.arm("stall", first + timeout - now, self._check_stalls)

    def _send_timed_out(self) -> None:
        self.guards.forget("send")
        log.info("closing HTTP/2 connection: the client read nothing for %g s",
                 self._limits.send_timeout_s)
        self._abort()

    def _abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.abort()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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
                 limits: GrpcLimits | None = None,
                 on_open: Callable[[H2Connection], None] | None = None) -> None:
        super().__init__(open_stream, on_close, limits, on_open)
        self._accepted = self._loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = transport.get_extra_info("ssl_object")
        if tls is None or tls.selected_alpn_protocol() != "h2":
            log.info('closing TLS connection: the client did not negotiate "h2" by ALPN '
                     "(RFC 9113 §3.3)")
            self._failed = True                # read nothing; connection_lost cleans up
            self.receiver.stop()
            transport.close()
            return
        super().connection_made(transport)
        self.guards.handshake_spent(self._loop.time() - self._accepted)


