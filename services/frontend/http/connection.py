"""One client connection of the native HTTP/1.1 server: an asyncio.Protocol parsed by
httptools (llhttp). How it answers (in order, pipelined) and pauses: http/engine.py; its
limits, checked as it reads and by the server's timer (``Connection.tick``): http/limits.py.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from typing import TYPE_CHECKING, Any

import httptools

from services.common.errors import unknown_expect_text
from services.frontend.http.json_body import error_body
from services.frontend.http.limits import BODY_MIN_RATE, MAX_HEAD, MAX_HEAD_READ, MAX_QUEUED, MAX_QUEUED_BYTES
from services.frontend.http.message import (
    BROKEN,
    CHUNKS_TEXT,
    DONE,
    MAX_CHUNKS,
    RECEIVING,
    Reply,
    Request,
    StreamReply,
)
from services.frontend.http.wire import (
    HEADER_NAMES,
    METHODS,
    SMALL_WRITE,
    SPARE_MAX,
    SPARE_MIN,
    UNSHARED_REFS,
    date_line,
    split_target,
    status_prefix,
)

if TYPE_CHECKING:
    from services.frontend.http.engine import NativeHttpServer

log = logging.getLogger("services.frontend.http.engine")   # the native server's one logger

__all__ = ["Connection"]


class _Stop(Exception):
    """Raised in a parser callback to stop parsing (too large a head, connection ending)."""


def _error(status: int, text: str) -> Reply:
    return Reply(status, error_body(text), "application/json", close=True)


def _parser(protocol: Any) -> Any:
    """llhttp as strict as it comes, but for one leniency: a request with both
    Transfer-Encoding: chunked and Content-Length is read by its chunks (RFC 9112 §6.3: the
    Transfer-Encoding overrides; Triton reads such requests by their chunks too, and
    Python's `requests` sends them for a pre-chunked body). The connection closes after its
    answer, as §6.3 asks of a server that accepts one, so no pipelined request can hide
    behind a disputed length."""
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_chunked_length=True)
    return parser


# Phases of a connection, as the server's timer sees them (Connection.tick).
_HEAD, _BODY, _ANSWER, _IDLE, _STALL = range(5)


class Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    def __init__(self, server: NativeHttpServer) -> None:
        self._server = server
        self._handle = server.handle
        self._limit = server.limit
        self._loop = asyncio.get_running_loop()
        self._parser: Any = _parser(self)   # None once closed
        self._transport: asyncio.Transport | None = None
        self._parsing: Request | None = None  # the request the parser is filling in
        self._url = b""
        self._head = 0                         # bytes of the head being parsed
        self._head_read = 0                    # bytes read while it is incomplete
        self._queue: deque[Request] = deque()  # read, waiting for their turn
        self._busy = False                     # a task is answering (self._task)
        self._task: asyncio.Task | None = None
        self._no_more = False                  # no new request will be taken
        self._dead = False                     # the parser stopped: input is ignored
        self._close_after_body = False         # close once the current body has arrived
        self._write_paused = False
        self._read_paused = False
        self._drain: asyncio.Future | None = None
        self._closed = False
        self._stop_reading = False             # reading stays paused (a flood was cut)
        self._served = False                   # a request has been read on this connection
        self._phase: tuple[int, Any] | None = None   # what the timer saw last, since when
        self._since = self._loop.time()
        self._spare: bytearray | None = None   # the last body's buffer, for the next body

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if len(server.connections) >= server.max_connections > 0:
            # Over the cap: answered at once and closed, nothing read (nginx's limit_conn
            # and uvicorn's --limit-concurrency answer 503 too).
            server.count("connections_refused")
            self._no_more = self._dead = self._closed = True
            transport.write(server.refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        """Everything this connection holds goes now, not when the cyclic GC next runs: the
        parser (which refers back to us), the request being read and those queued (their
        bodies), the spare buffer, and the task answering (cancelled: the DataPlane frees
        what a cancelled infer held)."""
        self._closed = self._no_more = self._dead = True
        self._server.connections.discard(self)
        self._parser = None
        req, self._parsing, self._phase = self._parsing, None, None
        if req is not None and req.state == RECEIVING:
            req.end(BROKEN, "the connection closed")  # wakes a handler waiting for it
        for queued in self._queue:
            if queued.state == RECEIVING:
                queued.end(BROKEN, "the connection closed")
        self._queue.clear()
        self._spare = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None
        self._server.connection_closed()

    def data_received(self, data: bytes) -> None:
        if self._dead:
            return
        try:
            self._parser.feed_data(data)
            req = self._parsing
            if req is not None and not req.method:     # still in a request's head
                self._head_read += len(data)
                if self._head_read > MAX_HEAD_READ:
                    self._dead = True
                    self._malformed("request head too large")
        except httptools.HttpParserUpgrade as e:
            # Upgrade: / CONNECT: we never switch protocols; answer in HTTP/1.1 and go on
            # parsing what follows with a fresh parser.
            self._parser = _parser(self)
            if e.args[0] < len(data):
                self.data_received(data[e.args[0]:])
                return
        except httptools.HttpParserCallbackError as e:
            self._dead = True
            cause = e.__context__
            if not isinstance(cause, _Stop):
                log.error("HTTP parser callback failed", exc_info=cause)
                self._malformed("internal error")
            elif not self._no_more:
                self._malformed(str(cause))
        except httptools.HttpParserError as e:
            self._dead = True
            self._malformed(str(e) or type(e).__name__)
        if not self._closed:
            self._next()

    # eof_received: not defined, so the transport closes on the client's FIN. Clients do not
    # half-close an HTTP connection, they go away: its handler is cancelled (connection_lost).

    def pause_writing(self) -> None:
        self._write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._flow()

    # -- httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._no_more:
            raise _Stop("closing")
        self._served = True
        self._parsing = Request(self._loop, self._limit)
        if self._server.raw_headers:
            self._parsing.raw_headers = []
        self._url = b""
        self._head = self._head_read = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head += len(url)
        if self._head > MAX_HEAD:
            raise _Stop("request head too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head += len(name) + len(value) + 4
        if self._head > MAX_HEAD:
            raise _Stop("request head too large")
        key = HEADER_NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
            if len(HEADER_NAMES) < 512:
                HEADER_NAMES[name] = key
        headers = self._parsing.headers  # type: ignore[union-attr]
        if not dict.__contains__(headers, key):
            dict.__setitem__(headers, key, value.decode("latin-1"))
        raw = self._parsing.raw_headers  # type: ignore[union-attr]
        if raw is not None:
            raw.append((name, value))

    def on_headers_complete(self) -> None:
        req = self._parsing
        assert req is not None
        parser = self._parser
        method = parser.get_method()
        req.method = METHODS.get(method) or method.decode("latin-1")
        req.version = parser.get_http_version()
        req.keep_alive = parser.should_keep_alive()
        req.path, req.query = split_target(self._url)
        headers = req.headers
        length = dict.get(headers, "content-length")
        if length is not None and dict.__contains__(headers, "transfer-encoding"):
            length = None                    # read by chunks (see _parser), the limit as they come
            req.keep_alive = False
        if req.start_body(length,
                          dict.get(headers, "content-encoding"), self._spare):
            self._spare = None
        self._queue.append(req)

    def on_body(self, body: bytes) -> None:
        req = self._parsing
        if req is not None and req.state == RECEIVING:
            req.feed(body)

    def on_chunk_header(self) -> None:
        """A chunk's size line. Every chunk but the last (size 0) is non-empty, so the
        chunks before this one are all non-empty: more than MAX_CHUNKS of them is Triton's
        400, and, as Triton does, nothing more is read from this client."""
        req = self._parsing
        if req is None:
            return
        req.chunks += 1
        if req.chunks > MAX_CHUNKS + 1:
            self._server.count("chunk_floods")
            if req.state == RECEIVING:
                req.reply = _error(400, CHUNKS_TEXT)
                req.end(BROKEN, CHUNKS_TEXT)
            self._stop_reading = self._no_more = True
            self._parsing = None
            if req.state != RECEIVING and not self._busy and not self._queue:
                self._close()                  # answered already: nothing left to say
            raise _Stop(CHUNKS_TEXT)

    def on_message_complete(self) -> None:
        req = self._parsing
        self._parsing = None
        if req is not None and req.state == RECEIVING:
            req.complete()
        if self._close_after_body:
            self._close()

    # -- answering --------------------------------------------------------------------------
    def _malformed(self, detail: str) -> None:
        """A parse error: no request after this one. A body cut by it fails that request
        (its handler answers 400 and the connection closes); otherwise a 400 takes the
        place of the request that could not be read."""
        self._no_more = True
        self._server.count("malformed")
        req = self._parsing
        self._parsing = None
        if req is not None and req.method:
            if req.state == RECEIVING:
                req.end(BROKEN, detail)
            elif not self._busy and not self._queue:
                self._close()
            return
        bad = Request(self._loop, self._limit)
        bad.bad = detail
        self._queue.append(bad)

    def _next(self) -> None:
        """Start answering if requests wait and no task is at it; pause or resume reading."""
        if not self._busy and self._queue and not self._closed:
            self._busy = True
            self._task = self._loop.create_task(self._serve(self._queue.popleft()))
        self._flow()

    def _flow(self) -> None:
        queue = self._queue
        pause = self._write_paused or self._stop_reading or len(queue) >= MAX_QUEUED or (
            len(queue) > 1 and sum(r.size for r in queue) > MAX_QUEUED_BYTES)
        if pause != self._read_paused and self._transport is not None and not self._closed:
            self._read_paused = pause
            if pause:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    async def _serve(self, req: Request) -> None:
        """Answer ``req``, then every request queued behind it, in order."""
        try:
            while True:
                try:
                    reply = await self._answer(req)
                except Exception:
                    if req.reply is None:
                        raise
                    reply = req.reply
                if req.reply is not None:      # the engine's own answer (a limit, a timeout)
                    if type(reply) is StreamReply:
                        await reply.chunks.aclose()
                    reply = req.reply
                if type(reply) is StreamReply:
                    await self._send_stream(req, reply)
                else:
                    self._send(req, reply)
                if self._closed:
                    return
                await self._drained()
                if not self._queue:
                    if self._no_more and self._parsing is None:
                        self._close()          # the client is done sending
                    return
                req = self._queue.popleft()
                self._flow()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("HTTP connection failed")
            self._close()
        finally:
            self._busy = False

    async def _answer(self, req: Request) -> Reply:
        if req.reply is not None:              # decided by the engine before its turn
            return req.reply
        if req.bad is not None:
            return Reply(400, error_body(f"malformed HTTP request: {req.bad}"),
                         "application/json", close=True)
        expect = dict.get(req.headers, "expect")
        if expect and req.version == "1.1":    # as aiohttp: nothing to answer on HTTP/1.0
            if expect.lower() != "100-continue":
                return Reply(417, unknown_expect_text(expect).encode(),
                             "text/plain; charset=utf-8", close=True)
            if not self._closed:
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        return await self._handle(req)

    def _send(self, req: Request, reply: Reply) -> None:
        transport = self._transport
        if self._closed or transport is None or transport.is_closing():
            return
        keep = req.keep_alive and not reply.close and not self._server.stopping
        body = reply.body
        n = len(body) if type(body) is not memoryview else body.nbytes
        extra = b""
        if reply.headers:
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items()).encode("latin-1")
        if not keep:
            extra += b"Connection: close\r\n"
        elif req.version == "1.0":
            extra += b"Connection: keep-alive\r\n"
        head = b"%sContent-Length: %d\r\n%s%s\r\n" % (
            status_prefix(reply.status, reply.content_type), n, extra, date_line())
        if req.method == "HEAD" or not n:
            transport.write(head)
        elif n <= SMALL_WRITE:
            transport.write(b"".join((head, body)))
        else:
            transport.write(head)
            transport.write(body)
        self._sent(req, keep)

    def _sent(self, req: Request, keep: bool) -> None:
        """After an answer: drop the rest of an unread body, keep its buffer for the next
        one, or close when the connection does not go on."""
        if req.state == RECEIVING:
            req.end(DONE)                    # answered without its body: drop the rest
        else:
            buf = req.take_body()
            # Reused only when nothing else holds it: no handler, tensor view or message frame.
            if type(buf) is bytearray and SPARE_MIN <= len(buf) <= SPARE_MAX \
                    and sys.getrefcount(buf) == UNSHARED_REFS:
                self._spare = buf
        if not keep:
            self._no_more = True
            self._queue.clear()
            if self._parsing is req and not self._dead:
                self._close_after_body = True  # closing now could reset the connection
            else:                              # before the client reads this answer
                self._close()

    def _close(self) -> None:
        self._no_more = self._dead = True
        self._queue.clear()
        if self._transport is not None and not self._closed:
            self._closed = True
            self._transport.close()

    # -- from the server --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Graceful stop: an idle connection closes now, a busy one after its answer."""
        if not self._busy and not self._queue:
            self._close()

    def tick(self, now: float) -> None:
        """From the server's timer: which phase the connection is in, since when, and
        whether that has lasted past its timeout. A phase is timed from the first tick that
        sees it (a new connection's first head: from the connection), so a timeout fires
        within one check interval after it is due."""
        server = self._server
        req = self._parsing
        if self._closed or (self._write_paused and (self._busy or self._queue)):
            phase: tuple[int, Any] = (_STALL, self._task)   # (closing: our last answer)
        elif req is not None and not self._read_paused:
            phase = (_BODY if req.method else _HEAD, req)
        elif self._busy or self._queue:
            phase = (_ANSWER, None)            # a handler is at work; not the client's time
        elif not self._served:
            phase = (_HEAD, None)              # nothing sent yet on a new connection
        else:
            phase = (_IDLE, None)
            self._spare = None
        if phase != self._phase:
            if self._phase is not None or phase[0] != _HEAD:
                self._since = now              # (a new connection: since connection_made)
            self._phase = phase
        elapsed = now - self._since
        kind = phase[0]
        if kind == _HEAD:
            if 0 < server.header_timeout <= elapsed:
                server.count("header_timeouts")
                if req is None:
                    self._close()
                else:
                    self._cut(req, 408, f"request head not received within "
                              f"{server.header_timeout:g} s (--http-header-timeout-secs)")
        elif kind == _BODY:
            assert req is not None
            if 0 < server.body_timeout and \
                    elapsed >= server.body_timeout + req.size / BODY_MIN_RATE:
                server.count("body_timeouts")
                self._cut(req, 408, f"request body not received within "
                          f"{server.body_timeout:g} s (--http-body-timeout-secs)")
        elif kind == _IDLE:
            if 0 < server.idle_timeout <= elapsed:
                if self._write_paused:         # our last answer is not being read
                    server.count("write_stalls")
                    self.abort()
                else:
                    self._close()
        elif kind == _STALL:
            if 0 < server.idle_timeout <= elapsed:
                server.count("write_stalls")
                self.abort()                   # what we wrote is not being read: drop it

    def _cut(self, req: Request, status: int, text: str) -> None:
        """A request that did not arrive in time: nothing more is read; its answer (or, when
        no handler has it yet, this connection's last answer) is ``status`` and the
        connection closes once it is written."""
        self._stop_reading = self._no_more = self._dead = True
        self._parsing = None
        self._flow()
        if not req.method:                     # an incomplete head: no handler has it
            bad = Request(self._loop, self._limit)
            bad.reply = _error(status, text)
            self._queue.append(bad)
            self._next()
        elif req.state == RECEIVING:
            req.reply = _error(status, text)
            req.end(BROKEN, text)              # the handler waiting for it answers now
        elif not self._busy and not self._queue:
            self._close()                      # answered already: nothing left to say

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------------ streamed replies
    async def _send_stream(self, req: Request, reply: StreamReply) -> None:
        """A body sent as it is produced: HTTP/1.1 one chunk per piece, HTTP/1.0 the bare
        pieces then close. The next piece waits while the client does not read. A client
        that leaves cancels this task (connection_lost); the iterator is closed in every
        case, which ends the request it reads from (the data plane cancels it)."""
        chunks = reply.chunks
        try:
            transport = self._transport
            if self._closed or transport is None or transport.is_closing():
                return
            chunked = req.version != "1.0"
            keep = chunked and req.keep_alive and not reply.close and not self._server.stopping
            extra = b"Transfer-Encoding: chunked\r\n" if chunked else b""
            if reply.headers:
                extra += "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items()).encode("latin-1")
            if not keep:
                extra += b"Connection: close\r\n"
            transport.write(b"%s%s%s\r\n" % (status_prefix(reply.status, reply.content_type),
                                               extra, date_line()))
            if req.method != "HEAD":
                async for piece in chunks:
                    if self._closed:
                        return
                    if piece:
                        transport.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                        await self._drained()
                if chunked and not self._closed:
                    transport.write(b"0\r\n\r\n")
        finally:
            await chunks.aclose()
        if not self._closed:
            self._sent(req, keep)

    async def _drained(self) -> None:
        """Wait while the transport holds more than its high-water mark of our writes."""
        if self._write_paused and not self._closed:
            self._drain = self._loop.create_future()
            await self._drain
            self._drain = None
