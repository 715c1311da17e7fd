"""The shapes both HTTP servers share with the handlers (routes.Handlers): a Reply (and
a StreamReply, whose body is sent as it is produced), the body errors, case-insensitive
Headers; and the native server's request (http/connection.py), which gathers its own body as the parser
hands it over.

A handler sees a request as: ``method``, ``path`` (percent-decoded, as aiohttp's
request.path), ``query``, ``headers`` (case-insensitive ``get``) and ``await read()``, the
whole decompressed body, which raises BodyTooLarge or BodyError. It answers a Reply.

Memory: a body is held as the bytes that arrived, never as the size its Content-Length
declares (one byte after ``Content-Length: 60000000`` holds one byte, not 60 MB). A body
that comes in one piece is that piece. One that comes in several is kept as its pieces
(small ones gathered into 64 KiB runs, so a body trickled a byte at a time does not cost an
object per byte) until half of it has come; then one buffer of the declared size takes
them and the rest is written in place (so a body costs at most twice what was sent, and
each byte is copied once, as with a buffer allocated up front). A body without a
Content-Length (chunked, or inflated from gzip/deflate) is joined once, when complete.
A buffer the connection already holds, the fully received body of its previous request
(its "spare", same size), is filled in place from the first piece.
"""
from __future__ import annotations

import asyncio
import zlib
from typing import Any

__all__ = [
    "BROKEN",
    "CHUNKS_TEXT",
    "COMPLETE",
    "DONE",
    "MAX_CHUNKS",
    "RECEIVING",
    "TOO_LARGE",
    "BodyError",
    "BodyTooLarge",
    "Headers",
    "Reply",
    "Request",
    "StreamReply",
]


class BodyTooLarge(Exception):
    """The body is over the size limit. ``size``: its declared size when known up front
    (Content-Length without Content-Encoding), else None (reading stopped at the limit)."""

    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size


class BodyError(Exception):
    """The body could not be read (bad gzip/deflate data, broken chunking, connection cut
    short); the connection cannot go on after such a request."""


