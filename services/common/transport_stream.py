"""Multipart messages over plain stream sockets (Unix or TCP), read on the event loop.

Why not ZeroMQ on the request path: a ZeroMQ message wakes four threads (the sender, both
I/O threads, the receiver), which costs several times a Unix stream socket's round trip
(benchmarks/transport_rtt.py; docs/benchmarks.md, "Figures behind design choices"), and a
request crosses three hops. Here the kernel wakes the receiver directly.

Wire format, per message:  u32 size | u32 nparts | nparts x u32 length | the parts' bytes
(little endian; size counts everything after itself). The first message on every
connection is the connector's identity (one part, possibly empty: the listener then names
the peer itself), which gives ZeroMQ ROUTER/DEALER semantics: a listener answers a peer by
identity, a connector queues while disconnected and reconnects.

Received parts are memoryviews into buffers that are never reused, so a handler may keep
them (tensor frames) without a copy.
"""
from __future__ import annotations

import asyncio
import io
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
_MAX_MESSAGE = 1 << 34          # a corrupted length must not allocate the machine away
_JOIN_BELOW = 1 << 16           # smaller messages go out as one joined buffer
_RECONNECT_S = 0.1              # ZeroMQ's default reconnect interval
_PEER_GONE = select.POLLRDHUP | select.POLLHUP | select.POLLERR
_peer_names = itertools.count(1)


class FramingError(ValueError):
    """The byte stream is not a sequence of messages: the connection is dropped."""


def _nbytes(p: Any) -> int:
    # bytes (kind byte, header) is the common case; anything else is a buffer whose
    # length in bytes memoryview knows (len() of a numpy array counts rows).
    return len(p) if type(p) is bytes else memoryview(p).nbytes


def frame(parts: Sequence[Any]) -> list[Any]:
    """The buffers that put ``parts`` on the wire as one message."""
    lens = [_nbytes(p) for p in parts]
    n = len(lens)
    head = struct.pack(f"<II{n}I", 4 + 4 * n + sum(lens), n, *lens)
    return [head, *parts]


def _split(msg: memoryview) -> list[memoryview]:
    n = _U32.unpack_from(msg, 0)[0]
    pos = 4 + 4 * n
    if pos > len(msg):
        raise FramingError(f"message of {len(msg)} bytes cannot hold {n} parts")
    parts = []
    for ln in struct.unpack_from(f"<{n}I", msg, 4):
        parts.append(msg[pos:pos + ln])
        pos += ln
    if pos != len(msg):
        raise FramingError(f"message parts add up to {pos} bytes, not {len(msg)}")
    return parts


class _Assembler:
    """Cuts a byte stream into messages: whole ones are sliced out of the received chunk,
    a message split across chunks is gathered into its own buffer."""

    def __init__(self, deliver: Callable[[list[memoryview]], None]) -> None:
        self.deliver = deliver
        self._head = b""                       # < 4 bytes of a size prefix
        self._body: bytearray | None = None    # a message being gathered
        self._filled = 0

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        pos, end = 0, len(data)
        if self._head or self._body is not None:
            pos = self._continue(view)
            if pos < 0:
                return
        unpack = _U32.unpack_from
        while end - pos >= 4:
            size = unpack(view, pos)[0]
            if end - pos - 4 < size:
                break
            self._message(view[pos + 4:pos + 4 + size])
            pos += 4 + size
        if pos < end:
            if end - pos < 4:
                self._head = bytes(view[pos:])
            else:
                self._start(unpack(view, pos)[0])
                self._continue(view[pos + 4:])

    def _start(self, size: int) -> bytearray:
        if size < 4 or size > _MAX_MESSAGE:
            raise FramingError(f"bad message size {size}")
        body = self._body = bytearray(size)
        self._filled = 0
        return body

    def _continue(self, view: memoryview) -> int:
        """Feed the message in progress; the offset in ``view`` after it, or -1 when all
        of ``view`` went into it."""
        pos = 0
        body = self._body
        if body is None:
            need = 4 - len(self._head)
            self._head += bytes(view[:need])
            if len(self._head) < 4:
                return -1
            pos = need
            body = self._start(_U32.unpack(self._head)[0])
            self._head = b""
        take = min(len(body) - self._filled, len(view) - pos)
        body[self._filled:self._filled + take] = view[pos:pos + take]
        self._filled += take
        if self._filled < len(body):
            return -1
        self._body = None
        self._message(memoryview(body))
        return pos + take if pos + take < len(view) else -1

    def _message(self, msg: memoryview) -> None:
        parts = _split(msg)
        try:
            self.deliver(parts)
        except Exception:  # a bad message must not cost the connection
            log.exception("error while handling a message")


