"""The native HTTP/2 connection's guards: what bounds the cost of one connection to the server
(grpc/limits.py has each limit, its default and where the figure comes from). A layer of
H2Connection (grpc/h2.py), not used alone; it owns this state:

- control frames counted per window (a flood closes with ENHANCE_YOUR_CALM), and the check of
  a frame's declared size before its payload is buffered;
- the rapid-reset budget (spent by the receiving side, earned back by answered streams);
- grpc core's ping policy for the client's PINGs, and our keepalive PINGs;
- the write buffer's water marks: a peer that does not read stops being read;
- the timers: handshake, idle, keepalive, connection age, send and linger.

The counters are plain ints touched only by the frames they count, so well-formed traffic
pays nothing for them.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.frontend.grpc.h2_frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    HEADERS,
    NO_ERROR,
    PING,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    SETTINGS_TIMEOUT,
    WINDOW_UPDATE,
    _ConnectionError,
    _Stream,
    frame_header,
)
from services.frontend.grpc.limits import GrpcLimits

log = logging.getLogger("services.frontend.grpc.h2")   # one logger for the whole connection

# grpc core's ping policy: with no call open (and keepalive_permit_without_calls off) a
# client may PING once per 2 hours, RFC 1122's TCP keepalive interval (ping_abuse_policy.cc).
IDLE_PING_INTERVAL_S = 7200.0
KEEPALIVE_OPAQUE = b"trireme!"       # the payload of our keepalive PINGs
_NEVER = float("-inf")


class H2Guards(asyncio.Protocol):
    """Limits, flood counters and timers of an H2Connection (its lowest layer)."""

    __slots__ = (
        "_ctrl", "_ctrl_limit", "_ctrl_since", "_ctrl_window", "_idle_since", "_last_ping",
        "_max_header_block", "_max_ping_strikes", "_max_streams", "_permit_without_calls",
        "_ping_interval", "_ping_strikes", "_pings_without_data", "_reading_paused",
        "_reset_budget", "_reset_budget_max", "_reset_since", "_timers", "_wrote",
    )

    if TYPE_CHECKING:   # the connection's own state and methods (grpc/h2.py, h2_receive.py)
        _loop: asyncio.AbstractEventLoop
        _transport: asyncio.Transport | None
        _limits: GrpcLimits
        _streams: dict[int, _Stream]
        _closed: bool
        _write_closed: bool
        _settings_seen: bool
        _header_block: bytearray

        _blocked: set[int]

        def _emit(self, chunk: Any) -> None: ...
        def _stream_error(self, sid: int, code: int) -> None: ...
        def _fail(self, code: int, why: str, debug: bytes = b"") -> None: ...
        def goaway(self, debug: bytes = b"") -> None: ...
        def close(self) -> None: ...

    def __init__(self, limits: GrpcLimits) -> None:
        self._reading_paused = False          # the peer does not read what we write
        self._timers: dict[str, asyncio.TimerHandle] = {}
        # Limits, copied to plain attributes (grpc/limits.py says where each comes from).
        self._max_streams = limits.max_concurrent_streams
        self._max_header_block = limits.max_header_list_size
        self._ctrl = 0                        # control frames in the current window
        self._ctrl_limit = limits.max_control_frames
        self._ctrl_window = limits.control_frame_window_s
        self._ctrl_since = 0.0
        self._reset_budget: float = limits.reset_budget
        self._reset_budget_max = limits.reset_budget
        self._reset_since = 0.0              # when the budget was last spent
        self._ping_interval = limits.min_recv_ping_interval_without_data_ms / 1000
        self._max_ping_strikes = limits.max_ping_strikes
        self._permit_without_calls = limits.keepalive_permit_without_calls
        self._ping_strikes = 0
        self._last_ping = _NEVER
        self._pings_without_data = 0          # keepalive PINGs we sent since our last HEADERS/DATA
        self._wrote = False                   # HEADERS/DATA sent since the ping counters reset
        self._idle_since = 0.0

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

    def _check_stalls(self) -> None:
        """Reset every stream whose answer has waited for the client's credit longer than
        the send timeout (what it held is dropped); look again for the others."""
        self._timers.pop("stall", None)
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
                self._stream_error(sid, CANCEL)
            else:
                first = min(first, st.stalled)
        if first < now:
            self._arm("stall", first + timeout - now, self._check_stalls)

    def _send_timed_out(self) -> None:
        self._timers.pop("send", None)
        log.info("closing HTTP/2 connection: the client read nothing for %g s",
                 self._limits.send_timeout_s)
        self._abort()

    def _abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.abort()
