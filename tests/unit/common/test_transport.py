"""The transport between the services (services/common/transport*.py), over real sockets:
both wires (stream sockets and ZeroMQ) through the one interface, the stream framing under
arbitrary cuts, reconnects, identities, a malformed peer, and no leaked descriptors."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time

import pytest

from services.common import transport
from services.common.transport_stream import _Assembler, frame


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _address(kind: str, tmp_path) -> str:
    return {"unix": lambda: f"unix://{tmp_path}/l.sock",
            "stream": lambda: f"stream://127.0.0.1:{_free_port()}",
            "ipc": lambda: f"ipc://{tmp_path}/l.sock",
            "tcp": lambda: f"tcp://127.0.0.1:{_free_port()}"}[kind]()


KINDS = ["unix", "stream", "ipc", "tcp"]


def _fds() -> int:
    """Open sockets of this process. Only sockets: ZeroMQ's threads keep eventfd / epoll
    descriptors for the life of the process, which are not ours to count."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:   # the listing's own descriptor, already closed
            pass
    return n


def _no_fd_leak(before: int) -> None:
    """ZeroMQ closes a socket's connections in its reaper thread, a moment after close()."""
    deadline = time.monotonic() + 5
    while _fds() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _fds() == before


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.002)


def _bytes(parts) -> list[bytes]:
    return [bytes(p) for p in parts]


MESSAGES = [
    [b"\x01", b"header"],
    [b"\x02", b"", b"empty part before"],
    [b"\x03", b"x" * 70_000, b"y" * 3, os.urandom(1 << 20)],   # above the join threshold
    [b"\x04"] + [bytes([i]) * i for i in range(40)],
]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_and_answer_by_identity(kind, tmp_path):
    async def main():
        address = _address(kind, tmp_path)
        got: list[tuple[bytes, list[bytes]]] = []
        listener = await transport.listen(address, lambda ident, parts: got.append((ident, _bytes(parts))))
        answers: dict[bytes, list[list[bytes]]] = {b"a": [], b"b": []}
        conns = {ident: transport.connect(address, lambda parts, i=ident: answers[i].append(_bytes(parts)),
                                          identity=ident) for ident in answers}
        for ident, conn in conns.items():
            for msg in MESSAGES:
                conn.send([*msg, ident])
        await _until(lambda: len(got) == 2 * len(MESSAGES))
        for ident in answers:
            assert [p for i, p in got if i == ident] == [[*msg, ident] for msg in MESSAGES]
        # The listener answers each peer by the identity it announced.
        for ident in answers:
            assert listener.send(ident, [b"\x09", b"for " + ident])
        assert not listener.send(b"nobody", [b"\x09", b"lost"])
        await _until(lambda: all(answers.values()))
        assert answers == {b"a": [[b"\x09", b"for a"]], b"b": [[b"\x09", b"for b"]]}
        for conn in conns.values():
            conn.close()
        listener.close()
        assert not os.path.exists(tmp_path / "l.sock")   # the listener removes its socket file

    before = _fds()
    asyncio.run(main())
    _no_fd_leak(before)


@pytest.mark.parametrize("kind", ["unix", "stream", "ipc"])
def test_connection_queues_until_the_listener_binds(kind, tmp_path):
    """Sent before anyone listens (a frontend started before its scheduler): delivered, in
    order, once the listener is up."""
    async def main():
        address = _address(kind, tmp_path)
        got: list[list[bytes]] = []
        conn = transport.connect(address, lambda parts: None, identity=b"early")
        for i in range(5):
            conn.send([b"\x01", b"%d" % i])
        await asyncio.sleep(0.25)   # a couple of failed connection attempts happen here
        listener = await transport.listen(address, lambda ident, parts: got.append(_bytes(parts)))
        await _until(lambda: len(got) == 5)
        assert got == [[b"\x01", b"%d" % i] for i in range(5)]
        conn.close()
        listener.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["unix", "stream"])