# ---------------------------------------------------------------------- addresses
def parse(address: str) -> tuple[int, Any]:
    """(socket family, sockaddr) of a unix:///path or stream://host:port address."""
    if address.startswith("unix://"):
        return socket.AF_UNIX, address[len("unix://"):]
    if address.startswith("stream://"):
        host, _, port = address[len("stream://"):].rpartition(":")
        host = host.strip("[]")
        if host in ("", "*"):
            host = "0.0.0.0"
        return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    raise ValueError(f"not a stream address: {address!r}")


def _bound_socket(address: str) -> socket.socket:
    family, sockaddr = parse(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_UNIX:
            try:
                os.unlink(sockaddr)   # a stale path from a dead process (ZeroMQ does the same)
            except FileNotFoundError:
                pass
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# TCP keepalive: a peer whose host vanished without closing its sockets (power, network)
# is found dead after IDLE + INTVL * CNT seconds, and what waits on it fails then.
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 10), (socket.TCP_KEEPINTVL, 5), (socket.TCP_KEEPCNT, 3))


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in _KEEPALIVE:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def _write(transport: asyncio.Transport, parts: Sequence[Any]) -> None:
    bufs = frame(parts)
    if _U32.unpack_from(bufs[0], 0)[0] < _JOIN_BELOW:
        transport.write(b"".join(bufs))
    else:
        transport.writelines(bufs)


# ---------------------------------------------------------------------- event-loop side
class _PeerProtocol(asyncio.Protocol):
    """One accepted connection: its first message names it, the rest go to the handler."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.identity: bytes | None = None
        self.transport: asyncio.Transport | None = None
        self.assembler = _Assembler(self._first)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _tune(sock)

    def _first(self, parts: list[memoryview]) -> None:
        identity = bytes(parts[0]) if parts and len(parts[0]) else b"\x00peer-%d" % next(_peer_names)
        self.identity = identity
        self.listener._peers[identity] = self
        handler = self.listener.handler
        self.assembler.deliver = lambda parts: handler(identity, parts)

    def data_received(self, data: bytes) -> None:
        try:
            self.assembler.feed(data)
        except FramingError as e:
            log.error("dropping a connection that sent a malformed message: %s", e)
            assert self.transport is not None   # set by connection_made, before any data
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        peers = self.listener._peers
        if self.identity is not None and peers.get(self.identity) is self:
            del peers[self.identity]
            if self.listener.on_lost is not None:
                self.listener.on_lost(self.identity)


class Listener:
    """Bound end: many peers, each answered by the identity it announced."""

    def __init__(self, address: str, handler: Callable[[bytes, list], None],
                 on_lost: Callable[[bytes], None] | None = None) -> None:
        self.address = address
        self.handler = handler
        self.on_lost = on_lost
        self._peers: dict[bytes, _PeerProtocol] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        sock = _bound_socket(self.address)
        if sock.family != socket.AF_UNIX and self.address.endswith(":0"):   # the port chosen
            self.address = f"{self.address[:-2]}:{sock.getsockname()[1]}"
        loop = asyncio.get_running_loop()
        factory = lambda: _PeerProtocol(self)   # noqa: E731
        if sock.family == socket.AF_UNIX:
            self._server = await loop.create_unix_server(factory, sock=sock)
        else:
            self._server = await loop.create_server(factory, sock=sock)

    def send(self, identity: bytes, parts: Sequence[Any]) -> bool:
        peer = self._peers.get(identity)
        if peer is None or peer.transport is None or peer.transport.is_closing():
            return False
        _write(peer.transport, parts)
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for peer in list(self._peers.values()):
            if peer.transport is not None:
                peer.transport.abort()
        self._peers.clear()
        family, path = parse(self.address)
        if family == socket.AF_UNIX:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.assembler = _Assembler(conn.handler)

    def data_received(self, data: bytes) -> None:
        try:
            self.assembler.feed(data)
        except FramingError as e:
            log.error("malformed message from %s: %s", self.conn.address, e)
            # set once connected; the peer sends nothing before our identity, written after
            assert self.conn._transport is not None
            self.conn._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._lost()


class Connection:
    """Connecting end: sends queue while (re)connecting, as a ZeroMQ DEALER's do."""

    def __init__(self, address: str, handler: Callable[[list], None], identity: bytes = b"",
                 on_state: Callable[[bool], None] | None = None) -> None:
        self.address = address
        self.handler = handler
        self.identity = identity
        self.on_state = on_state
        self._transport: asyncio.Transport | None = None
        self._queue: list[Sequence[Any]] = []
        self._closed = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        family, sockaddr = parse(self.address)
        while not self._closed:
            try:
                if family == socket.AF_UNIX:
                    transport, _ = await loop.create_unix_connection(
                        lambda: _ClientProtocol(self), sockaddr)
                else:
                    transport, _ = await loop.create_connection(
                        lambda: _ClientProtocol(self), *sockaddr)
                    _tune(transport.get_extra_info("socket"))
            except OSError:
                await asyncio.sleep(_RECONNECT_S)
                continue
            if self._closed:
                transport.close()
                return
            self._transport = transport
            _write(transport, [self.identity])
            queued, self._queue = self._queue, []
            for parts in queued:
                _write(transport, parts)
            # A peer that died as we connected (its listening socket still took us) closes
            # the transport at once: not a connection to announce. What the announcement
            # would send (a worker host's HostHello) would be queued for the next one and
            # arrive there twice.
            if self.on_state is not None and not transport.is_closing():
                self.on_state(True)
            return

    def _lost(self) -> None:
        self._transport = None
        if not self._closed:
            log.warning("connection to %s lost; reconnecting", self.address)
            self.start()
            if self.on_state is not None:
                self.on_state(False)

    def send(self, parts: Sequence[Any]) -> None:
        t = self._transport
        if t is None or t.is_closing():
            self._queue.append(parts)
        else:
            _write(t, parts)

    def close(self) -> None:
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()
            self._transport = None


