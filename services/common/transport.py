"""ZeroMQ plumbing shared by the services: sockets on an asyncio loop without a task per message.

zmq.asyncio wraps every recv in a future; at tens of thousands of messages a second that
cost shows. Instead the socket's file descriptor is watched with ``loop.add_reader`` and
drained with non-blocking receives, handing each multipart to a plain callback. ZeroMQ's
FD is edge-triggered, so after every send on the socket the reader is re-armed with a
drain on the next loop iteration (``kick``).
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

import zmq

log = logging.getLogger(__name__)

# Plain ints: pyzmq's enum.Flag arithmetic costs ~1 us per use on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

_HWM = 0  # no high-water mark: back-pressure is the scheduler's queue policy, not dropped frames


def context() -> zmq.Context:
    return zmq.Context.instance()


def socket(kind: int, *, identity: bytes | None = None) -> zmq.Socket:
    s = context().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, _HWM)
    s.setsockopt(zmq.RCVHWM, _HWM)
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # An unknown peer identity is an error, not a silent drop.
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return s


def ipc_path(address: str) -> str | None:
    return address[len("ipc://"):] if address.startswith("ipc://") else None


def remove_ipc(address: str) -> None:
    path = ipc_path(address)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Reader:
    """Delivers each multipart received on ``sock`` to ``handler`` from the event loop."""

    def __init__(self, sock: zmq.Socket, handler: Callable[[list[Any]], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.sock = sock
        self.handler = handler
        self.loop = loop or asyncio.get_running_loop()
        self._kicked = False
        self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        self.kick()

    def kick(self) -> None:
        """Re-check the socket soon (call after sending on it: the FD is edge-triggered)."""
        if not self._kicked:
            self._kicked = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._kicked = False
        sock = self.sock
        if sock.closed:
            return
        while sock.getsockopt(_EVENTS) & _POLLIN:
            try:
                parts = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                self.handler(parts)
            except Exception:  # a bad message must not kill the loop
                log.exception("error while handling a message")

    def close(self) -> None:
        if not self.sock.closed:
            try:
                self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
            except Exception:
                pass
            self.sock.close(0)
