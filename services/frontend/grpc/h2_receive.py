"""The receiving side of the native HTTP/2 connection: an H2Receiver is owned by its
H2Connection (grpc/h2.py), one each, and is the connection's ``data_received``. Bytes in,
frames parsed off them (a large DATA frame's payload passes through to its stream in pieces,
never gathered first), and the handler of each frame type on the receiving side: DATA into
our receive windows (the credit given back to the client, held back at the bounds: ``hold``
and ``taken``), HEADERS/CONTINUATION with HPACK decoding (cached per header block while the
dynamic table stands still), RST_STREAM, PRIORITY, GOAWAY. WINDOW_UPDATE and SETTINGS, which
govern our sending, go to the connection; PING and the limits' accounting to its guards
(grpc/h2_guards.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from hpack import Decoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from services.frontend.grpc.h2_frames import (
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RECV_MAX_FRAME,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    _ConnectionError,
    _Stream,
    frame_header,
)
from services.frontend.grpc.limits import GrpcLimits

if TYPE_CHECKING:
    from services.frontend.grpc.h2 import H2Connection
    from services.frontend.grpc.h2_guards import H2Guards

HEADER_CACHE_MAX_BLOCK = 1024        # header blocks cached by _decode_headers: at most this long


class H2Receiver:
    """Frames in, for one H2Connection. Reads and changes the connection's streams (the
    same dict); calls the connection's ``accept`` for a new stream, its ``on_window_update``
    and ``on_settings`` for those frames, ``emit`` for the credit it gives back, and the
    guards' ``control`` and ``on_ping``; a connection error raised while parsing becomes the
    connection's ``fail``. Lets go of the connection when it is closed (it holds this
    object)."""

    __slots__ = (
        "_accept", "_backlog", "_buf", "_conn", "_control", "_data_end", "_data_left",
        "_data_sid", "_decoder", "_emit", "_guards", "_hcache", "_header_block",
        "_headers_flags", "_headers_sid", "_htable_state", "_limits", "_max_header_block",
        "_need", "_on_ping", "_on_settings", "_on_window_update", "_recv_consumed", "_refill",
        "_stopped", "_streams", "last_stream", "preface", "withheld",
    )

    def __init__(self, conn: H2Connection, guards: H2Guards, streams: dict[int, _Stream],
                 limits: GrpcLimits) -> None:
        self._conn = conn
        self._guards = guards
        self._streams = streams               # the connection's open streams (the same dict)
        self._limits = limits
        # the calls that cross to the connection and its guards per frame, bound once
        self._emit = conn.emit
        self._accept = conn.accept
        self._on_window_update = conn.on_window_update
        self._on_settings = conn.on_settings
        self._control = guards.control
        self._on_ping = guards.on_ping
        self._max_header_block = limits.max_header_list_size
        self._stopped = False                 # the connection failed: read nothing more
        self._buf = bytearray()
        self._need = len(PREFACE)
        self.preface = False                  # the client's preface came
        self._decoder = Decoder()
        self._decoder.max_header_list_size = limits.max_header_list_size
        self.last_stream = 0                  # highest stream id the client has used
        self._headers_sid = 0                 # a header block is being continued
        self._headers_flags = 0
        self._header_block = bytearray()
        self._recv_consumed = 0
        self._refill = limits.recv_window // 2   # re-open a receive window when half is used
        self.withheld = False                     # some credit was held back at a bound
        self._backlog = 0                     # request bytes received, not yet taken (hold())
        self._data_left = 0                   # payload bytes still to come of a large DATA frame
        self._data_sid = 0
        self._data_end = False
        self._hcache: dict[bytes, list] = {}  # header block -> headers, see _decode_headers
        self._htable_state: Any = None

    def stop(self) -> None:
        """The connection failed: what the peer still sends is read and dropped (its
        lingering close)."""
        self._stopped = True

    def close(self) -> None:
        """The connection is lost: no credit is owed any more, and the connection is let go
        (kept, the cycle would wait for the cyclic GC, which an idle frontend hardly runs).
        ``hold`` and ``taken`` may still come, from calls ending: they count, nothing more."""
        self.withheld = False
        del self._conn, self._emit, self._accept, self._on_window_update, self._on_settings

    def data_received(self, data: bytes | memoryview) -> None:
        if self._stopped:
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
            self._conn.fail(e.code, str(e), e.debug)
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
        if not self.preface:
            if data[:24] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 client preface")
            self.preface = True
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
                if ftype != DATA:   # refuse it before buffering it
                    self._guards.check_declared(ftype, length, len(self._header_block))
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

    # -- DATA and the receive windows -------------------------------------------------------
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
        until it reads, or they are taken (the connection's _sent, and taken, call
        return_credit)."""
        refill = self._refill
        self._recv_consumed += size
        held = None                            # _conn_held(), read when a window is due
        if self._recv_consumed >= refill:
            held = self._conn_held()
            if held:
                self.withheld = True
            else:
                self._emit(frame_header(4, WINDOW_UPDATE, 0, 0)
                           + self._recv_consumed.to_bytes(4, "big"))
                self._recv_consumed = 0
        st = self._streams.get(sid)
        if st is not None:
            st.recv_consumed += size
            if st.recv_consumed >= refill:
                if held is None:
                    held = self._conn_held()
                if held or st.backlog >= refill or \
                        st.queued >= self._limits.max_pending_stream_bytes:
                    self.withheld = True
                else:
                    self._emit(frame_header(4, WINDOW_UPDATE, 0, sid)
                               + st.recv_consumed.to_bytes(4, "big"))
                    st.recv_consumed = 0
        elif not sid or sid > self.last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        return st

    def _conn_held(self) -> bool:
        """The connection holds as many answers for the client, or requests for their
        handlers, as it may: no credit goes back to the client."""
        bound = self._limits.max_pending_connection_bytes
        return self._conn.queued_bytes >= bound or self._backlog >= bound

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

    def return_credit(self) -> None:
        """The credit held back at a bound, for the connection and each stream below its own."""
        if self._conn_held():
            return
        limits = self._limits
        refill = self._refill
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
        self.withheld = owed

    def hold(self, sid: int, n: int) -> None:
        """``n`` bytes of complete request messages of stream ``sid`` wait for their handler:
        while half a receive window of them waits on a stream, or the pending-answer bound
        of them on the connection, the client's credit is held back (_credit), so a client
        cannot send faster than its requests are taken."""
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
        if self.withheld:                 # some credit waits for this
            self.return_credit()

    # -- header blocks ----------------------------------------------------------------------
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
        if sid <= self.last_stream:
            self._control("HEADERS on a closed stream")
            return                            # a late frame for a stream we already closed
        self.last_stream = sid
        st = self._accept(sid, headers)       # (None: refused)
        if st is not None and flags & END_STREAM:
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

    # -- the other frames of the receiving side ---------------------------------------------
    def _on_reset(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"RST_STREAM of {len(payload)} bytes")
        if not sid or sid > self.last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        self._control("RST_STREAM")
        conn = self._conn
        if conn.drop_stream(sid) is not None:
            self._guards.stream_reset()       # before we answered it: spends the budget
        conn.maybe_close()

    def _on_priority(self, sid: int, payload: memoryview) -> None:
        if not sid:
            raise _ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
        self._control("PRIORITY")
        if len(payload) != 5:
            self._conn.stream_error(sid, FRAME_SIZE_ERROR)   # RFC 9113 §6.3: a stream error

    def _on_goaway(self, sid: int, payload: memoryview) -> None:
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, f"GOAWAY of {len(payload)} bytes")
        self._control("GOAWAY")
        self._conn.peer_goaway()
