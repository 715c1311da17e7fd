"""Every limit of the native HTTP/1.1 server (http/engine.py, http/connection.py), its
default and where the figure comes from (beside each constant below). The timeouts and the
connection cap have flags (--http-header-timeout-secs, --http-body-timeout-secs,
--http-idle-timeout-secs, --http-max-connections), read by NativeHttpServer from
FrontendSettings; the rest are fixed.

Limits (docs/security.md), each with a counter in ``NativeHttpServer.counters``:
- connections: past ``max_connections`` open ones, a new connection is answered 503 and
  closed at once (the client learns why; nothing of it is read or kept).
- header timeout: a request head (request line and headers) must be complete within
  ``header_timeout`` seconds of its first byte, a new connection's first head within that
  time of the connection; else 408 and close (nginx's client_header_timeout).
- body timeout: a body must be complete within ``body_timeout`` seconds of its head, plus
  one second per BODY_MIN_RATE bytes it has brought, so any body arriving at least that
  fast is never cut while a trickle of a byte a second is; else 408 and close. (A body
  answered before it arrived, refused as too large say, is dropped as it comes, and its
  connection closes at ``body_timeout`` if the body is still coming.)
- idle timeout: a keep-alive connection with nothing to do closes after ``idle_timeout``;
  so does one whose client reads none of our answer for that long (a write stall).
- chunked bodies: more than MAX_CHUNKS chunks is Triton's 400, and reading stops.
Time is kept by one timer for all connections, which looks at each connection a few
times per timeout (NativeHttpServer._check_idle calls each Connection.tick): nothing is
timed per request or per read.
"""
from __future__ import annotations

__all__ = ["BODY_MIN_RATE", "BODY_TIMEOUT", "COUNTERS", "HEADER_TIMEOUT", "IDLE_CHECKS",
           "IDLE_TIMEOUT", "MAX_CONNECTIONS", "MAX_HEAD", "MAX_HEAD_READ", "MAX_QUEUED",
           "MAX_QUEUED_BYTES"]

MAX_HEAD = 64 * 1024           # request line + headers; more is refused as malformed
MAX_HEAD_READ = 1 << 20        # bytes read while a head stays incomplete (httptools gathers
                               # a header's pieces before it calls on_header)
MAX_QUEUED = 32                # pipelined requests waiting behind the one being answered
MAX_QUEUED_BYTES = 1 << 20     # ... and their bodies, before reading pauses
IDLE_TIMEOUT = 75.0            # an idle keep-alive connection closes after this (as aiohttp)
HEADER_TIMEOUT = 60.0          # a request head must arrive within this (nginx's default)
BODY_TIMEOUT = 60.0            # a body must arrive within this, plus 1 s per BODY_MIN_RATE
BODY_MIN_RATE = 64 * 1024      # bytes: a body at least this fast per second is never cut
MAX_CONNECTIONS = 1024         # open connections per frontend (nginx's worker_connections)
IDLE_CHECKS = 5                # each timeout is checked this many times over its length
COUNTERS = ("connections_refused", "header_timeouts", "body_timeouts", "write_stalls",
            "chunk_floods", "malformed")
