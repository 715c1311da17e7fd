"""A stand-in for the scheduler's side of a frontend's connection, over a real transport:
answers model info and FrontendHello, records every message (with its frames) as it came,
and answers requests on demand. Shared by the data plane's unit tests."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from services.common import messages as m
from services.common import transport
from services.dataplane.client import DataPlane
from services.frontend.settings import FrontendSettings

POLL_S = 0.005


class FakeScheduler:
    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.messages: list[tuple[Any, list[bytes]]] = []   # every message, as it came
        self.peer: bytes | None = None
        self.hold_info = False                  # keep GetModelInfo unanswered (in held_info)
        self.held_info: list[m.GetModelInfo] = []

    async def start(self) -> None:
        self.listener = await transport.listen(self.addr, self.on_message)

    def stop(self) -> None:
        """The scheduler goes away: its listener closes and every connection is reset."""
        self.listener.close()

    def on_message(self, identity: bytes, parts: list) -> None:
        msg, frames = m.decode(parts)
        self.peer = identity
        self.messages.append((msg, [bytes(f) for f in frames]))
        if isinstance(msg, m.GetModelInfo) and self.hold_info:
            self.held_info.append(msg)
        elif isinstance(msg, m.GetModelInfo):
            self.answer_info(msg)
        elif isinstance(msg, m.FrontendHello):
            self.send(m.RepositoryChanged([], server_ready=True))

    def answer_info(self, msg: m.GetModelInfo) -> None:
        self.send(m.ModelInfo(msg.ctl_id, msg.model, versions={1: "READY"},
                              inputs=[m.IOSpec("X", "FP32", [-1])],
                              outputs=[m.IOSpec("Y", "FP32", [-1])]))

    def send(self, msg) -> None:
        assert self.peer is not None
        self.listener.send(self.peer, m.encode(msg))

    def requests(self) -> list[tuple[m.InferRequest, list[bytes]]]:
        """Every request received, each with the frames of the message it came in."""
        out = []
        for msg, frames in self.messages:
            if isinstance(msg, m.InferRequest):
                out.append((msg, frames))
            elif isinstance(msg, m.InferRequests):
                out.extend((r, frames) for r in msg.requests)
        return out

    def of(self, kind: type) -> list:
        return [msg for msg, _ in self.messages if isinstance(msg, kind)]


async def until(cond, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(POLL_S)


@contextlib.asynccontextmanager
async def plane(tmp_path, wire: str = "unix"):
    """A DataPlane connected to a FakeScheduler (``unix`` stream sockets or ZeroMQ ``ipc``),
    ready: model info fetches and the FrontendHello answered."""
    sched = FakeScheduler(f"{wire}://{tmp_path}/s.sock")
    await sched.start()
    dp = DataPlane(FrontendSettings(f"{wire}://{tmp_path}/s.sock", f"{wire}://{tmp_path}/r.sock",
                                    use_shm=False))
    await dp.start()
    try:
        await until(dp.ready, what="the data plane to be ready")
        yield sched, dp
    finally:
        dp.close()
        sched.stop()
