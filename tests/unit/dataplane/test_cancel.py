"""Request cancellation in the data plane: the frontend's Cancel messages, over Unix
sockets to a fake scheduler."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.common import messages as m
from services.common import transport
from services.common.errors import Code
from services.dataplane.client import DataPlane
from services.dataplane.types import CoreRequest, InputTensor
from services.frontend.settings import FrontendSettings


# ------------------------------------------------------------------ frontend Cancel messages
class FakeScheduler:
    """The scheduler's side of a frontend's connection: answers model info, records the rest."""

    def __init__(self, addr: str) -> None:
        self.addr, self.got, self.peer = addr, [], None

    async def start(self) -> None:
        self.listener = await transport.listen(self.addr, self.on_message)

    def on_message(self, identity: bytes, parts: list) -> None:
        msg, _ = m.decode(parts)
        self.peer = identity
        if isinstance(msg, m.GetModelInfo):
            self.send(m.ModelInfo(msg.ctl_id, msg.model, versions={1: "READY"},
                                  inputs=[m.IOSpec("X", "FP32", [1])],
                                  outputs=[m.IOSpec("Y", "FP32", [1])]))
        elif isinstance(msg, m.InferRequests):
            self.got.extend(msg.requests)
        else:
            self.got.append(msg)

    def send(self, msg) -> None:
        self.listener.send(self.peer, m.encode(msg))

    async def next(self, kind: type):
        for _ in range(500):
            for msg in self.got:
                if isinstance(msg, kind):
                    self.got.remove(msg)
                    return msg
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind.__name__} came; got {self.got}")


def _request(model: str = "m") -> CoreRequest:
    return CoreRequest(model, inputs=[InputTensor("X", "FP32", [1], b"\0\0\0\0")])


@contextlib.asynccontextmanager
async def _plane(tmp_path):
    """A DataPlane talking to a FakeScheduler over Unix sockets in tmp_path."""
    sched = FakeScheduler(f"unix://{tmp_path}/s.sock")
    await sched.start()
    dp = DataPlane(FrontendSettings(f"unix://{tmp_path}/s.sock", f"unix://{tmp_path}/r.sock",
                                    use_shm=False))
    await dp.start()
    try:
        yield sched, dp
    finally:
        dp.close()
        sched.listener.close()


def test_caller_gone_sends_one_cancel_per_version_and_turn(tmp_path):
    async def run():
        async with _plane(tmp_path) as (sched, dp):
            calls = [asyncio.ensure_future(dp.infer(_request())) for _ in range(3)]
            reqs = [await sched.next(m.InferRequest) for _ in calls]
            calls[0].cancel()
            calls[2].cancel()
            cancel = await sched.next(m.Cancel)
            assert cancel == m.Cancel(f"unix://{tmp_path}/r.sock", "m", 1,
                                      [reqs[0].req_id, reqs[2].req_id])
            # The scheduler's CANCELLED answers reach nobody; the live call is unaffected.
            for r in (reqs[0], reqs[2]):
                sched.send(m.InferResult(r.req_id, error=m.ErrorRecord(int(Code.CANCELLED), "x")))
            sched.send(m.InferResult(reqs[1].req_id, 1))
            assert (await calls[1]).outputs == []
            for c in (calls[0], calls[2]):
                with pytest.raises(asyncio.CancelledError):
                    await c
            assert [g for g in sched.got if isinstance(g, m.Cancel)] == []

    asyncio.run(run())


def test_stream_abandoned_before_its_final_response_is_cancelled(tmp_path):
    async def run():
        async with _plane(tmp_path) as (sched, dp):
            done, gone = dp.infer_stream(_request()), dp.infer_stream(_request())
            first = asyncio.ensure_future(done.__anext__())
            second = asyncio.ensure_future(gone.__anext__())
            a, b = await sched.next(m.InferRequest), await sched.next(m.InferRequest)
            sched.send(m.InferResult(a.req_id, 1, final=True))
            sched.send(m.InferResult(b.req_id, 1, final=False))
            assert (await first).final and not (await second).final
            await done.aclose()                    # after its final response: nothing to cancel
            await gone.aclose()                    # mid-stream
            assert await sched.next(m.Cancel) == m.Cancel(
                f"unix://{tmp_path}/r.sock", "m", 1, [b.req_id])
            # A later request on the same connection arrives after any second Cancel would.
            later = asyncio.ensure_future(dp.infer(_request()))
            await sched.next(m.InferRequest)
            assert not [g for g in sched.got if isinstance(g, m.Cancel)]
            later.cancel()

    asyncio.run(run())


def test_cancel_round_trips_through_the_wire_encoding():
    msg = m.Cancel("unix:///tmp/r", "model", 2, [5, 6])
    assert m.decode(m.encode(msg)) == (msg, [])
    assert m.decode(m.encode(msg), for_worker=True) == (msg, [])
    assert m.encode(msg)[0] == bytes([m.Kind.CANCEL])


def test_a_result_that_arrives_while_its_caller_is_cancelled_frees_the_inputs(tmp_path):
    """The caller's task is cancelled (its future with it) and, before the task runs again,
    the request's result arrives: nobody waits for it, and the caller has not yet said it
    left. The inputs are freed all the same, and no Cancel goes for an answered request."""
    async def run():
        sched = FakeScheduler(f"unix://{tmp_path}/s.sock")
        await sched.start()
        dp = DataPlane(FrontendSettings(f"unix://{tmp_path}/s.sock", f"unix://{tmp_path}/r.sock",
                                        inline_threshold=0))
        await dp.start()
        try:
            arena = dp._arena
            assert arena is not None
            call = asyncio.ensure_future(dp.infer(_request()))
            req = await sched.next(m.InferRequest)
            assert req.inputs[0].segment and arena.used_bytes
            call.cancel()                               # the client's deadline
            dp._on_result(b"", m.encode(m.InferResult(req.req_id, 1)))   # same turn
            with pytest.raises(asyncio.CancelledError):
                await call
            assert arena.used_bytes == 0
            # the next Cancel to leave names only a later request: none went for this one
            later = asyncio.ensure_future(dp.infer(_request()))
            second = await sched.next(m.InferRequest)
            later.cancel()
            cancel = await sched.next(m.Cancel)
            assert cancel.req_ids == [second.req_id]
        finally:
            dp.close()
            sched.listener.close()

    asyncio.run(run())
