"""gRPC over our own HTTP/2 connection (grpc/h2.py), on the frontend's event loop.

Serves the same method table as the grpc.aio adapter (methods.rpc_methods): unary and
bidirectional-streaming calls, length-prefixed messages, gzip/deflate request compression,
status and message in trailers (percent-encoded, as the gRPC HTTP/2 spec says). Responses are
never compressed, which every gRPC client accepts. Deadlines (grpc-timeout) are the client's
to enforce: when one expires the client resets the stream and the call is cancelled here.

A request message larger than the limit (``GrpcLimits.max_message_size``, --grpc-max-message-size)
is refused from its length prefix, and its buffer grows with the bytes that arrive, never
with the size the prefix declares; a compressed one is inflated only up to the limit.

Backpressure: what the server holds for a client that does not read is bounded
(GrpcLimits.max_pending_*_bytes). A streaming call hands its next request to its handler,
and its handler's next answer goes out, only while its stream and connection are below
their bounds (H2Connection.writable). A unary call starts only when the connection has room
for its request and one more answer of the largest size it has sent (_Gate): a call's
answer exists only once it has run, so the room is kept for the calls already running.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import zlib
from collections import deque
from collections.abc import Mapping
from ssl import SSLContext
from typing import Any

from services.common.errors import Code, PortTaken, TriremeError
from services.frontend.grpc.h2 import H2Connection, TlsH2Connection
from services.frontend.grpc.h2_frames import encode_literal_headers
from services.frontend.grpc.limits import GrpcLimits
from services.frontend.listen import BACKLOG, where

log = logging.getLogger(__name__)

__all__ = ["NativeGrpcServer", "RpcAbort"]

OK, UNKNOWN, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 2, 3, 8, 12, 13
# A request our decoder refuses (grpc/codec.py MalformedMessage): INVALID_ARGUMENT with its
# text, where grpc core would answer INTERNAL "Exception deserializing request!".
_DECODE_STATUS = {Code.INVALID_ARG: INVALID_ARGUMENT}

RESPONSE_HEADERS = encode_literal_headers([
    (b":status", b"200"), (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip")])
OK_TRAILERS = encode_literal_headers([(b"grpc-status", b"0")])
UNSUPPORTED_MEDIA = encode_literal_headers([(b":status", b"415")])


class RpcAbort(Exception):
    """Ends a call with a gRPC status (raised by ``_Context.abort``)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """The part of grpc.aio.ServicerContext that the handlers use."""
    __slots__ = ()

    async def abort(self, code: Any, details: str = "") -> None:
        raise RpcAbort(code.value[0] if hasattr(code, "value") else int(code), details)


CONTEXT = _Context()

# Request metadata handed to handlers: the W3C trace context only (tracing propagates it),
# or every header but the pseudo ones with ``all_metadata`` (--grpc-header-forward-pattern);
# a call without any shares CONTEXT, so the common path allocates nothing.
_TRACE_HEADERS = frozenset((b"traceparent", b"tracestate"))


class _MetaContext(_Context):
    __slots__ = ("_metadata",)

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def _percent_encode(text: str) -> bytes:
    raw = text.encode("utf-8")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
                    for b in raw)


def _status_block(code: int, details: str, headers_sent: bool) -> bytes:
    trailers = [(b"grpc-status", str(code).encode())]
    if details:
        trailers.append((b"grpc-message", _percent_encode(details)))
    block = encode_literal_headers(trailers)
    return block if headers_sent else RESPONSE_HEADERS + block   # Trailers-Only


class _Gate:
    """When a connection's unary calls may start: while its answers waiting for the client,
    the requests of the calls running and of the new one, and one answer of the largest
    size sent so far for each of them, stay within max_pending_connection_bytes (until a
    first answer gives the size, answers count as nothing: a connection's first calls are
    held back only by their requests). One call may always run while fewer answers than the
    bound wait. A call that finds no room
    waits (its request bytes are bounded by the receive window, held shut at the bound)
    and starts, in order, when answers leave or calls end."""
    __slots__ = ("conn", "largest", "limit", "running", "running_bytes", "waiting", "_armed")

    def __init__(self, conn: H2Connection, limit: int) -> None:
        self.conn, self.limit = conn, limit
        self.running = 0
        self.running_bytes = 0           # request bytes of the calls running
        self.largest = 0                 # the largest answer sent on this connection
        self.waiting: deque[_Call] = deque()
        self._armed = False

    def admit(self, call: _Call) -> None:
        if self.waiting or not self._room(call.cost):
            call.held = call.cost            # its request now waits: it holds credit back
            self.conn.hold(call.sid, call.held)
            self.waiting.append(call)
            self._arm()
            return
        self._run(call)

    def finished(self, call: _Call) -> None:
        self.running -= 1
        self.running_bytes -= call.cost
        sent = call.sent
        if sent > self.largest:
            self.largest = sent
        elif not self.largest:
            self.largest = 1             # an answer without a message: small, and known now
        self._pump()

    def _room(self, cost: int) -> bool:
        queued = self.conn.queued_bytes
        if queued >= self.limit:
            return False
        return not self.running or (queued + self.running_bytes + cost
                                    + (self.running + 1) * self.largest <= self.limit)

    def _run(self, call: _Call) -> None:
        self.running += 1
        self.running_bytes += call.cost
        call.run_unary()

    def _pump(self) -> None:
        self._armed = False
        waiting = self.waiting
        while waiting and (waiting[0].failed or self._room(waiting[0].cost)):
            call = waiting.popleft()
            if not call.failed:          # (reset while it waited)
                self._run(call)
        if waiting:
            self._arm()

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            self.conn.when_drained(self._pump)


