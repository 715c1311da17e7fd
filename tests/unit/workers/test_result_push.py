"""A worker's results reach a frontend that died and was respawned on the same result
address: the send on the dead connection is detected (on TCP too, which
accepts one write after the peer closed and loses it), the worker reconnects and sends once
more; a result that cannot be delivered frees its output blocks and costs no long stall."""
from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from services.common import messages as m
from services.common import transport_stream
from services.common.shm import Arena
from services.workers.results import ResultSender


class FakeFrontend:
    """A result socket as a frontend binds it, read with the wire's own framing."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.listener = transport_stream._bound_socket(address)
        self.listener.setblocking(True)
        self.conns: list[socket.socket] = []

    def receive(self, timeout: float = 5.0) -> list[m.InferResult]:
        """Accept the worker's (next) connection and read its identity and one message."""
        self.listener.settimeout(timeout)
        conn, _ = self.listener.accept()
        conn.settimeout(timeout)
        self.conns.append(conn)
        got: list[list] = []
        assembler = transport_stream._Assembler(lambda parts: got.append([bytes(p) for p in parts]))
        while len(got) < 2:                     # identity, then the message
            data = conn.recv(1 << 16)
            assert data, "the worker closed the connection"
            assembler.feed(data)
        msg, _ = m.decode(got[1])
        return [msg] if isinstance(msg, m.InferResult) else list(msg.results)

    def die(self) -> None:
        """kill -9: every socket of the process closes."""
        for c in self.conns:
            c.close()
        self.listener.close()


class SchedulerSocket:
    """The worker's scheduler connection: what it sent (relayed results)."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def send(self, parts) -> None:
        self.sent.append([bytes(p) for p in parts])


def _worker(arena: Arena | None = None) -> ResultSender:
    """A worker's result path alone (no scheduler: its socket records what is relayed)."""
    w = ResultSender(SchedulerSocket(), "unix:///nonexistent/scheduler.sock", arena,
                     threading.Lock())
    w.model = "m"
    return w


def _push(w: ResultSender, address: str, msg) -> None:
    with w.lock:                        # as flush calls it
        w.push(address, msg, [])


def _address(kind: str, tmp_path) -> str:
    if kind == "unix":
        return f"unix://{tmp_path}/results.sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"stream://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["unix", "stream"])
def test_results_reach_a_respawned_frontend(kind, tmp_path):
    address = _address(kind, tmp_path)
    w = _worker()
    first = FakeFrontend(address)
    _push(w, address, m.InferResult(1))
    assert [r.req_id for r in first.receive()] == [1]
    first.die()
    again = FakeFrontend(address)       # respawned: listening before it sends any request
    try:
        _push(w, address, m.InferResults([m.InferResult(2), m.InferResult(3)]))
        assert [r.req_id for r in again.receive()] == [2, 3]
        _push(w, address, m.InferResult(4))     # the new connection is kept
        with pytest.raises(TimeoutError):
            again.receive(timeout=0.2)          # ... so no new connection comes
    finally:
        again.die()
        for c in w.pushers.values():
            c.close()


@pytest.mark.parametrize("kind", ["unix", "stream"])
def test_an_undeliverable_result_frees_its_blocks_quickly(kind, tmp_path):
    address = _address(kind, tmp_path)
    arena = Arena("out")
    try:
        w = _worker(arena)
        gone = FakeFrontend(address)
        _push(w, address, m.InferResult(1))
        gone.receive()
        gone.die()                              # and nobody listens there any more

        def result(req_id: int) -> m.InferResult:
            block = arena.alloc(1 << 20)
            block.view[:] = np.zeros(1 << 20, np.uint8)
            return m.InferResult(req_id, outputs=[m.TensorRef(
                "Y", "UINT8", [1 << 20], 1 << 20, segment=block.segment, offset=block.offset)])

        for i in range(5):
            t0 = time.monotonic()
            _push(w, address, result(10 + i))
            # one quick reconnect try, never the first contact's wait
            assert time.monotonic() - t0 < 1.0
            assert arena.used_bytes == 0, "the undelivered result's block was not freed"
        assert address in w.unreachable and not w.pushers
    finally:
        arena.close()


def _result(arena: Arena, req_id: int, nbytes: int = 1 << 20) -> m.InferResult:
    block = arena.alloc(nbytes)
    return m.InferResult(req_id, outputs=[m.TensorRef(
        "Y", "UINT8", [nbytes], nbytes, segment=block.segment, offset=block.offset)])


