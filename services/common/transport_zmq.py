"""ZeroMQ ends of the transport interface (ipc:// and tcp:// addresses).

Sockets are driven on the asyncio loop without a task per message: zmq.asyncio wraps every
recv in a future, and at tens of thousands of messages a second that cost shows. Instead
the socket's file descriptor is watched with ``loop.add_reader`` and drained with
non-blocking receives. ZeroMQ's FD is edge-triggered, so after every send the reader is
re-armed with a drain on the next loop iteration (``_kick``).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

# Plain ints: pyzmq's enum.Flag arithmetic is a Python call per use on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

_HWM = 0  # no high-water mark: back-pressure is the scheduler's queue policy, not dropped frames
# A Connection that reports its state pings its peer (ZMTP heartbeats, answered by ZeroMQ
# itself): a peer host that vanished without closing is noticed within the timeout.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 5000


def _socket(kind: int, identity: bytes = b"") -> zmq.Socket:
    s: zmq.Socket = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, _HWM)
    s.setsockopt(zmq.RCVHWM, _HWM)
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # An unknown peer identity is an error, not a silent drop.
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return s


class _Driven:
    """A socket whose messages reach ``_deliver`` from the event loop."""

    sock: zmq.Socket

    def _watch(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._kicked = False
        self.loop.add_reader(self.sock.fileno(), self._drain)  # fileno(): getsockopt(zmq.FD)
        self._kick()

    def _kick(self) -> None:
        if not self._kicked:
            self._kicked = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._kicked = False
        sock = self.sock
        if sock.closed:
            return
        # EVENTS is an int option; pyzmq's stub types every getsockopt int | bytes, and a
        # cast() here would cost a call per message
        while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
            try:
                parts = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                self._deliver(parts)
            except Exception:  # a bad message must not kill the loop
                log.exception("error while handling a message")

    def _deliver(self, parts: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if not self.sock.closed:
            try:
                self.loop.remove_reader(self.sock.fileno())
            except Exception:  # noqa: BLE001 - best effort on close: the socket goes either way
                pass
            self.sock.close(0)


class Listener(_Driven):
    def __init__(self, address: str, handler: Callable[[bytes, list], None]) -> None:
        self.address = address
        self.handler = handler
        self.sock = _socket(zmq.ROUTER)

    async def start(self) -> None:
        self.sock.bind(self.address)
        self._watch()

    def _deliver(self, parts: list[zmq.Frame]) -> None:
        self.handler(parts[0].bytes, [f.buffer for f in parts[1:]])

    def close(self) -> None:
        super().close()
        if self.address.startswith("ipc://"):   # ZeroMQ leaves the socket file behind
            try:
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass

    def send(self, identity: bytes, parts: Sequence[Any]) -> bool:
        try:
            self.sock.send_multipart([identity, *parts], copy=False)
            return True
        except zmq.ZMQError as e:   # EHOSTUNREACH: that peer is gone
            log.debug("cannot reach %r: %s", identity, e)
            return False
        finally:
            self._kick()


class Connection(_Driven):
    def __init__(self, address: str, handler: Callable[[list], None], identity: bytes = b"",
                 on_state: Callable[[bool], None] | None = None) -> None:
        self.address = address
        self.handler = handler
        self.sock = _socket(zmq.DEALER, identity)
        self.on_state = on_state
        self._monitor: zmq.Socket | None = None
        if on_state is not None:
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)

    def start(self) -> None:
        if self.on_state is not None:   # before connect(): the first CONNECTED is seen
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.address)
        self._watch()
        if self._monitor is not None:
            self.loop.add_reader(self._monitor.fileno(), self._drain_monitor)
            self.loop.call_soon(self._drain_monitor)

    def _drain_monitor(self) -> None:
        """Connection events, as ZeroMQ reports them on the monitor socket (edge-triggered
        like any ZeroMQ FD: drained until empty)."""
        mon = self._monitor
        while mon is not None and not mon.closed and \
                mon.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
            try:
                event = recv_monitor_message(mon, _NOBLOCK)
            except zmq.Again:
                break
            assert self.on_state is not None   # a monitor exists only with a callback
            if event["event"] == zmq.EVENT_CONNECTED:
                self.on_state(True)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.on_state(False)

    def close(self) -> None:
        mon, self._monitor = self._monitor, None
        if mon is not None:
            try:
                self.loop.remove_reader(mon.fileno())
            except Exception:  # noqa: BLE001 - best effort on close: the socket goes either way
                pass
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(0)
        super().close()

    def _deliver(self, parts: list[zmq.Frame]) -> None:
        self.handler([f.buffer for f in parts])

    def send(self, parts: Sequence[Any]) -> None:
        self.sock.send_multipart(parts, copy=False)
        self._kick()


class BlockingConnection:
    """A DEALER for the worker's blocking loop; send() from any thread (under a lock:
    ZeroMQ sockets are not thread-safe)."""

    def __init__(self, address: str, identity: bytes = b"") -> None:
        self.address = address
        self.sock = _socket(zmq.DEALER, identity)
        self.sock.connect(address)
        self._lock = threading.Lock()

    def send(self, parts: Sequence[Any]) -> None:
        with self._lock:
            self.sock.send_multipart(parts, copy=False)

    def recv(self) -> list[memoryview]:
        while True:
            try:
                return [f.buffer for f in self.sock.recv_multipart(copy=False)]
            except zmq.ZMQError as e:
                if e.errno != errno.EINTR:
                    raise

    def close(self) -> None:
        self.sock.close(0)
