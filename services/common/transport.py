"""How the services reach each other: one interface, two wires, chosen by the address.

    unix:///path, stream://host:port   length-prefixed frames on a stream socket
                                       (transport_stream; the default of `trireme serve`)
    ipc:///path, tcp://host:port       ZeroMQ ROUTER/DEALER (transport_zmq)

Both give the same three ends: a ``Listener`` (bound; answers each peer by the identity it
announced; close() removes its socket file), a ``Connection`` (connects, queues while
disconnected, reconnects) on an asyncio loop, and a ``BlockingConnection`` for the worker's
synchronous loop. Received parts are memoryviews the handler may keep. Why two: ZeroMQ is
what separate containers and existing deployments use; a plain stream socket costs a
quarter of ZeroMQ's latency per hop on this machine (see transport_stream).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from services.common import transport_stream, transport_zmq

Parts = Sequence[Any]
"""One message: bytes-like parts (a kind byte and header first, then tensor frames)."""


class Listener(Protocol):
    """Bound end: answers each peer by the identity it announced."""

    def send(self, identity: bytes, parts: Parts) -> bool:
        """Queue ``parts`` to the peer ``identity``; False when no such peer is connected."""
        ...

    def close(self) -> None: ...


class Connection(Protocol):
    """Connecting end on an asyncio loop: queues while disconnected, reconnects."""

    def send(self, parts: Parts) -> None: ...

    def close(self) -> None: ...


class BlockingConnection(Protocol):
    """Connecting end for a synchronous loop: recv() from one thread, send() from any."""

    def send(self, parts: Parts) -> None:
        """Raises OSError when the message cannot go: on a stream socket also when the peer
        has closed the connection, which TCP would otherwise accept once and lose."""
        ...

    def recv(self) -> list[memoryview]: ...

    def close(self) -> None: ...

STREAM_SCHEMES = ("unix://", "stream://")
ZMQ_SCHEMES = ("ipc://", "tcp://")


def is_stream(address: str) -> bool:
    return address.startswith(STREAM_SCHEMES)


def _check(address: str) -> None:
    if not address.startswith(STREAM_SCHEMES + ZMQ_SCHEMES):
        raise ValueError(f"unsupported address '{address}': expected unix:///path, "
                         "stream://host:port, ipc:///path or tcp://host:port")


async def listen(address: str, handler: Callable[[bytes, list[Any]], None]) -> Listener:
    """A bound Listener on the running loop; ``handler(identity, parts)`` per message."""
    _check(address)
    if is_stream(address):
        listener: transport_stream.Listener | transport_zmq.Listener = \
            transport_stream.Listener(address, handler)
    else:
        listener = transport_zmq.Listener(address, handler)
    await listener.start()
    return listener


def connect(address: str, handler: Callable[[list[Any]], None], identity: bytes = b"",
            on_state: Callable[[bool], None] | None = None) -> Connection:
    """A Connection on the running loop; ``handler(parts)`` per message. ``on_state(True)``
    each time the connection is (re)established, ``on_state(False)`` each time it breaks
    (the peer closed or died; ZeroMQ: its heartbeat timed out): what was sent and not yet
    answered may never be."""
    _check(address)
    if is_stream(address):
        conn: transport_stream.Connection | transport_zmq.Connection = \
            transport_stream.Connection(address, handler, identity, on_state)
    else:
        conn = transport_zmq.Connection(address, handler, identity, on_state)
    conn.start()
    return conn


def connect_blocking(address: str, identity: bytes = b"",
                     timeout: float | None = None) -> BlockingConnection:
    """A BlockingConnection: recv() from one thread, send() from any."""
    _check(address)
    if is_stream(address):
        return transport_stream.BlockingConnection(address, identity, timeout)
    return transport_zmq.BlockingConnection(address, identity)


def local_address(like: str, name: str) -> str:
    """A same-host address for ``name`` on the wire ``like`` uses (result sockets)."""
    path = f"/tmp/trireme-{os.getpid()}-{name}.sock"
    return f"unix://{path}" if is_stream(like) else f"ipc://{path}"


__all__ = ["Listener", "Connection", "BlockingConnection", "Parts", "listen", "connect",
           "connect_blocking", "is_stream", "local_address"]