def test_blocks_a_dead_frontend_never_released_are_freed_after_a_grace_period(tmp_path, monkeypatch):
    """Results the frontend received but never released (it died with them unread): the
    worker learns of the death on its next send there, and frees their blocks once a
    release the frontend may have sent before dying has had time to arrive."""
    import services.workers.results as worker_results
    monkeypatch.setattr(worker_results, "_ORPHAN_GRACE_S", 0.3)
    address = f"unix://{tmp_path}/results.sock"
    arena = Arena("out")
    first = FakeFrontend(address)
    try:
        w = _worker(arena)
        a, b, c = (_result(arena, i) for i in (1, 2, 3))
        _push(w, address, m.InferResults([a, b]))
        _push(w, address, c)
        first.receive()
        block = lambda r: (r.outputs[0].segment, r.outputs[0].offset)   # noqa: E731
        w.release([block(a)])               # released before the frontend died
        first.die()
        again = FakeFrontend(address)
        try:
            _push(w, address, m.InferResult(4))       # the death is found here
            assert [r.req_id for r in again.receive()] == [4]
            assert set(w.orphans) == {block(b), block(c)} and not w.lent
            w.release([block(b)])           # its release was on its way: freed at once
            assert arena.used_bytes == 1 << 20
            deadline = time.monotonic() + 5
            while arena.used_bytes:         # c goes after the grace period, on later traffic
                assert time.monotonic() < deadline, "the orphaned block was never freed"
                time.sleep(0.05)
                w.release([])
            assert not w.orphans
        finally:
            again.die()
            for conn in w.pushers.values():
                conn.close()
    finally:
        arena.close()


def test_a_result_the_wire_cannot_hold_becomes_an_error_for_its_request_alone(tmp_path):
    """A model's value msgpack cannot encode fails its own request; the other results of
    the batch for that frontend still go (as one message)."""
    address = f"unix://{tmp_path}/results.sock"
    arena = Arena("out")
    fe = FakeFrontend(address)
    try:
        w = _worker(arena)
        block = arena.alloc(1 << 20)
        bad = m.InferResult(2, outputs=[m.TensorRef("Y", "UINT8", [1 << 70], 1 << 20,
                                                    segment=block.segment, offset=block.offset)])
        _push(w, address, m.InferResults([m.InferResult(1), bad, m.InferResult(3)]))
        got = fe.receive()
        assert [r.req_id for r in got] == [1, 2, 3]
        assert got[0].error is None and got[2].error is None
        assert got[1].error is not None and "cannot be sent" in got[1].error.message
        assert arena.used_bytes == 0
    finally:
        fe.die()
        arena.close()


def test_a_blocking_send_to_a_closed_peer_fails(tmp_path):
    """TCP takes one write after the peer closed and loses it; the send says so instead."""
    address = _address("stream", tmp_path)
    fe = FakeFrontend(address)
    conn = transport_stream.BlockingConnection(address, b"", timeout=2.0)
    try:
        peer, _ = fe.listener.accept()
        peer.close()
        deadline = time.monotonic() + 5
        while not conn._peer_closed():          # the FIN arrives
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with pytest.raises(BrokenPipeError):
            conn.send([b"x", b"y"])
    finally:
        conn.close()
        fe.die()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"trireme-{os.getpid()}-")]


def test_results_for_an_unreachable_frontend_take_the_long_way(tmp_path):
    """A frontend's result socket the worker cannot reach (another host, another network):
    the results go to the scheduler as a Relay, whose frames are the result message as it
    would have been sent, for the scheduler to pass to that frontend's own connection."""
    address = _address("stream", tmp_path)      # nothing listens there
    w = _worker()
    t0 = time.monotonic()
    _push(w, address, m.InferResults([m.InferResult(1), m.InferResult(2, error=m.ErrorRecord(3, "x"))]))
    _push(w, address, m.InferResult(3))         # known unreachable: no second wait
    assert time.monotonic() - t0 < 2.5
    relayed = [m.decode(parts) for parts in w.sock.sent]
    assert [type(msg).__name__ for msg, _ in relayed] == ["Relay", "Relay"]
    assert {msg.reply_to for msg, _ in relayed} == {address}
    inner = [m.decode(frames)[0] for _, frames in relayed]
    assert [r.req_id for r in inner[0].results] == [1, 2] and inner[1].req_id == 3
    assert inner[0].results[1].error == m.ErrorRecord(3, "x")


def test_results_in_shared_memory_are_not_relayed(tmp_path):
    """Output blocks are readable only where our /dev/shm is: a frontend there that cannot
    be reached is gone, so its blocks are freed instead of relayed."""
    address = _address("stream", tmp_path)
    with Arena("relay", segment_size=1 << 16) as arena:
        w = _worker(arena)
        block = arena.alloc(100)
        _push(w, address, m.InferResult(1, outputs=[m.TensorRef(
            "OUT", "FP32", [25], 100, segment=block.segment, offset=block.offset)]))
        assert w.sock.sent == [] and arena.used_bytes == 0