class _Call:
    """One RPC on one HTTP/2 stream: collects request messages, runs the handler, answers."""
    __slots__ = (
        "body",
        "conn",
        "context",
        "cost",
        "encoding",
        "failed",
        "flag",
        "gate",
        "head",
        "headers_sent",
        "held",
        "message",
        "method",
        "queue",
        "sent",
        "server",
        "sid",
        "size",
        "task",
    )

    def __init__(self, server: NativeGrpcServer, conn: H2Connection, sid: int, method: Any,
                 encoding: bytes, gate: _Gate, context: _Context = CONTEXT) -> None:
        self.server, self.conn, self.sid, self.method = server, conn, sid, method
        self.gate: _Gate | None = gate        # unary calls: set while admitted or waiting
        self.sent = 0                          # bytes of answer messages
        self.held = 0                          # bytes of requests not yet handed on
        self.cost = 0                          # a unary call's request bytes
        self.context = context
        self.encoding = encoding
        self.head = bytearray()               # a message prefix split between pieces
        self.body: bytearray | None = None    # a message being gathered, as long as received
        self.flag = self.size = 0             # ... its compressed flag and declared size
        self.message: Any = None              # a unary call's request
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.headers_sent = False
        self.failed = False
        if method.streaming:
            self.gate = None
            self.queue = asyncio.Queue()
            self._start(self._run(self._stream()))

    # -- from the connection ------------------------------------------------------------------
    def data(self, view: memoryview) -> None:
        """Split the stream's bytes into messages: a message inside one piece is passed on as
        a view (no copy); one spread over pieces is gathered into a buffer that grows with
        the pieces as they arrive (a prefix alone, whatever it declares, allocates nothing)."""
        if self.failed:
            return
        pos, n = 0, len(view)
        while pos < n:
            body = self.body
            if body is not None:               # filling a message that spans pieces
                take = min(n - pos, self.size - len(body))
                body += view[pos:pos + take]
                pos += take
                if len(body) == self.size:
                    self.body = None
                    self._received(self.flag, body)
                    if self.failed:
                        return
                continue
            if not self.head and n - pos >= 5:
                flag, size = view[pos], int.from_bytes(view[pos + 1:pos + 5], "big")
                pos += 5
            else:                              # a prefix split between pieces
                take = min(5 - len(self.head), n - pos)
                self.head += view[pos:pos + take]
                pos += take
                if len(self.head) < 5:
                    return
                flag, size = self.head[0], int.from_bytes(self.head[1:5], "big")
                self.head.clear()
            limit = self.server.max_message
            if size > limit:
                self._fail(RESOURCE_EXHAUSTED,
                           f"Received message larger than max ({size} vs. {limit})",
                           stop_sending=True)
                return
            if n - pos >= size:
                self._received(flag, view[pos:pos + size])
                pos += size
            else:                              # the start of a message: what arrived of it
                self.flag, self.size, self.body = flag, size, bytearray(view[pos:])
                return
            if self.failed:
                return

    def end(self) -> None:
        if self.failed:
            return
        if self.body is not None or self.head:
            self._fail(INTERNAL, "truncated gRPC message")
        elif self.queue is not None:
            self.queue.put_nowait(None)
        elif self.task is None:
            if self.message is None:
                self._fail(INTERNAL, "missing request message")
            elif self.gate is not None:
                self.gate.admit(self)

    def reset(self) -> None:
        if self.task is not None:
            self.task.cancel()
        elif self.queue is not None:
            self.queue.put_nowait(None)
        else:
            self.failed = True            # waiting at its gate: it never starts
            self.message = None
            self._take(self.held)

    def run_unary(self) -> None:
        """Admitted by the gate: run the handler on the request."""
        message, self.message = self.message, None
        self._take(self.held)
        self._start(self._run(self._unary(message)))

    def _take(self, n: int) -> None:
        if n:
            self.held -= n
            self.conn.taken(self.sid, n)

    # -- internals ------------------------------------------------------------------------------
    def _received(self, flag: int, payload: Any) -> None:
        if flag:
            try:
                payload = self._decompress(payload)
            except RpcAbort as e:
                self._fail(e.code, e.details, stop_sending=True)
                return
        if self.queue is not None:
            self.held += len(payload)
            self.conn.hold(self.sid, len(payload))
            self.queue.put_nowait(payload)
        elif self.message is None:
            self.message = payload
            self.cost = len(payload)
        else:
            self._fail(UNIMPLEMENTED, "more than one request message for a unary method",
                       stop_sending=True)

    def _decompress(self, payload: Any) -> bytes:
        """Inflate a compressed message, never beyond the message size limit: a small
        message that would inflate to more is refused once the limit is passed."""
        if self.encoding == b"gzip":
            inflater = zlib.decompressobj(31)
        elif self.encoding == b"deflate":
            inflater = zlib.decompressobj()
        else:
            raise RpcAbort(INTERNAL, "compressed message without a grpc-encoding")
        limit = self.server.max_message
        try:
            out = inflater.decompress(payload, limit + 1)
        except zlib.error as e:
            raise RpcAbort(INTERNAL, f"failed to decompress the request: {e}") from None
        if len(out) > limit:
            raise RpcAbort(RESOURCE_EXHAUSTED, "Received message larger than max "
                           f"(more than {limit} once decompressed vs. {limit})")
        if not inflater.eof:
            raise RpcAbort(INTERNAL, "failed to decompress the request: Error -5 while "
                           "decompressing data: incomplete or truncated stream")
        return out

    def _start(self, coro: Any) -> None:
        self.task = task = self.conn.loop.create_task(coro)
        self.server.calls.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        # A cancelled task keeps its CancelledError, whose traceback holds _run's frame and
        # so this call: with self.task still set, that cycle (and the request it holds) would
        # wait for the cyclic GC, which an idle frontend hardly runs (procutil.GC_THRESHOLDS).
        self.task = None
        self.failed = True            # the call is over: later frames are ignored
        self.server.calls.discard(task)
        self._take(self.held)         # requests it never took
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.finished(self)

    def _fail(self, code: int, details: str, stop_sending: bool = False) -> None:
        """End the call now, before or instead of its handler; later frames are ignored.
        ``stop_sending``: the client is still sending, ask it to stop (RST_STREAM NO_ERROR)."""
        self.failed = True
        self.body = None
        if self.task is not None:
            self.task.cancel()
        self.conn.send_trailers(self.sid, _status_block(code, details, self.headers_sent))
        if stop_sending:
            self.conn.reset_stream(self.sid, 0)

    def _send(self, body: Any) -> None:
        conn, sid = self.conn, self.sid
        if not self.headers_sent:
            self.headers_sent = True
            conn.send_headers(sid, RESPONSE_HEADERS)
        self.sent += len(body)
        prefix = b"\x00" + len(body).to_bytes(4, "big")   # uncompressed, length-prefixed
        if len(body) < 65_536:
            conn.send_data(sid, prefix + body)               # one frame for a small message
        else:
            conn.send_data(sid, prefix)                      # no copy of a large one
            conn.send_data(sid, body)

    def _finish(self, code: int, details: str) -> None:
        self.conn.send_trailers(self.sid, OK_TRAILERS if code == OK else
                                _status_block(code, details, self.headers_sent))

    async def _run(self, body: Any) -> None:
        """Await a call's work; every way it ends becomes the call's status."""
        try:
            await body
        except RpcAbort as e:
            self._finish(e.code, e.details)
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("unexpected error in gRPC handler")
            self._finish(UNKNOWN, f"Unexpected {type(e)}: {e}")
            return
        self._finish(OK, "")

    async def _unary(self, payload: Any) -> None:
        method = self.method
        try:
            request = method.deserialize(payload)
        except TriremeError as e:   # our decoders: a malformed message is the client's fault
            raise RpcAbort(_DECODE_STATUS.get(e.code, INTERNAL), e.message) from None
        except Exception:  # noqa: BLE001 - grpc's own answer to an undecodable request
            raise RpcAbort(INTERNAL, "Exception deserializing request!") from None
        response = await method.handler(request, self.context)
        self._send(method.serialize(response))

    async def _requests(self) -> Any:
        """The stream's requests, each handed on only while the stream may take one: its
        answers waiting for the client are below the bounds (backpressure)."""
        queue, deserialize = self.queue, self.method.deserialize
        conn, sid = self.conn, self.sid
        while (payload := await queue.get()) is not None:   # type: ignore[union-attr]
            self._take(len(payload))
            if not conn.writable(sid):
                await conn.wait_writable(sid)
            try:
                request = deserialize(payload)
            except TriremeError as e:
                raise RpcAbort(_DECODE_STATUS.get(e.code, INTERNAL), e.message) from None
            except Exception:  # noqa: BLE001
                raise RpcAbort(INTERNAL, "Exception deserializing request!") from None
            yield request

    async def _stream(self) -> None:
        conn, sid = self.conn, self.sid
        async for response in self.method.handler(self._requests(), self.context):
            self._send(self.method.serialize(response))
            if not conn.writable(sid):   # the client is not reading: neither do we
                await conn.wait_writable(sid)