# ---------------------------------------------------------------------- blocking side
def peer_closed(poll: Any) -> bool:
    """Whether the peer closed (or reset) a connection, from a poll (registered for
    POLLRDHUP) that never blocks: data waiting for the reader does not count. (0.6 us; a
    MSG_PEEK recv, which raises when there is nothing to read, costs 2.5 us.)"""
    for _, events in poll.poll(0):
        return bool(events & _PEER_GONE)
    return False


def send_blocking(sock: socket.socket, poll: Any, parts: Sequence[Any], what: str) -> None:
    """One message on a blocking socket (the caller holds its send lock). Raises OSError
    (BrokenPipeError when the peer has closed): the closed peer is looked for first, since
    TCP accepts one write after the peer closed and loses it."""
    bufs = frame(parts)
    if peer_closed(poll):
        raise BrokenPipeError(f"{what} closed by the peer")
    if _U32.unpack_from(bufs[0], 0)[0] < _JOIN_BELOW:
        sock.sendall(b"".join(bufs))
        return
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


class BlockingConnection:
    """A connecting end for a thread that blocks (the worker): recv() in one thread, send()
    from any. Connects at once, retrying until ``timeout`` (None: forever)."""

    def __init__(self, address: str, identity: bytes = b"", timeout: float | None = None) -> None:
        self.address = address
        family, sockaddr = parse(address)
        self._lock = threading.Lock()
        self.sock = self._connect(family, sockaddr, timeout)
        _tune(self.sock)
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN | select.POLLRDHUP)
        # makefile's stub says IOBase for an int buffering; "rb" with a buffer is a BufferedReader
        self._reader = cast(io.BufferedReader, self.sock.makefile("rb", buffering=1 << 16))
        self.send([identity])

    @staticmethod
    def _connect(family: int, sockaddr: Any, timeout: float | None) -> socket.socket:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                sock.settimeout(None)
                return sock
            except OSError:
                sock.close()
                if deadline is not None and time.monotonic() + _RECONNECT_S > deadline:
                    raise
                time.sleep(_RECONNECT_S)

    def send(self, parts: Sequence[Any]) -> None:
        """Raises OSError (BrokenPipeError when the peer has closed) if the message cannot
        go. The closed peer is looked for first: TCP accepts one write after the peer
        closed and loses it, a Unix socket fails it; either way the caller learns."""
        with self._lock:
            send_blocking(self.sock, self._poll, parts, f"connection to {self.address}")

    def _peer_closed(self) -> bool:
        return peer_closed(self._poll)

    def recv(self) -> list[memoryview]:
        """The next message's parts; EOFError when the peer closed the connection."""
        head = self._reader.read(4)
        if len(head) < 4:
            raise EOFError(f"connection to {self.address} closed")
        size = _U32.unpack(head)[0]
        if size < 4 or size > _MAX_MESSAGE:
            raise EOFError(f"bad message size {size} from {self.address}")
        body = bytearray(size)
        view = memoryview(body)
        filled = 0
        while filled < size:
            n = self._reader.readinto(view[filled:])
            if not n:
                raise EOFError(f"connection to {self.address} closed mid-message")
            filled += n
        return _split(view)

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self.sock.close()
