"""A worker's sockets in one blocking loop: its connection to the scheduler and the direct
connections frontends open to its listener (the direct path, messages_direct.py).

    hub = Hub(scheduler_connection, "unix:///run/w1.direct.sock")
    peer, parts = hub.recv()    # peer None: the scheduler's; parts None: that peer closed

One thread reads (the worker's loop); any thread may send to a peer. The scheduler
connection keeps its own send(); from here on only the hub reads it. Wire format and
framing are transport_stream's: a peer's first message is its identity (a frontend's
result address), kept as ``peer.name``.
"""
from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from services.common.transport_stream import (
    BlockingConnection,
    FramingError,
    _Assembler,
    _bound_socket,
    _tune,
    parse,
    send_blocking,
)

log = logging.getLogger(__name__)

_READ = 1 << 18   # bytes per recv, as asyncio's selector transports read


class Peer:
    """A frontend's direct connection: what it sends comes out of Hub.recv; send() from
    any thread."""

    def __init__(self, sock: socket.socket, hub: Hub) -> None:
        self.sock = sock
        self.name = ""                 # its first message: the frontend's result address
        self.closed = False
        self._lock = threading.Lock()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLRDHUP)
        self._assembler = _Assembler(self._first)
        self._hub = hub

    def _first(self, parts: list[memoryview]) -> None:
        self.name = bytes(parts[0]).decode(errors="replace") if parts else ""
        self._assembler.deliver = lambda parts: self._hub._ready.append((self, parts))

    def send(self, parts: Sequence[Any]) -> None:
        """Raises OSError when the frontend has closed the connection (BlockingConnection.send)."""
        with self._lock:
            if self.closed:
                raise BrokenPipeError(f"direct connection from {self.name} closed")
            send_blocking(self.sock, self._poll, parts, f"direct connection from {self.name}")

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self.sock.close()


class Hub:
    def __init__(self, main: BlockingConnection, address: str) -> None:
        self.main = main
        self._listener = _bound_socket(address)
        if parse(address)[0] == socket.AF_UNIX:
            self.address = address
        else:
            host, port = self._listener.getsockname()[:2]
            self.address = f"stream://{host}:{port}"
        self._path = parse(address)[1] if parse(address)[0] == socket.AF_UNIX else ""
        self._sel = selectors.DefaultSelector()
        self._sel.register(main.sock, selectors.EVENT_READ, None)
        self._sel.register(self._listener, selectors.EVENT_READ, self)
        self._ready: deque[tuple[Peer | None, list[memoryview] | None]] = deque()
        self._main = _Assembler(lambda parts: self._ready.append((None, parts)))
        self.peers: set[Peer] = set()

    def recv(self, timeout: float | None = None) -> tuple[Peer | None, list[memoryview] | None]:
        """The next message and its sender (None: the scheduler); (peer, None) when that
        peer closed. EOFError when the scheduler closed. ``timeout`` (seconds): then
        (None, None) if nothing came."""
        while not self._ready:
            events = self._sel.select(timeout)
            if not events:
                return None, None
            for key, _ in events:
                self._read(key.data)
        return self._ready.popleft()

    @property
    def queued(self) -> deque[tuple[Peer | None, list[memoryview] | None]]:
        """Messages read and not yet taken by recv(), in order."""
        return self._ready

    def read_now(self) -> None:
        """Read what has arrived on every connection, without waiting (into ``queued``)."""
        for key, _ in self._sel.select(0):
            self._read(key.data)

    def pending(self) -> list[tuple[Peer | None, list[memoryview] | None]]:
        """Every message read or readable now from the peers, without waiting (for a worker
        leaving)."""
        for key, _ in self._sel.select(0):
            if isinstance(key.data, Peer):   # (no new peers, nothing more from the scheduler)
                self._read(key.data)
        out = list(self._ready)
        self._ready.clear()
        return out

    def _read(self, source: Peer | Hub | None) -> None:
        if source is self:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setblocking(True)
            _tune(sock)
            peer = Peer(sock, self)
            self.peers.add(peer)
            self._sel.register(sock, selectors.EVENT_READ, peer)
            return
        if source is None:
            data = self.main.sock.recv(_READ)
            if not data:
                raise EOFError(f"connection to {self.main.address} closed")
            try:
                self._main.feed(data)
            except FramingError as e:
                raise EOFError(f"malformed message from {self.main.address}: {e}") from None
            return
        assert isinstance(source, Peer)
        try:
            data = source.sock.recv(_READ)
        except OSError:
            data = b""
        if data:
            try:
                source._assembler.feed(data)
                return
            except FramingError as e:
                log.error("malformed message on the direct connection from %s: %s",
                          source.name, e)
        self._drop(source)

    def _drop(self, peer: Peer) -> None:
        self._sel.unregister(peer.sock)
        self.peers.discard(peer)
        peer.close()
        self._ready.append((peer, None))

    def close(self) -> None:
        for peer in list(self.peers):
            peer.close()
        self._sel.close()
        self._listener.close()
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass
