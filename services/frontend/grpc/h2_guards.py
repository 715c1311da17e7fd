"""The native HTTP/2 connection's guards: what bounds the cost of one connection to the server
(grpc/limits.py has each limit, its default and where the figure comes from). An H2Guards is
owned by its H2Connection (grpc/h2.py), one each, and holds this state:

- control frames counted per window (a flood closes with ENHANCE_YOUR_CALM), and the check of
  a frame's declared size before its payload is buffered;
- the rapid-reset budget (spent by the peer's RST_STREAM, earned back by answered streams);
- grpc core's ping policy for the client's PINGs, and our keepalive PINGs;
- the timers: handshake, idle, keepalive and connection age here; the connection's own (send,
  stall, linger) armed through ``arm`` so that one table holds them all.

The counters are plain ints touched only by the frames they count, so well-formed traffic
pays nothing for them.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.frontend.grpc.h2_frames import (
    ACK,
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

if TYPE_CHECKING:
    from services.frontend.grpc.h2 import H2Connection

log = logging.getLogger("services.frontend.grpc.h2")   # one logger for the whole connection

# grpc core's ping policy: with no call open (and keepalive_permit_without_calls off) a
# client may PING once per 2 hours, RFC 1122's TCP keepalive interval (ping_abuse_policy.cc).
IDLE_PING_INTERVAL_S = 7200.0
KEEPALIVE_OPAQUE = b"trireme!"       # the payload of our keepalive PINGs
_NEVER = float("-inf")


class H2Guards:
    """Limits, flood counters and timers of one H2Connection. Reads the connection's streams
    (whether any is open), its ``wrote`` and ``idle_since``; acts on it by ``emit``, ``fail``,
    ``goaway`` and ``close``. Lets go of it when stopped (the connection holds this object)."""

    __slots__ = (
        "_conn", "_ctrl", "_ctrl_limit", "_ctrl_since", "_ctrl_window", "_handshake_done",
        "_last_ping", "_limits", "_loop", "_max_header_block", "_max_ping_strikes",
        "_permit_without_calls", "_ping_interval", "_ping_strikes", "_pings_without_data",
        "_reset_budget", "_reset_budget_max", "_reset_since", "_stopped", "_streams", "_timers",
    )

    def __init__(self, conn: H2Connection, streams: dict[int, _Stream], limits: GrpcLimits) -> None:
        self._conn = conn
        self._streams = streams               # the connection's open streams (read here)
        self._loop = conn.loop
        self._limits = limits
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._stopped = False                 # the connection is gone: arm nothing more
        self._handshake_done = False          # the client's first SETTINGS came
        # Limits, copied to plain attributes (grpc/limits.py says where each comes from).
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

    def start(self, now: float) -> None:
        """The connection is made (at ``now``): its timers start."""
        self._ctrl_since = now
        limits = self._limits
        if limits.handshake_timeout_s:
            self.arm("handshake", limits.handshake_timeout_s, self._handshake_expired)
        if limits.idle_timeout_s:
            self.arm("idle", limits.idle_timeout_s, self._check_idle)
        if limits.keepalive_time_ms:
            self.arm("keepalive", limits.keepalive_time_ms / 1000, self._keepalive)
        if limits.max_connection_age_ms:
            self.arm("age", limits.max_connection_age_ms / 1000, self._age_reached)

    def stop(self) -> None:
        """The connection is lost: every timer is cancelled, none is armed again, and the
        connection is let go (it holds this object: kept, the cycle would wait for the
        cyclic GC, which an idle frontend hardly runs)."""
        self._stopped = True
        timers, self._timers = self._timers, {}
        for handle in timers.values():
            handle.cancel()
        del self._conn

    def handshake_spent(self, spent: float) -> None:
        """``spent`` seconds of the handshake timeout went before the connection was made
        (the TLS handshake): what is left of it is for the preface and SETTINGS."""
        timeout = self._limits.handshake_timeout_s
        if timeout and "handshake" in self._timers:
            self.arm("handshake", max(timeout - spent, 0.0), self._handshake_expired)

    def handshake_done(self) -> None:
        """A SETTINGS frame came from the client: the handshake timer stops at the first."""
        if not self._handshake_done:
            self._handshake_done = True
            self.disarm("handshake")

    # -- frames -----------------------------------------------------------------------------
    def check_declared(self, ftype: int, length: int, held: int) -> None:
        """RFC 9113's frame-size rules and the header-block limit, applied to a frame whose
        header has arrived but whose payload has not: the payload is never buffered.
        ``held``: the bytes of a header block being continued."""
        if ftype == HEADERS or ftype == CONTINUATION:
            # a HEADERS frame may carry up to 261 bytes of padding and priority
            slack = 261 if ftype == HEADERS else 0
            if held + length > self._max_header_block + slack:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "header block larger than "
                                       f"SETTINGS_MAX_HEADER_LIST_SIZE ({self._max_header_block})")
        elif (ftype == PING and length != 8) or (ftype == SETTINGS and length % 6) or \
                ((ftype == WINDOW_UPDATE or ftype == RST_STREAM) and length != 4):
            raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of type {ftype} with {length} bytes")

    def control(self, what: str) -> None:
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

    def stream_reset(self) -> None:
        """The client reset a stream before we answered it: rapid reset (CVE-2023-44487)
        spends the budget, which time refills (the whole of it each second)."""
        now = self._loop.time()
        budget = self._reset_budget_max
        self._reset_budget = min(budget, self._reset_budget
                                 + (now - self._reset_since) * budget) - 1
        self._reset_since = now
        if self._reset_budget < 1:          # (the refill of a burst is a fraction)
            raise _ConnectionError(ENHANCE_YOUR_CALM,
                                   "rapid reset: too many streams cancelled by the client")

    def stream_answered(self) -> None:
        """A stream was answered: it earns back a reset."""
        if self._reset_budget < self._reset_budget_max:
            self._reset_budget += 1

    def on_ping(self, sid: int, flags: int, payload: memoryview) -> None:
        if len(payload) != 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"PING of {len(payload)} bytes")
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream")
        self.control("PING")
        if flags & ACK:
            if payload == KEEPALIVE_OPAQUE and "ack" in self._timers:
                self.disarm("ack")                   # the keepalive PING was answered
                self.arm("keepalive", self._limits.keepalive_time_ms / 1000, self._keepalive)
            return
        # grpc core's ping policy (Chttp2PingAbusePolicy::ReceivedOnePing): a PING sooner
        # than the interval after the previous one, with none of our HEADERS/DATA between
        # them, is a strike; one strike more than allowed closes the connection.
        conn = self._conn
        if conn.wrote:
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
        conn.emit(frame_header(8, PING, ACK, 0) + bytes(payload))

    def _data_sent(self) -> None:
        """We sent HEADERS or DATA since the ping counters were last reset: reset them (grpc
        core's ResetPingStrikes, and its pings-without-data count for our keepalive)."""
        self._conn.wrote = False
        self._ping_strikes = 0
        self._last_ping = _NEVER
        self._pings_without_data = 0

    # -- timers -----------------------------------------------------------------------------
    def arm(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` in ``delay`` seconds (instead of what ``name`` was armed with)."""
        old = self._timers.get(name)
        if old is not None:
            old.cancel()
        if not self._stopped:
            self._timers[name] = self._loop.call_later(delay, callback)

    def disarm(self, name: str) -> None:
        handle = self._timers.pop(name, None)
        if handle is not None:
            handle.cancel()

    def armed(self, name: str) -> bool:
        return name in self._timers

    def forget(self, name: str) -> None:
        """Timer ``name`` fired: it is armed no more."""
        self._timers.pop(name, None)

    def _handshake_expired(self) -> None:
        self._timers.pop("handshake", None)
        if not self._handshake_done:
            self._conn.fail(SETTINGS_TIMEOUT, "no HTTP/2 preface and SETTINGS within "
                            f"{self._limits.handshake_timeout_s:g} s")

    def _check_idle(self) -> None:
        """Every idle timeout: close the connection if no stream was open all along."""
        conn = self._conn
        timeout = self._limits.idle_timeout_s
        delay = timeout
        if not self._streams:
            idle_for = self._loop.time() - conn.idle_since
            if idle_for >= timeout:
                self._timers.pop("idle", None)
                log.info("closing HTTP/2 connection idle for %.0f s", idle_for)
                conn.goaway(b"idle_timeout")
                return
            delay = timeout - idle_for
        self.arm("idle", delay, self._check_idle)

    def _keepalive(self) -> None:
        """grpc core's server keepalive: PING after keepalive_time, when a call is open (or
        always, with permit_without_calls), at most max_pings_without_data PINGs between two
        of our HEADERS/DATA frames; no answer within keepalive_timeout closes."""
        self._timers.pop("keepalive", None)
        limits = self._limits
        conn = self._conn
        if self._streams or limits.keepalive_permit_without_calls:
            if conn.wrote:
                self._data_sent()
            cap = limits.max_pings_without_data
            if not cap or self._pings_without_data < cap:
                self._pings_without_data += 1
                conn.emit(frame_header(8, PING, 0, 0) + KEEPALIVE_OPAQUE)
                self.arm("ack", limits.keepalive_timeout_ms / 1000, self._keepalive_expired)
                return                         # the next one is armed by the ACK
        self.arm("keepalive", limits.keepalive_time_ms / 1000, self._keepalive)

    def _keepalive_expired(self) -> None:
        self._timers.pop("ack", None)
        self._conn.fail(NO_ERROR, "keepalive watchdog timeout: no PING ACK within "
                        f"{self._limits.keepalive_timeout_ms} ms", b"keepalive_timeout")

    def _age_reached(self) -> None:
        self._timers.pop("age", None)
        conn = self._conn
        conn.goaway(b"max_age")
        grace = self._limits.max_connection_age_grace_ms
        if grace:
            self.arm("age_grace", grace / 1000, conn.close)