class Reply:
    """A handler's answer. ``content_type`` None: no Content-Type header; ``headers``: any
    others; ``close``: end the connection after this answer."""
    __slots__ = ("body", "close", "content_type", "headers", "status")

    def __init__(self, status: int = 200, body: Any = b"", content_type: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        self.status, self.body, self.content_type = status, body, content_type
        self.headers, self.close = headers, close


class StreamReply(Reply):
    """A reply whose body is written as it is produced (the generate extension's
    server-sent events): ``chunks`` is an async iterator of bytes with ``aclose()``; each
    piece is sent as it comes (HTTP/1.1: one chunk of a chunked body). The server always
    calls ``aclose()`` once the body has ended, failed or lost its client, so whatever the
    iterator holds (a request in flight) is let go then, not when it is collected."""
    __slots__ = ("chunks",)

    def __init__(self, status: int, chunks: Any, content_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, b"", content_type, headers)
        self.chunks = chunks


class Headers(dict):
    """Request headers under lower-case names, looked up in any case (as aiohttp's
    CIMultiDict). A repeated header keeps its first value, which is what CIMultiDict.get
    returns."""
    __slots__ = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


# Body states. RECEIVING: bytes still to come; COMPLETE: it has all arrived; TOO_LARGE and
# BROKEN: read() raises; DONE: answered without it, the rest is dropped as it arrives.
RECEIVING, COMPLETE, TOO_LARGE, BROKEN, DONE = range(5)

# Triton's cap on the chunks of one chunked body (kMaxChunkedChunks, src/http_server.cc),
# and its text: 400, then the connection closes.
MAX_CHUNKS = 65536
CHUNKS_TEXT = (f"Chunked request body exceeds maximum of {MAX_CHUNKS} non-empty chunks. "
               f"Send fewer or larger HTTP chunks.")
# Pieces of a body shorter than this are appended to one buffer rather than kept apart.
_RUN = 64 * 1024


class Request:
    """One request of the native server: method, path, query, headers, version ("1.1")
    and ``await read()``; the connection fills in the body (``start_body``, ``feed``,
    ``complete``, ``end``)."""
    __slots__ = (
        "_body",
        "_declared",
        "_error",
        "_inflater",
        "_limit",
        "_loop",
        "_spare",
        "_too_large",
        "_waiter",
        "bad",
        "chunks",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_headers",
        "reply",
        "size",
        "state",
        "version",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop, self._limit = loop, limit
        self._spare: bytearray | None = None  # a buffer of the declared size, to reuse
        self.method = self.path = self.query = ""
        self.version = "1.1"
        self.headers = Headers()
        self.raw_headers: list[tuple[bytes, bytes]] | None = None   # as sent, when kept
        self.keep_alive = False
        self.bad: str | None = None           # a malformed request: answered 400, then close
        self.state = RECEIVING
        self.size = 0                         # body bytes so far (decompressed)
        self.chunks = 0                       # chunk headers parsed (chunked bodies)
        self.reply: Any = None                # an answer that replaces the handler's
        self._body: Any = None                # bytes | bytearray (the spare) | [pieces]
        self._declared: int | None = None     # Content-Length, when there is no encoding
        self._too_large: int | None = None
        self._inflater: _Inflater | None = None
        self._error = ""
        self._waiter: asyncio.Future | None = None

    async def read(self) -> Any:
        """The whole body (bytes or bytearray), once it has arrived."""
        if self.state == RECEIVING:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        state = self.state
        if state == COMPLETE:
            return self._body
        if state == TOO_LARGE:
            raise BodyTooLarge(self._too_large)
        raise BodyError(self._error)

    # -- from the connection (connection.py) -------------------------------------------------
    def start_body(self, length: str | None, encoding: str | None,
                   spare: bytearray | None = None) -> bool:
        """From the Content-Length and Content-Encoding headers, as aiohttp reads them: any
        encoding means the size is known only once inflated; gzip and deflate are inflated,
        others passed as they are. A Content-Length over the limit is refused up front.
        True: ``spare`` (a buffer the connection no longer needs) will take the body."""
        if encoding:
            encoding = encoding.lower()
            if encoding in ("gzip", "deflate"):
                self._inflater = _Inflater(encoding)
        elif length is not None:
            declared = self._declared = int(length)    # digits only: llhttp checked it
            if declared > self._limit:
                self._too_large = declared
                self.state = TOO_LARGE
            elif spare is not None and len(spare) == declared:
                self._spare = spare
                return True
        return False

    def feed(self, data: bytes) -> None:
        inflater = self._inflater
        if inflater is not None:
            try:
                data = inflater.feed(data, self._limit - self.size)
            except zlib.error:
                self.end(BROKEN, f"Can not decode content-encoding: {inflater.encoding}")
                return
        n = len(data)
        if not n:
            return
        start = self.size
        self.size = end = start + n
        if end > self._limit:
            self.end(TOO_LARGE)
            return
        body = self._body
        if body is None:
            declared = self._declared
            if n == declared:
                self._body = data             # the usual case: the body came in one piece
            elif self._spare is not None:     # a buffer we hold already, of the right size
                body = self._body = self._spare
                self._spare = None
                body[:n] = data
            elif declared is not None and 2 * n >= declared:
                body = self._body = bytearray(declared)   # at most twice what came
                body[:n] = data
            else:
                self._body = [data if n >= _RUN else bytearray(data)]
        elif type(body) is list:
            declared = self._declared
            if declared is not None and 2 * end >= declared:
                # Half of it has come: from here on, one buffer of its size (at most twice
                # what came), so the pieces are copied once and the rest lands in place.
                buf = bytearray(declared)
                pos = 0
                for piece in body:
                    buf[pos:pos + len(piece)] = piece
                    pos += len(piece)
                buf[start:end] = data
                self._body = buf
            elif n >= _RUN:
                body.append(data)
            else:
                last = body[-1]
                if type(last) is bytearray and len(last) < _RUN:
                    last += data
                else:
                    body.append(bytearray(data))
        else:
            body[start:end] = data

    def take_body(self) -> Any:
        """The body, no longer held here (the connection may reuse its buffer)."""
        body, self._body, self._spare = self._body, None, None
        return body

    def complete(self) -> None:
        inflater = self._inflater
        if inflater is not None and not inflater.finished():
            self.end(BROKEN, f"Can not decode content-encoding: {inflater.encoding}")
            return
        body = self._body
        if body is None:
            self._body = b""
        elif type(body) is list:
            self._body = body[0] if len(body) == 1 else b"".join(body)
        self.end(COMPLETE)

    def end(self, state: int, error: str = "") -> None:
        self.state, self._error = state, error
        if state != COMPLETE:
            self._body = None
        self._inflater = self._spare = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Inflater:
    """A gzip or deflate body, inflated piece by piece and never past the limit (a small
    body cannot expand into gigabytes here). As aiohttp does: several gzip members in a row
    are one body, and a deflate body without its zlib header (raw deflate) is accepted."""
    __slots__ = ("_obj", "_started", "encoding")

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._obj = zlib.decompressobj(31 if encoding == "gzip" else 15)
        self._started = False

    def feed(self, data: bytes, room: int) -> bytes:
        """Up to room + 1 bytes of output (one more than fits: the caller sees the overflow)."""
        if not self._started and data:
            self._started = True
            if self.encoding == "deflate" and data[0] & 0x0F != 8:
                self._obj = zlib.decompressobj(-15)
        out = self._obj.decompress(data, room + 1)
        while self._obj.eof and self._obj.unused_data and len(out) <= room:
            if self.encoding != "gzip":
                break                          # bytes after a deflate stream are ignored
            rest = self._obj.unused_data
            self._obj = zlib.decompressobj(31)
            out += self._obj.decompress(rest, room + 1 - len(out))
        return out

    def finished(self) -> bool:
        return not self._started or self._obj.eof
