"""Every limit of the gRPC servers, its default, its flag and where the figure comes from.

The native server (grpc/native.py on grpc/h2.py) enforces all of them; the grpc.aio
alternative (grpc/aio_server.py) gets the ones grpc core has a channel argument for. Flags
named like Triton's (`--grpc-keepalive-*`, `--grpc-http2-*ping*`, `--grpc-max-connection-age*`)
take Triton's units (milliseconds) and defaults (src/grpc/grpc_server.h, KeepAliveOptions);
the others are ours, for limits Triton leaves to grpc core.

What each limit stops, and how it answers (docs/security.md has the operator's view):

- a length prefix declaring more than ``max_message_size``: RESOURCE_EXHAUSTED, in grpc
  core's words. Message buffers grow with the bytes that arrive, never with the size a prefix
  declares, so a prefix alone costs nothing; a compressed message is inflated only up to the
  limit.
- a HEADERS frame opening more streams than ``max_concurrent_streams`` (advertised in our
  SETTINGS): RST_STREAM REFUSED_STREAM (RFC 9113 §5.1.2), the client may retry it.
- a header block (HEADERS + CONTINUATION) longer than ``max_header_list_size`` (advertised as
  SETTINGS_MAX_HEADER_LIST_SIZE), or one that decodes to a larger header list: GOAWAY
  ENHANCE_YOUR_CALM. Not a stream error: HPACK state is per connection and a block must be
  decoded whole to keep it (RFC 9113 §4.3), which means holding the whole block, exactly
  what the limit is there to stop; RFC 9113 §10.5.1 lets the receiver close the connection.
- more than ``max_control_frames`` control frames within ``control_frame_window_s`` (PING,
  SETTINGS, PRIORITY, RST_STREAM, CONTINUATION, empty DATA, unknown frame types, HEADERS on a
  closed stream, WINDOW_UPDATE while no stream is open, streams refused for exceeding the
  stream limit): GOAWAY ENHANCE_YOUR_CALM (the 2019 ping/settings/reset/empty-frame flood
  CVEs, CVE-2019-9512..9518).
- streams reset by the client before they were answered, net of the ones answered
  (``reset_budget``): GOAWAY ENHANCE_YOUR_CALM ("rapid reset", CVE-2023-44487).
- PINGs from a client faster than grpc core's ping policy allows (Triton's
  `--grpc-http2-min-recv-ping-interval-without-data` and `--grpc-http2-max-ping-strikes`):
  GOAWAY ENHANCE_YOUR_CALM with debug data "too_many_pings", as grpc core sends it (grpc
  clients back their keepalive off when they see it).
- a client that does not read what we write: once ``write_buffer_high`` bytes wait in the
  transport the connection stops reading (PING and SETTINGS acks, RST_STREAMs and responses
  included) until they drain below ``write_buffer_low``; a connection that cannot write for
  ``send_timeout_s`` is cut.
- a client that does not read its answers, whose flow-control windows therefore stay
  closed: answers waiting for its credit are bounded per stream
  (``max_pending_stream_bytes``) and per connection (``max_pending_connection_bytes``). At
  its bound a stream, or every stream of the connection, takes no new request (its messages
  wait, its receive window is not re-opened, so the client can send at most
  ``recv_window`` more) until the client reads; a stream that waits for credit longer than
  ``send_timeout_s`` is reset (CANCEL) and what it held is freed.
- timeouts: the client preface and first SETTINGS within ``handshake_timeout_s``; a
  connection without an open stream for ``idle_timeout_s`` gets GOAWAY NO_ERROR and is
  closed (a gRPC client reconnects on its next call); keepalive PINGs every
  ``keepalive_time_ms`` with an answer due within ``keepalive_timeout_ms``; a connection
  closing with unwritten bytes is cut after ``close_linger_s``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from services.common.flags import parse_bool

__all__ = ["INT32_MAX", "GrpcLimits", "add_grpc_limit_args", "grpc_limits_from_args"]

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class GrpcLimits:
    # -- messages -------------------------------------------------------------------------------
    max_message_size: int = INT32_MAX
    """Largest request message accepted, in bytes, on the wire and after decompression.
    Triton: MAX_GRPC_MESSAGE_SIZE = INT32_MAX (src/common.h), set with SetMaxMessageSize."""

    # -- HTTP/2 ---------------------------------------------------------------------------------
    max_concurrent_streams: int = 100
    """SETTINGS_MAX_CONCURRENT_STREAMS, advertised and enforced. 100: h2o
    (H2O_HTTP2_SETTINGS_HOST), hyper-h2's local default and RFC 9113 §6.5.2's recommended
    minimum; nginx uses 128; grpc core (Triton) sets none. gRPC clients queue calls beyond it."""
    max_header_list_size: int = 16 << 10
    """SETTINGS_MAX_HEADER_LIST_SIZE, advertised and enforced on the encoded block and on the
    decoded list (RFC 9113 §6.5.2 size: name + value + 32 per field). 16 KiB: grpc core's hard
    metadata limit (GRPC_ARG_ABSOLUTE_MAX_METADATA_SIZE, DEFAULT_MAX_HEADER_LIST_SIZE), which is
    what Triton advertises and enforces; nginx allows 32 KiB (large_client_header_buffers 4 8k),
    hyper-h2 64 KiB."""
    max_control_frames: int = 1000
    control_frame_window_s: float = 1.0
    """At most ``max_control_frames`` control frames per window. Jetty counts the same frames
    (WindowRateControl, 128 per second by default); netty allows 200 RST_STREAMs per 30 s.
    1,000 per second leaves room for gRPC clients' cancel storms (deadlines expiring under
    load) while a flood is cut within a second."""
    reset_budget_per_stream: int = 2
    """Rapid reset: the budget starts at this times ``max_concurrent_streams``, each stream
    the client resets before it is answered spends one, each answered stream earns one back
    (up to the start), and so does time: the whole budget each second. Empty: GOAWAY
    ENHANCE_YOUR_CALM. h2o's reset budget (a connection that resets more than half its
    streams runs out); Envoy closes at 50% premature resets too; 2 × max_concurrent_streams
    is nginx's figure for new streams per read. The refill over time is for clients whose
    deadlines expire in waves (each expired call is a reset): a few hundred a second per
    connection is what a deadline storm makes, a reset flood makes tens of thousands."""
    write_buffer_high: int = 1 << 20
    write_buffer_low: int = 256 << 10
    """Stop reading while more than ``write_buffer_high`` bytes of our output wait in the
    transport; read again below ``write_buffer_low``. grpc core stops reading at 10,000 pending
    induced frames (DEFAULT_MAX_PENDING_INDUCED_FRAMES, ~170 KB of PING acks), nghttp2 at
    10,000 queued frames (NGHTTP2_MAX_OBQ_FLOOD_ITEM); a byte limit also covers responses.
    1 MiB is a few round trips of a fast client, so well-behaved traffic is never paused
    for long."""
    send_timeout_s: float = 60.0
    """A connection whose output stays above the high-water mark this long is cut, and a
    stream whose answer waits this long for the client's flow-control credit is reset:
    nginx's send_timeout (60 s). 0: never."""
    max_pending_stream_bytes: int = 32 << 20
    max_pending_connection_bytes: int = 128 << 20
    """Answers waiting for a client's flow-control credit: at this many bytes on a stream
    (or on all the streams of a connection) it takes no new request until the client reads,
    and a new request starts only while the answers of those running, at the largest size
    seen, fit too. Eight 4 MiB answers a stream, 32 a connection: a client that reads is
    never held back by them (it keeps them near zero), one that does not costs at most this
    much plus the answers of the requests running when it stopped. (grpc core and Triton
    have no such bound: they queue every answer.)"""
    recv_window: int = 16 << 20
    """Our flow-control window for request bytes, per stream and per connection, re-opened
    when half is used unless the stream or connection is at a pending-answer bound: what a
    client can still send to a connection that takes no new request. 16 MiB re-opened every
    8 MiB costs a large request one WINDOW_UPDATE round trip per 8 MiB (microseconds on a
    LAN), never a stall."""
    handshake_timeout_s: float = 10.0
    """Client preface and first SETTINGS due within this long after accept. h2o closes a
    connection that sends nothing for http2-idle-timeout (10 s); grpc core waits 120 s
    (GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS), but for a TLS handshake too."""
    idle_timeout_s: float = 180.0
    """A connection with no open stream for this long gets GOAWAY NO_ERROR and is closed:
    nginx's http2_idle_timeout (3 minutes). grpc core (Triton) has none by default
    (GRPC_ARG_MAX_CONNECTION_IDLE_MS); gRPC clients reconnect on their next call. 0: none."""
    close_linger_s: float = 5.0
    """A connection we close with bytes still unwritten is cut after this long: nginx's
    lingering_timeout (5 s)."""

    # -- gRPC keepalive: Triton's flags, units and defaults (KeepAliveOptions) -------------------
    keepalive_time_ms: int = 7_200_000
    """--grpc-keepalive-time: send a PING after this long (2 hours) ... 0: never."""
    keepalive_timeout_ms: int = 20_000
    """--grpc-keepalive-timeout: ... and close the connection if it is not answered in 20 s."""
    keepalive_permit_without_calls: bool = False
    """--grpc-keepalive-permit-without-calls: send keepalive PINGs, and accept the client's
    at the data interval, also when no call is open (else a client may PING an idle
    connection only every 2 hours, grpc core's TCP-keepalive-like rule)."""
    max_pings_without_data: int = 2
    """--grpc-http2-max-pings-without-data: keepalive PINGs we send between two of our
    HEADERS/DATA frames (0: no limit)."""
    min_recv_ping_interval_without_data_ms: int = 300_000
    """--grpc-http2-min-recv-ping-interval-without-data: a client PING sooner than this after
    the previous one, while we send no HEADERS/DATA, is a ping strike (5 minutes)."""
    max_ping_strikes: int = 2
    """--grpc-http2-max-ping-strikes: more strikes than this get GOAWAY ENHANCE_YOUR_CALM
    "too_many_pings" (0: any number of PINGs)."""
    max_connection_age_ms: int = 0
    """--grpc-max-connection-age: GOAWAY NO_ERROR after this long (0: never, Triton's
    "undefined")."""
    max_connection_age_grace_ms: int = 0
    """--grpc-max-connection-age-grace: then close after this long (0: wait for the calls)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if value < 0:
                raise ValueError(f"{f.name} must not be negative, got {value}")
        if not 0 <= self.max_message_size <= 2**32 - 1:   # the 5-byte prefix holds 32 bits
            raise ValueError(f"max_message_size must be at most {2**32 - 1}")
        if not 1 <= self.max_concurrent_streams <= INT32_MAX:
            raise ValueError("max_concurrent_streams must be between 1 and 2147483647")
        if not 1024 <= self.max_header_list_size <= INT32_MAX:
            raise ValueError("max_header_list_size must be between 1024 and 2147483647")
        if self.max_control_frames < 1:
            raise ValueError("max_control_frames must be at least 1")
        if self.recv_window < 65_535:   # RFC 9113's initial window; at most MAX_WINDOW
            raise ValueError("recv_window must be at least 65535")
        if self.recv_window > INT32_MAX:
            raise ValueError("recv_window must be at most 2147483647")
        if self.write_buffer_low > self.write_buffer_high:
            raise ValueError("write_buffer_low must not exceed write_buffer_high")

    @property
    def reset_budget(self) -> int:
        return self.reset_budget_per_stream * self.max_concurrent_streams


# ---- flags ----------------------------------------------------------------------------------


def _count(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{v}'") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {n}")
    return n


def _seconds(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got '{v}'") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {v}")
    return x


# (flag, field, type, help). Triton's flags first, with Triton's wording of their meaning.
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--grpc-keepalive-time", "keepalive_time_ms", _count,
     "period (ms) after which a keepalive ping is sent on the transport (Triton's default "
     "7200000, 0: never)"),
    ("--grpc-keepalive-timeout", "keepalive_timeout_ms", _count,
     "period (ms) the sender of the keepalive ping waits for an acknowledgement before closing "
     "the connection (20000)"),
    ("--grpc-keepalive-permit-without-calls", "keepalive_permit_without_calls", parse_bool,
     "allow keepalive pings even when there are no calls in flight (false)"),
    ("--grpc-http2-max-pings-without-data", "max_pings_without_data", _count,
     "most pings sent while there is no data/header frame to send (2, 0: no limit)"),
    ("--grpc-http2-min-recv-ping-interval-without-data", "min_recv_ping_interval_without_data_ms",
     _count, "minimum time (ms) expected between successive pings while no data/header frame "
             "is sent; a quicker ping is a ping strike (300000)"),
    ("--grpc-http2-max-ping-strikes", "max_ping_strikes", _count,
     "bad pings tolerated before GOAWAY ENHANCE_YOUR_CALM and close (2, 0: any number)"),
    ("--grpc-max-connection-age", "max_connection_age_ms", _count,
     "maximum time (ms) a connection may exist before GOAWAY (0: no limit)"),
    ("--grpc-max-connection-age-grace", "max_connection_age_grace_ms", _count,
     "grace period (ms) after the max age before the connection is closed (0: wait for the "
     "calls)"),
    ("--grpc-max-message-size", "max_message_size", _count,
     "largest gRPC request message accepted, in bytes, as sent and once decompressed "
     "(2147483647, Triton's limit); larger ones get RESOURCE_EXHAUSTED"),
    ("--grpc-http2-max-concurrent-streams", "max_concurrent_streams", _count,
     "HTTP/2 streams (calls) open at once per connection; more are refused (100)"),
    ("--grpc-http2-max-header-list-size", "max_header_list_size", _count,
     "largest request header block (metadata), in bytes; larger closes the connection "
     "(16384, grpc core's limit)"),
    ("--grpc-http2-max-control-frames", "max_control_frames", _count,
     "control frames (PING, SETTINGS, RST_STREAM, PRIORITY, ...) accepted per second and "
     "connection before GOAWAY ENHANCE_YOUR_CALM (1000)"),
    ("--grpc-handshake-timeout-secs", "handshake_timeout_s", _seconds,
     "seconds a new connection has to send the HTTP/2 preface and SETTINGS (10, 0: no limit)"),
    ("--grpc-max-pending-stream-bytes", "max_pending_stream_bytes", _count,
     "bytes of answers a stream may hold waiting for a client that does not read; at the "
     "bound it takes no new request until the client reads (33554432)"),
    ("--grpc-max-pending-connection-bytes", "max_pending_connection_bytes", _count,
     "the same bound for all the streams of a connection (134217728)"),
    ("--grpc-send-timeout-secs", "send_timeout_s", _seconds,
     "seconds an answer may wait for a client that does not read before its stream is "
     "reset, or its connection cut (60, 0: never)"),
    ("--grpc-idle-timeout-secs", "idle_timeout_s", _seconds,
     "seconds a connection may stay without an open call before it is closed (180, 0: "
     "never)"),
]


def add_grpc_limit_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The gRPC limit flags (see _FLAGS), defaults from GrpcLimits; returns the actions."""
    defaults = GrpcLimits()
    return [p.add_argument(flag, type=kind, default=getattr(defaults, name), help=text,
                           dest=f"grpc_limit_{name}")
            for flag, name, kind, text in _FLAGS]


def grpc_limits_from_args(args: argparse.Namespace) -> GrpcLimits:
    """GrpcLimits from flags added by add_grpc_limit_args (defaults where absent)."""
    given = {name: getattr(args, f"grpc_limit_{name}") for _, name, _, _ in _FLAGS
             if hasattr(args, f"grpc_limit_{name}")}
    return GrpcLimits(**given)
