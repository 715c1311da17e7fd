"""The receiving side of the native HTTP/2 connection, a layer of H2Connection (grpc/h2.py) not
used alone: bytes in, frames parsed off them (a large DATA frame's payload passes through to
its stream in pieces, never gathered first), and the handler of each frame type: DATA into our
receive windows, HEADERS/CONTINUATION with HPACK decoding (cached per header block while the
dynamic table stands still), WINDOW_UPDATE and SETTINGS for the sending side, RST_STREAM,
PRIORITY, GOAWAY. PING and the limits' accounting are the guards' (grpc/h2_guards.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from hpack import Decoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from services.frontend.grpc.h2_frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECV_MAX_FRAME,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    SETTINGS,
    WINDOW_UPDATE,
    _ConnectionError,
    _Stream,
    frame_header,
)
from services.frontend.grpc.h2_guards import H2Guards
from services.frontend.grpc.limits import GrpcLimits

HEADER_CACHE_MAX_BLOCK = 1024        # header blocks cached by _decode_headers: at most this long


class H2Receiver(H2Guards):
    """Frames in: parsing and the per-type handlers of an H2Connection."""

    __slots__ = (
        "_buf", "_data_end", "_data_left", "_data_sid", "_decoder", "_goaway_sent", "_hcache",
        "_header_block", "_headers_flags", "_headers_sid", "_htable_state", "_initial_window",
        "_last_opened", "_last_stream", "_max_frame", "_need", "_preface", "_recv_consumed",
        "_refill", "_send_window", "_settings_seen", "_withheld",
    )

    if TYPE_CHECKING:   # the connection's own state and methods (grpc/h2.py)
        _open_stream: Callable[[Any, int, list], Any]
        _blocked: set[int]
        _failed: bool
        idle: asyncio.Event

        def _drain(self, sid: int) -> None: ...
        def _dropped(self, st: _Stream) -> None: ...
        def _emit_reset(self, sid: int, code: int) -> None: ...
        def _maybe_close(self) -> None: ...
        _queued: int
        _backlog: int

    def __init__(self, limits: GrpcLimits) -> None:
        super().__init__(limits)
        self._buf = bytearray()
        self._need = len(PREFACE)
        self._preface = False
        self._settings_seen = False           # the client's first SETTINGS (handshake done)
        self._decoder = Decoder()
        self._decoder.max_header_list_size = limits.max_header_list_size
        self._last_stream = 0                 # highest stream id the client has used
        self._last_opened = 0                 # highest one handed to the application (GOAWAY)
        self._headers_sid = 0                 # a header block is being continued
        self._headers_flags = 0
        self._header_block = bytearray()
        self._send_window = DEFAULT_WINDOW    # connection-level credit from the peer
        self._initial_window = DEFAULT_WINDOW
        self._max_frame = 16_384              # the peer's SETTINGS_MAX_FRAME_SIZE
        self._recv_consumed = 0
        self._refill = limits.recv_window // 2   # re-open a receive window when half is used
        self._withheld = False                    # some credit was held back at a bound
        self._data_left = 0                   # payload bytes still to come of a large DATA frame
        self._data_sid = 0
        self._data_end = False
        self._hcache: dict[bytes, list] = {}  # header block -> headers, see _decode_headers
        self._htable_state: Any = None
        self._goaway_sent = False

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
            if ftype == DATA:
                self._check_window(sid, length)
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
        """Account for received DATA bytes; re-open the windows when half is used, unless
        the connection (or the stream) holds as many answers for the client as it may, or
        half a window of requests waits for its handlers: then the client's credit waits
        until it reads, or they are taken (h2.py _sent and taken call _return_credit)."""
        limits = self._limits
        refill = self._refill
        self._recv_consumed += size
        conn_held = self._queued >= limits.max_pending_connection_bytes or \
            self._backlog >= limits.max_pending_connection_bytes
        if self._recv_consumed >= refill:
            if conn_held:
                self._withheld = True
            else:
                self._emit(frame_header(4, WINDOW_UPDATE, 0, 0)
                           + self._recv_consumed.to_bytes(4, "big"))
                self._recv_consumed = 0
        st = self._streams.get(sid)
        if st is not None:
            st.recv_consumed += size
            if st.recv_consumed >= refill:
                if conn_held or st.backlog >= refill or \
                        st.queued >= limits.max_pending_stream_bytes:
                    self._withheld = True
                else:
                    self._emit(frame_header(4, WINDOW_UPDATE, 0, sid)
                               + st.recv_consumed.to_bytes(4, "big"))
                    st.recv_consumed = 0
        elif not sid or sid > self._last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        return st

    def _check_window(self, sid: int, length: int) -> None:
        """A DATA frame, checked from its header against the credit we gave (RFC 9113
        §6.9.1): our windows bound what a client can make us hold, so a peer that ignores
        them is cut."""
        window = self._limits.recv_window
        if self._recv_consumed + length > window:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        st = self._streams.get(sid)
        if st is not None and st.recv_consumed + length > window:
            raise _ConnectionError(FLOW_CONTROL_ERROR, f"DATA beyond the window of stream {sid}")

    def _return_credit(self) -> None:
        """The credit held back at a bound, for the connection and each stream below its own."""
        limits = self._limits
        refill = self._refill
        if self._queued >= limits.max_pending_connection_bytes or \
                self._backlog >= limits.max_pending_connection_bytes:
            return
        owed = False
        if self._recv_consumed >= refill:
            self._emit(frame_header(4, WINDOW_UPDATE, 0, 0) + self._recv_consumed.to_bytes(4, "big"))
            self._recv_consumed = 0
        for sid, st in self._streams.items():
            if st.recv_consumed >= refill:
                if st.backlog < refill and st.queued < limits.max_pending_stream_bytes:
                    self._emit(frame_header(4, WINDOW_UPDATE, 0, sid)
                               + st.recv_consumed.to_bytes(4, "big"))
                    st.recv_consumed = 0
                else:
                    owed = True
        self._withheld = owed

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

    def _on_reset(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"RST_STREAM of {len(payload)} bytes")
        if not sid or sid > self._last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        self._control("RST_STREAM")
        st = self._streams.pop(sid, None)
        self._blocked.discard(sid)
        if st is not None:
            self._dropped(st)
            if st.app is not None:
                st.app.reset()
            # Reset before we answered it: rapid reset (CVE-2023-44487) spends the budget,
            # which time refills (the whole of it each second).
            now = self._loop.time()
            budget = self._reset_budget_max
            self._reset_budget = min(budget, self._reset_budget
                                     + (now - self._reset_since) * budget) - 1
            self._reset_since = now
            if self._reset_budget < 1:          # (the refill of a burst is a fraction)
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
        if st is not None:
            self._dropped(st)
            if st.app is not None:
                st.app.reset()
        self._emit_reset(sid, code)
        self._maybe_close()
