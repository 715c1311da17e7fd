"""A Connection's streamed replies (a mixin of it, connection.py): a body written as it is
produced (server-sent events of /generate_stream), with the connection's back-pressure."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from services.frontend.http.message import Request, StreamReply
from services.frontend.http.wire import date_line, status_prefix


class StreamWriter:
    """Connection's streaming methods; the state they use is Connection's."""

    _transport: Any
    _closed: bool
    _server: Any
    _write_paused: bool
    _drain: asyncio.Future | None
    _loop: asyncio.AbstractEventLoop

    if TYPE_CHECKING:
        def _sent(self, req: Request, keep: bool) -> None: ...

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