def test_connection_comes_back_after_the_listener_restarts(kind, tmp_path):
    async def main():
        address = _address(kind, tmp_path)
        got: list[tuple[bytes, list[bytes]]] = []
        first = await transport.listen(address, lambda ident, parts: got.append((ident, _bytes(parts))))
        conn = transport.connect(address, lambda parts: None, identity=b"me")
        conn.send([b"\x01", b"one"])
        await _until(lambda: len(got) == 1)
        first.close()
        await _until(lambda: conn._transport is None)
        second = await transport.listen(address, lambda ident, parts: got.append((ident, _bytes(parts))))
        conn.send([b"\x01", b"two"])
        await _until(lambda: len(got) == 2)
        assert got == [(b"me", [b"\x01", b"one"]), (b"me", [b"\x01", b"two"])]
        conn.close()
        second.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_blocking_connection_from_many_threads(kind, tmp_path):
    """A worker's sends come from its loop and from a model's threads at once: every
    message arrives whole; recv() gets what the listener sends."""
    async def main():
        address = _address(kind, tmp_path)
        got: list[tuple[bytes, list[bytes]]] = []
        listener = await transport.listen(address, lambda ident, parts: got.append((ident, _bytes(parts))))
        conn = await asyncio.to_thread(transport.connect_blocking, address, b"w1")

        def sender(t: int) -> None:
            for i in range(50):
                conn.send([b"\x05", b"%d:%d" % (t, i), bytes([t]) * (i * 3000)])
        threads = [threading.Thread(target=sender, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        await _until(lambda: len(got) == 200 and not any(th.is_alive() for th in threads), 20)
        for t in range(4):
            mine = [parts for ident, parts in got if parts[1].startswith(b"%d:" % t)]
            assert mine == [[b"\x05", b"%d:%d" % (t, i), bytes([t]) * (i * 3000)] for i in range(50)]
        assert {ident for ident, _ in got} == {b"w1"}
        big = os.urandom(3 << 20)
        assert listener.send(b"w1", [b"\x06", big, b""])
        assert _bytes(await asyncio.to_thread(conn.recv)) == [b"\x06", big, b""]
        conn.close()
        listener.close()

    before = _fds()
    asyncio.run(main())
    _no_fd_leak(before)


@pytest.mark.parametrize("kind", ["unix", "stream"])
def test_blocking_recv_ends_when_the_listener_goes(kind, tmp_path):
    async def main():
        address = _address(kind, tmp_path)
        listener = await transport.listen(address, lambda ident, parts: None)
        conn = await asyncio.to_thread(transport.connect_blocking, address, b"w")
        await _until(lambda: b"w" in listener._peers)
        listener.close()
        with pytest.raises(EOFError):
            await asyncio.to_thread(conn.recv)
        conn.close()

    asyncio.run(main())


def test_blocking_connect_gives_up_after_its_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(OSError):
        transport.connect_blocking(f"unix://{tmp_path}/nobody.sock", timeout=0.3)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("seed", range(5))
def test_stream_framing_survives_any_cut(seed):
    """The same messages, whatever way the kernel cuts the byte stream."""
    rng = random.Random(seed)
    msgs = [[bytes([k]), os.urandom(rng.choice([0, 1, 5, 300, 70_000]))] +
            [os.urandom(rng.randrange(0, 2000)) for _ in range(rng.randrange(0, 4))]
            for k in range(60)]
    wire = b"".join(b"".join(bytes(b) for b in frame(parts)) for parts in msgs)
    got: list[list[bytes]] = []
    asm = _Assembler(lambda parts: got.append(_bytes(parts)))
    pos = 0
    while pos < len(wire):
        n = rng.choice([1, 2, 3, 4, 5, 7, 100, 4096, 65536, 200_000])
        asm.feed(wire[pos:pos + n])
        pos += n
    assert got == msgs


def test_malformed_peer_is_dropped_and_others_are_served(tmp_path):
    async def main():
        address = f"unix://{tmp_path}/l.sock"
        got: list[tuple[bytes, list[bytes]]] = []

        def handler(ident, parts):
            if parts[1] == b"boom":
                raise RuntimeError("a handler's own bug")   # logged, connection kept
            got.append((ident, _bytes(parts)))
        listener = await transport.listen(address, handler)
        good = transport.connect(address, lambda parts: None, identity=b"good")
        good.send([b"\x01", b"boom"])
        good.send([b"\x01", b"after"])
        bad = socket.socket(socket.AF_UNIX)
        await asyncio.get_running_loop().sock_connect(bad, f"{tmp_path}/l.sock")
        bad.sendall(b"".join(frame([b"bad"])) + b"\x03\x00\x00\x00zzz")   # size 3 < 4
        await _until(lambda: got == [(b"good", [b"\x01", b"after"])])
        await _until(lambda: b"bad" not in listener._peers)
        bad.setblocking(False)
        await _until(lambda: _closed(bad))
        bad.close()
        good.send([b"\x01", b"still"])
        await _until(lambda: len(got) == 2)
        good.close()
        listener.close()

    asyncio.run(main())


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_unsupported_address_is_refused():
    with pytest.raises(ValueError, match="unsupported address 'http://x'"):
        transport.connect_blocking("http://x")


@pytest.fixture
def in_process():
    from services.common import transport_inproc
    transport_inproc.enable()
    yield
    transport_inproc.enabled = False


def test_a_peer_in_the_listeners_process_skips_the_socket(in_process, tmp_path):
    """The in-process frontend's connection: same interface, order kept, each message
    handed over after send() returns (no handler re-entered), mutable buffers copied,
    other processes' peers still served through the socket."""
    async def main():
        address = f"unix://{tmp_path}/l.sock"
        got: list[tuple[bytes, list[bytes]]] = []
        lost: list[bytes] = []
        listener = await transport.listen(address, lambda i, parts: got.append((i, _bytes(parts))),
                                          on_lost=lost.append)
        states: list[bool] = []
        answers: list[list[bytes]] = []
        conn = transport.connect(address, lambda parts: answers.append(_bytes(parts)),
                                 identity=b"here", on_state=states.append)
        assert type(conn).__module__ == "services.common.transport_inproc"
        buf = bytearray(b"first")
        for msg in MESSAGES:
            conn.send([*msg])
        conn.send([b"\x01", buf])
        buf[:] = b"later"          # the receiver sees what was sent, as over a socket
        assert got == []           # nothing delivered inside send()
        await _until(lambda: len(got) == len(MESSAGES) + 1)
        assert got == [(b"here", [*m]) for m in MESSAGES] + [(b"here", [b"\x01", b"first"])]
        assert listener.send(b"here", [b"\x09", b"answer"])
        await _until(lambda: answers)
        assert answers == [[b"\x09", b"answer"]] and states == [True]
        # a peer of another process (here: a blocking socket connection) is served as before
        remote = await asyncio.to_thread(transport.connect_blocking, address, b"remote")
        remote.send([b"\x02", b"over the socket"])
        await _until(lambda: len(got) == len(MESSAGES) + 2)
        assert listener.send(b"remote", [b"\x09", b"back"])
        assert _bytes(await asyncio.to_thread(remote.recv)) == [b"\x09", b"back"]
        remote.close()
        conn.close()               # the listener hears of it as of a closed socket
        assert b"here" in lost and not listener.send(b"here", [b"\x09", b"gone"])
        conn2 = transport.connect(address, lambda parts: None, identity=b"again",
                                  on_state=states.append)
        await _until(lambda: states == [True, True])
        listener.close()           # and the connection of the listener's going
        assert states == [True, True, False]
        conn2.send([b"\x09", b"dropped"])   # as a closed socket: dropped, no error

    before = _fds()
    asyncio.run(main())
    _no_fd_leak(before)
