"""How the services reach each other: one interface, two wires, chosen by the address.

    unix:///path, stream://host:port   length-prefixed frames on a stream socket
                                       (transport_stream; the default of `trireme serve`)
    ipc:///path, tcp://host:port       ZeroMQ ROUTER/DEALER (transport_zmq)

Both give the same three ends: a ``Listener`` (bound; answers each peer by the identity it
announced; close() removes its socket file), a ``Connection`` (connects, queues while disconnected, reconnects) on an
asyncio loop, and a ``BlockingConnection`` for the worker's synchronous loop. Received
parts are memoryviews the handler may keep. Why two: ZeroMQ is what separate containers
and existing deployments use; a plain stream socket costs a quarter of ZeroMQ's latency
per hop on this machine (see transport_stream).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from services.common import transport_stream, transport_zmq

STREAM_SCHEMES = ("unix://", "stream://")
ZMQ_SCHEMES = ("ipc://", "tcp://")


def is_stream(address: str) -> bool:
    return address.startswith(STREAM_SCHEMES)


def _check(address: str) -> None:
    if not address.startswith(STREAM_SCHEMES + ZMQ_SCHEMES):
        raise ValueError(f"unsupported address '{address}': expected unix:///path, "
                         "stream://host:port, ipc:///path or tcp://host:port")


async def listen(address: str, handler: Callable[[bytes, list], None]) -> Any:
    """A bound Listener on the running loop; ``handler(identity, parts)`` per message."""
    _check(address)
    impl = transport_stream.Listener if is_stream(address) else transport_zmq.Listener
    listener = impl(address, handler)
    await listener.start()
    return listener


def connect(address: str, handler: Callable[[list], None], identity: bytes = b"") -> Any:
    """A Connection on the running loop; ``handler(parts)`` per message."""
    _check(address)
    impl = transport_stream.Connection if is_stream(address) else transport_zmq.Connection
    conn = impl(address, handler, identity)
    conn.start()
    return conn


def connect_blocking(address: str, identity: bytes = b"", timeout: float | None = None) -> Any:
    """A BlockingConnection: recv() from one thread, send() from any."""
    _check(address)
    if is_stream(address):
        return transport_stream.BlockingConnection(address, identity, timeout)
    return transport_zmq.BlockingConnection(address, identity)


def local_address(like: str, name: str) -> str:
    """A same-host address for ``name`` on the wire ``like`` uses (result sockets)."""
    path = f"/tmp/trireme-{os.getpid()}-{name}.sock"
    return f"unix://{path}" if is_stream(like) else f"ipc://{path}"


__all__ = ["listen", "connect", "connect_blocking", "is_stream", "local_address"]
