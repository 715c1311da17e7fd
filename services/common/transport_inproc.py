"""Messages between two ends that run on the same event loop: a Connection made to the
address of a Listener bound in this very process (`trireme serve --in-process-frontend`
puts its frontend beside the scheduler) skips the socket. Each message is still encoded and
framed by its sender and handed over whole, after the sender's call returns
(loop.call_soon: per-direction order kept, no handler re-entered from a send), so both ends
behave exactly as over a socket, less two system calls and a process wake-up per hop.

Off unless enable() was called (before the listeners are bound): then ``listen`` wraps each
Listener so that its send() reaches in-process peers too (other processes' peers as before),
and ``connect`` to such a Listener's address stays in the process.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

_bound: dict[str, Local] = {}      # address -> the Listener bound at it in this process
_names = itertools.count(1)
enabled = False


def enable() -> None:
    global enabled
    enabled = True


def _owned(parts: Sequence[Any]) -> list[memoryview]:
    """The parts as the receiver may keep them: a sender's mutable buffer (a reused
    bytearray, a view into a request body) is copied, as a socket would have."""
    return [memoryview(p) if isinstance(p, bytes) else memoryview(bytes(p)) for p in parts]


class Local:
    """A Listener wrapper: the wrapped Listener's peers as before, plus in-process ones."""

    def __init__(self, inner: Any, handler: Callable[[bytes, list], None],
                 on_lost: Callable[[bytes], None] | None) -> None:
        self.inner = inner
        self.address: str = inner.address   # (bound: the port chosen is in it)
        self.handler = handler
        self.on_lost = on_lost
        self.peers: dict[bytes, Connection] = {}
        _bound[inner.address] = self

    def send(self, identity: bytes, parts: Sequence[Any]) -> bool:
        peer = self.peers.get(identity)
        if peer is None:
            return bool(self.inner.send(identity, parts))
        asyncio.get_running_loop().call_soon(peer.deliver, _owned(parts))
        return True

    def close(self) -> None:
        if _bound.get(self.inner.address) is self:
            del _bound[self.inner.address]
        for peer in list(self.peers.values()):
            peer.lost()
        self.inner.close()


def bound(address: str) -> Local | None:
    return _bound.get(address)


class Connection:
    """The connecting end, in the listener's process: connected from the start; lost (as a
    broken socket) when the listener closes."""

    def __init__(self, listener: Local, handler: Callable[[list], None], identity: bytes = b"",
                 on_state: Callable[[bool], None] | None = None) -> None:
        self.listener: Local | None = listener
        self.handler = handler
        self.identity = identity or b"\x00inproc-%d" % next(_names)
        self.on_state = on_state

    def start(self) -> None:
        assert self.listener is not None
        self.listener.peers[self.identity] = self
        if self.on_state is not None:
            asyncio.get_running_loop().call_soon(self.on_state, True)

    def deliver(self, parts: list[memoryview]) -> None:
        if self.listener is not None:   # (none after close: as bytes a closed socket drops)
            self.handler(parts)

    def send(self, parts: Sequence[Any]) -> None:
        listener = self.listener
        if listener is None:
            return   # closed: what a closed socket would drop
        asyncio.get_running_loop().call_soon(self._arrive, listener, _owned(parts))

    def _arrive(self, listener: Local, parts: list[memoryview]) -> None:
        if listener.peers.get(self.identity) is self:
            listener.handler(self.identity, parts)

    def lost(self) -> None:
        """The listener closed: as a socket the peer closed."""
        self.listener = None
        if self.on_state is not None:
            self.on_state(False)

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None and listener.peers.get(self.identity) is self:
            del listener.peers[self.identity]
            if listener.on_lost is not None:
                listener.on_lost(self.identity)
