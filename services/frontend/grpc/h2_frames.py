"""HTTP/2's wire format as the native gRPC server speaks it (RFC 9113, HPACK RFC 7541): frame
types, flags, error codes and settings identifiers; our receive sizes; frame headers, HPACK
literal header blocks and the SETTINGS preamble we open a connection with. And the two small
types every layer of the connection (grpc/h2.py) shares: a stream's record and the error that
closes a connection."""
from __future__ import annotations

import functools
from collections import deque
from typing import Any

from services.frontend.grpc.limits import GrpcLimits

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
# What we accept: big frames mean fewer parser iterations for large tensors. Our receive
# windows are GrpcLimits.recv_window, re-opened when half is used.
RECV_MAX_FRAME = 1 << 20


@functools.lru_cache(maxsize=16)
def _preamble(limits: GrpcLimits) -> bytes:
    """Our SETTINGS frame and the connection WINDOW_UPDATE that follows it."""
    settings = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in (
        (S_ENABLE_PUSH, 0), (S_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
        (S_INITIAL_WINDOW_SIZE, limits.recv_window), (S_MAX_FRAME_SIZE, RECV_MAX_FRAME),
        (S_MAX_HEADER_LIST_SIZE, limits.max_header_list_size)))
    grow = limits.recv_window - DEFAULT_WINDOW      # (a WINDOW_UPDATE of 0 is an error)
    return (frame_header(len(settings), SETTINGS, 0, 0) + settings
            + (frame_header(4, WINDOW_UPDATE, 0, 0) + grow.to_bytes(4, "big") if grow else b""))


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
    __slots__ = ("app", "backlog", "closed_local", "pending", "queued", "recv_consumed",
                 "send_window", "stalled")

    def __init__(self, send_window: int) -> None:
        self.app: Any = None
        self.send_window = send_window
        # Frames waiting for flow-control credit: ("d", memoryview, end) / ("h", block, end).
        self.pending: deque = deque()
        self.queued = 0                 # DATA bytes in pending
        self.stalled = 0.0              # since when pending waits for credit (0: it does not)
        self.recv_consumed = 0
        self.backlog = 0                # request bytes received, not yet taken by the app
        self.closed_local = False


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str, debug: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.debug = debug
