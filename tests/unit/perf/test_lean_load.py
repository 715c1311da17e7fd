"""The lean load's slots against a small in-process HTTP/1.1 server: one connection per
slot, the request budget exactly, the pre-built bytes on the wire, the first error ending
the load, and a connection the server closes replaced."""
from __future__ import annotations

import asyncio

import numpy as np

from services.perf.flags import SslSettings
from services.perf.lean_http import http_request
from services.perf.load_lean import LeanLoad, why_not_lean
from services.perf.model import ModelInfo, Tensor
from services.perf.worker_core import RECORD, WorkerSpec, WorkerState


class Server:
    """Answers each request 200 (`fail_at`: that request 400; `close_every`: Connection:
    close after every n-th)."""

    def __init__(self, fail_at: int = 0, close_every: int = 0) -> None:
        self.fail_at, self.close_every = fail_at, close_every
        self.requests: list[bytes] = []
        self.connections = 0
        self.tasks: list[asyncio.Task] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.tasks.append(asyncio.current_task())   # type: ignore[arg-type]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(head.lower().split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(n))
                k = len(self.requests)
                close = self.close_every and k % self.close_every == 0
                if k == self.fail_at:
                    body = b'{"error":"no"}'
                    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\n" + (b"Connection: close\r\n" if close
                                                          else b"") + b"Content-Length: 2\r\n\r\n{}")
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def spec(port: int) -> WorkerSpec:
    x = np.ones((1, 4), np.float32)
    return WorkerSpec(index=0, processes=1, protocol="http", url=f"127.0.0.1:{port}",
                      ssl=SslSettings(), headers={}, model="m", version="",
                      inputs=[Tensor("X", "FP32", [-1, 4])], outputs=[Tensor("Y", "FP32", [-1, 4])],
                      requests=[{"X": x}, {"X": 2 * x}], streams=[], sequence=None, lean=True)


def run(server: Server, concurrency: int, budget: int) -> tuple[WorkerState, LeanLoad, WorkerSpec]:
    async def main() -> tuple[WorkerState, LeanLoad, WorkerSpec]:
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        s = spec(srv.sockets[0].getsockname()[1])
        state = WorkerState(s)
        load = LeanLoad(s, state)
        state.handle(("load", {"concurrency": concurrency}, budget))
        load.apply()
        await load.drain()   # (the budget spent, or an error: every slot ends by itself)
        await asyncio.gather(*server.tasks)   # (each ends at its connection's close)
        srv.close()
        await srv.wait_closed()
        return state, load, s
    return asyncio.run(main())


def test_one_connection_per_slot_and_the_budget_exactly():
    server = Server()
    state, load, s = run(server, concurrency=3, budget=10)
    rows = np.frombuffer(state.handle(("collect",))["records"], RECORD)   # type: ignore[index]
    assert len(rows) == 10 and state.error is None and state.sent == 10
    assert (rows["end"] >= rows["start"]).all() and (rows["send"] >= 0).all()
    assert server.connections == 3 and len(server.requests) == 10
    assert set(server.requests) == {http_request(s, r) for r in s.requests}


def test_the_first_error_ends_the_load_with_its_text():
    server = Server(fail_at=4)
    state, load, _ = run(server, concurrency=2, budget=100)
    assert state.error == "[400] no"
    assert len(server.requests) < 100 and state.completed == len(server.requests) - 1


def test_a_connection_the_server_closes_is_replaced():
    server = Server(close_every=3)
    state, load, _ = run(server, concurrency=1, budget=7)
    assert state.error is None and state.completed == 7 and server.connections == 3


def test_what_stays_on_tritonclient():
    from services.perf.flags import PerfSettings
    plain = ModelInfo("m", "1", 8, [], [], "none")
    assert why_not_lean(PerfSettings(model="m"), plain) is None
    assert why_not_lean(PerfSettings(model="m", shared_memory="system"), plain) == \
        "--shared-memory system"
    assert why_not_lean(PerfSettings(model="m", protocol="grpc", streaming=True), plain) == \
        "--streaming"