class _Refused:
    """A stream answered at once (unknown method, wrong content type): ignore its body."""
    __slots__ = ()

    def data(self, view: memoryview) -> None:
        pass

    def end(self) -> None:
        pass

    def reset(self) -> None:
        pass


_REFUSED = _Refused()


class NativeGrpcServer:
    """Listens on host:port (SO_REUSEPORT, so several frontends share it) and dispatches each
    stream to the method named by its :path in ``methods``."""

    def __init__(self, methods: Mapping[str, Any], limits: GrpcLimits | None = None,
                 all_metadata: bool = False) -> None:
        self._methods = {path.encode(): m for path, m in methods.items()}
        self._all_metadata = all_metadata
        self.limits = limits = limits or GrpcLimits()
        self.max_message = limits.max_message_size
        self._connections: dict[H2Connection, _Gate] = {}
        self.calls: set[asyncio.Task] = set()
        self._server: asyncio.base_events.Server | None = None
        self.trireme_port = 0

    async def start(self, host: str, port: int, ssl: SSLContext | None = None, *,
                    fd: int = -1, reuse_port: bool = False) -> None:
        """Listen; with ``ssl`` (tls.server_context, ALPN "h2") over TLS: the TLS handshake
        and then the HTTP/2 preface and SETTINGS share one handshake timeout, and a
        connection that did not negotiate "h2" is closed (h2.TlsH2Connection)."""
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {}
        if ssl is not None:
            tls = {"ssl": ssl, "ssl_handshake_timeout": self.limits.handshake_timeout_s or None}
        try:
            self._server = await loop.create_server(
                functools.partial(H2Connection if ssl is None else TlsH2Connection,
                                  self._open_stream, self._closed, self.limits, self._opened),
                **where(host, port, fd, reuse_port), backlog=BACKLOG, **tls)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortTaken("GRPC", host, port) from None
            raise
        self.trireme_port = self._server.sockets[0].getsockname()[1]

    def _opened(self, conn: H2Connection) -> None:
        """A connection is made: kept from now until ``_closed``. Not from the protocol
        factory: over TLS that runs at accept, and a connection whose handshake fails is
        then never made nor lost (h2.H2Connection), so it would be kept for good."""
        self._connections[conn] = _Gate(conn, self.limits.max_pending_connection_bytes)

    def _closed(self, conn: H2Connection) -> None:
        gate = self._connections.pop(conn, None)
        if gate is not None:
            gate.waiting.clear()

    def _open_stream(self, conn: H2Connection, sid: int, headers: list) -> Any:
        path = content_type = b""
        encoding = b"identity"
        trace_context: tuple[tuple[str, str], ...] | None = None
        all_metadata = self._all_metadata
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name in _TRACE_HEADERS or (all_metadata and name[:1] != b":"):
                trace_context = (trace_context or ()) + (
                    (name.decode(), value.decode("latin-1")),)
        if not content_type.startswith(b"application/grpc"):
            conn.send_headers(sid, UNSUPPORTED_MEDIA, end_stream=True)
            return _REFUSED
        method = self._methods.get(path)
        if method is None:
            conn.send_headers(sid, _status_block(UNIMPLEMENTED, "Method not found!", False), True)
            return _REFUSED
        if encoding not in (b"identity", b"gzip", b"deflate"):
            conn.send_headers(sid, _status_block(
                UNIMPLEMENTED, f"Compression algorithm '{encoding.decode(errors='replace')}' "
                "is not supported", False), True)
            return _REFUSED
        return _Call(self, conn, sid, method, encoding, self._connections[conn],
                     CONTEXT if trace_context is None else _MetaContext(trace_context))

    async def stop(self, grace: float | None) -> None:
        """Stop accepting, let open calls finish for ``grace`` seconds, then cut the rest."""
        if self._server is not None:
            self._server.close()
        conns = list(self._connections)
        for conn in conns:
            conn.goaway()
        if grace and conns:
            waits = [asyncio.ensure_future(c.idle.wait()) for c in conns]
            await asyncio.wait(waits, timeout=grace)
            for w in waits:
                w.cancel()
        for conn in conns:
            conn.close()
        for task in list(self.calls):
            task.cancel()
        if self.calls:
            await asyncio.wait(list(self.calls), timeout=1.0)
