"""How the services reach each other: one interface, two wires, chosen by the address.

    unix:///path, stream://host:port   length-prefixed frames on a stream socket
                                       (transport_stream; the default of `trireme serve`)
    ipc:///path, tcp://host:port       ZeroMQ ROUTER/DEALER (transport_zmq)

Both give the same three ends: a ``Listener`` (bound; answers each peer by the identity it
announced; close() removes its socket file), a ``Connection`` (connects, queues while
disconnected, reconnects) on an asyncio loop, and a ``BlockingConnection`` for the worker's
synchronous loop. Received parts are memoryviews the handler may keep. Why two: ZeroMQ is
what deployments that name tcp:// or ipc:// addresses use; a plain stream socket costs a
quarter of ZeroMQ's latency per hop on this machine (see transport_stream). A peer in the
listener's own process (the in-process frontend) skips the wire (transport_inproc).
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from services.common import transport_inproc, transport_stream, transport_zmq

Parts = Sequence[Any]
"""One message: bytes-like parts (a kind byte and header first, then tensor frames)."""


class Listener(Protocol):
    """Bound end: answers each peer by the identity it announced."""

    address: str
    """Where peers reach it: the address given, with the port chosen at bind for port 0."""

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


async def listen(address: str, handler: Callable[[bytes, list[Any]], None],
                 on_lost: Callable[[bytes], None] | None = None) -> Listener:
    """A bound Listener on the running loop; ``handler(identity, parts)`` per message, and
    ``on_lost(identity)`` when a peer's connection closes (stream sockets only: ZeroMQ does
    not say, so whoever must know also watches for heartbeats)."""
    _check(address)
    if is_stream(address):
        listener: transport_stream.Listener | transport_zmq.Listener = \
            transport_stream.Listener(address, handler, on_lost)
    else:
        listener = transport_zmq.Listener(address, handler)
    await listener.start()
    if transport_inproc.enabled:   # peers in this process may connect without the socket
        return transport_inproc.Local(listener, handler, on_lost)
    return listener


def connect(address: str, handler: Callable[[list[Any]], None], identity: bytes = b"",
            on_state: Callable[[bool], None] | None = None) -> Connection:
    """A Connection on the running loop; ``handler(parts)`` per message. ``on_state(True)``
    each time the connection is (re)established, ``on_state(False)`` each time it breaks
    (the peer closed or died; ZeroMQ: its heartbeat timed out): what was sent and not yet
    answered may never be."""
    _check(address)
    local = transport_inproc.bound(address)
    if local is not None:
        conn: transport_stream.Connection | transport_zmq.Connection | transport_inproc.Connection = \
            transport_inproc.Connection(local, handler, identity, on_state)
    elif is_stream(address):
        conn = transport_stream.Connection(address, handler, identity, on_state)
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


_PATH_SCHEMES = ("unix://", "ipc://")
_WILDCARDS = ("0.0.0.0", "*", "", "::", "[::]")
_RESOLVE_S = 60.0   # how long a piece started before its scheduler's name resolves waits


def result_address(scheduler_addr: str, name: str) -> str:
    """Where a client of the scheduler at ``scheduler_addr`` (a frontend, a BLS client)
    takes its results, which workers send straight to it. A scheduler reached by a path
    runs on this host with its workers: a socket path here. Otherwise the workers may be
    in other containers or on other hosts: a TCP port (chosen at bind) on the address this
    host reaches the scheduler from, which is one they can reach too."""
    if scheduler_addr.startswith(_PATH_SCHEMES):
        return local_address(scheduler_addr, name)
    host, port = _host_port(scheduler_addr)
    return f"stream://{_source_ip(host, port)}:0"


def reachable(address: str, via: str) -> str:
    """``address`` as seen from a peer that reaches its host as ``via`` does: a wildcard
    host (a listener bound to every interface) becomes ``via``'s host."""
    if address.startswith(_PATH_SCHEMES) or via.startswith(_PATH_SCHEMES):
        return address
    host, port = _host_port(address)
    if host not in _WILDCARDS:
        return address
    scheme = address.split("://", 1)[0]
    return f"{scheme}://{_host_port(via)[0]}:{port}"


def _host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[1]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def _source_ip(host: str, port: int) -> str:
    """The local address packets to (host, port) leave from (no packet is sent)."""
    deadline = time.monotonic() + _RESOLVE_S
    while True:
        try:
            infos = socket.getaddrinfo(host or "127.0.0.1", port or 9, type=socket.SOCK_DGRAM)
            family, _, _, _, sockaddr = infos[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                ip = s.getsockname()[0]
            return f"[{ip}]" if ":" in ip else ip
        except OSError as e:
            if time.monotonic() > deadline:
                raise OSError(f"cannot resolve the scheduler host '{host}': {e}") from e
            time.sleep(0.5)


__all__ = ["Listener", "Connection", "BlockingConnection", "Parts", "listen", "connect",
           "connect_blocking", "is_stream", "local_address", "result_address", "reachable"]
