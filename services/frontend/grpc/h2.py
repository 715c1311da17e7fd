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

The connection is one class in layers, a module each: grpc/h2_frames.py (the wire format:
frame constants, frame headers, HPACK literal blocks), h2_guards.py (limits: control-frame
and reset accounting, ping policy, write-buffer water marks, timers), h2_receive.py (frames
in: parsing and each frame type's handler), and here H2Connection itself (the connection's
state, sending within flow control, closing) and TlsH2Connection.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, cast

from services.frontend.grpc.h2_frames import (
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    RST_STREAM,
    _preamble,
    _Stream,
    frame_header,
)
from services.frontend.grpc.h2_frames import _hpack_int as _hpack_int  # tests reach it here
from services.frontend.grpc.h2_receive import H2Receiver
from services.frontend.grpc.limits import GrpcLimits

log = logging.getLogger(__name__)

__all__ = ["H2Connection", "TlsH2Connection"]

DEFAULT_LIMITS = GrpcLimits()


class H2Connection(H2Receiver):
    """One client connection. ``open_stream(conn, stream_id, headers)`` -> stream app."""

    # Slots: a plain instance would outgrow CPython's shared-key dicts (30 keys) and every
    # attribute access on the hot path would get slower. Each layer declares its own: the
    # receiving side's in grpc/h2_receive.py, the guards' in grpc/h2_guards.py.
    __slots__ = (
        "_blocked", "_closed", "_failed", "_flush_scheduled", "_limits", "_loop", "_on_close",
        "_backlog", "_open_stream", "_out", "_queued", "_streams", "_transport", "_waiters",
        "_write_closed", "idle",
    )

    def __init__(self, open_stream: Callable[[H2Connection, int, list], Any],
                 on_close: Callable[[H2Connection], None] | None = None,
                 limits: GrpcLimits | None = None) -> None:
        self._open_stream = open_stream
        self._on_close = on_close
        self._limits = limits = limits or DEFAULT_LIMITS
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._streams: dict[int, _Stream] = {}
        self._out: list[Any] = []
        self._flush_scheduled = False
        self._blocked: set[int] = set()       # streams waiting for window credit
        self._queued = 0                      # DATA bytes of all streams waiting for credit
        self._backlog = 0                     # request bytes received, not yet taken (hold())
        self._waiters: list[Callable[[], None]] = []   # called once when _queued falls
        self._failed = False                  # closed for an error: read nothing more
        self._write_closed = False            # ... and write nothing more (lingering close)
        self._closed = False
        super().__init__(limits)
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
        self._queued = 0
        for st in streams.values():
            st.pending.clear()
            if st.app is not None:
                st.app.reset()
        self.idle.set()
        self._wake()

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
            self._maybe_close()

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

    def hold(self, sid: int, n: int) -> None:
        """``n`` bytes of complete request messages of stream ``sid`` wait for their handler:
        while half a receive window of them waits on a stream, or the pending-answer bound
        of them on the connection, the client's credit is held back (h2_receive._credit),
        so a client cannot send faster than its requests are taken."""
        self._backlog += n
        st = self._streams.get(sid)
        if st is not None:
            st.backlog += n

    def taken(self, sid: int, n: int) -> None:
        """Held request bytes of stream ``sid`` were handed on (or dropped)."""
        self._backlog -= n
        st = self._streams.get(sid)
        if st is not None:
            st.backlog -= n
        if self._withheld:                # some credit waits for this
            self._return_credit()

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
                self._emit(frame_header(n, DATA, END_STREAM if (last and end) else 0, sid))
                if n:
                    self._emit(item[:n])
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
        if self._withheld:
            self._return_credit()
        if self._waiters:
            self._wake()

    def _stall(self, sid: int, st: _Stream) -> None:
        """Stream ``sid`` waits for the client's credit; past the send timeout it is reset."""
        self._blocked.add(sid)
        if not st.stalled:
            st.stalled = self._loop.time()
            timeout = self._limits.send_timeout_s
            if timeout and "stall" not in self._timers:
                self._arm("stall", timeout, self._check_stalls)

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


