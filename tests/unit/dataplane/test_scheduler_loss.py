"""A frontend never waits forever on a scheduler that went away (issue 13, item 1): when its
connection to the scheduler breaks, every waiting request, stream and control call fails
UNAVAILABLE at once, new ones fail fast, health says not ready, and all of it comes back
with the scheduler. On both wires: stream sockets and ZeroMQ (its monitor events)."""
from __future__ import annotations

import asyncio
import os
import struct

import pytest

from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.dataplane.client import SCHEDULER_DOWN_TEXT, SCHEDULER_LOST_TEXT
from services.dataplane.types import CoreRequest, InputTensor
from tests.unit.dataplane.fake_scheduler import FakeScheduler, plane, until

LOSS_NOTICED_S = 2.0      # ZeroMQ reports a closed ipc peer within milliseconds too


def _request() -> CoreRequest:
    return CoreRequest("m", inputs=[InputTensor("X", "FP32", [1], struct.pack("<f", 1.0))])


@pytest.mark.parametrize("wire", ["unix", "ipc"])
def test_everything_waiting_fails_unavailable_when_the_scheduler_goes(tmp_path, wire):
    async def run():
        async with plane(tmp_path, wire) as (sched, dp):
            await dp.model_metadata("m", "")
            unary = [asyncio.ensure_future(dp.infer(_request())) for _ in range(3)]
            stream = dp.infer_stream(_request())
            first = asyncio.ensure_future(stream.__anext__())
            control = asyncio.ensure_future(dp.repository_index(False))   # never answered
            await until(lambda: len(sched.requests()) == 4 and sched.of(m.GetIndex),
                        what="the calls to reach the scheduler")
            (stream_req, _) = sched.requests()[3]
            sched.send(m.InferResult(stream_req.req_id, 1, final=False))   # one response
            assert not (await first).final

            sched.stop()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for call in [*unary, control]:
                with pytest.raises(TriremeError) as e:
                    await asyncio.wait_for(call, LOSS_NOTICED_S)
                assert (e.value.code, e.value.message) == (Code.UNAVAILABLE, SCHEDULER_LOST_TEXT)
            with pytest.raises(TriremeError) as e:
                await asyncio.wait_for(stream.__anext__(), LOSS_NOTICED_S)
            assert e.value.code == Code.UNAVAILABLE
            assert loop.time() - t0 < LOSS_NOTICED_S
            assert not dp.ready() and dp.live()
            assert not dp._pending
            # new calls fail fast, they do not queue
            for call in (dp.infer(_request()), dp.model_metadata("m", ""),
                         dp.repository_index(False)):
                with pytest.raises(TriremeError) as e:
                    await asyncio.wait_for(call, 0.5)
                assert (e.value.code, e.value.message) == (Code.UNAVAILABLE, SCHEDULER_DOWN_TEXT)

    asyncio.run(run())


@pytest.mark.parametrize("wire", ["unix", "ipc"])
def test_ready_again_when_the_scheduler_is_back(tmp_path, wire):
    async def run():
        async with plane(tmp_path, wire) as (sched, dp):
            await dp.model_metadata("m", "")
            sched.stop()
            await until(lambda: not dp.ready(), what="not ready")
            # the scheduler restarts on the same address: the frontend announces itself
            again = FakeScheduler(sched.addr)
            await again.start()
            try:
                await until(dp.ready, 10, "ready again")
                assert again.of(m.FrontendHello)
                call = asyncio.ensure_future(dp.infer(_request()))
                (req, _), = await until(again.requests, what="a request to the new scheduler")
                again.send(m.InferResult(req.req_id, 1))
                assert (await call).outputs == []
            finally:
                again.stop()

    asyncio.run(run())


def test_a_result_meant_for_an_earlier_process_matches_no_request(tmp_path):
    """`trireme serve` respawns a frontend on the same result address: results for the dead
    process's requests still arrive there. Its ids carry its pid, so none matches ours, and
    one for an ordered stream takes no place in our order."""
    async def run():
        async with plane(tmp_path) as (sched, dp):
            await dp.model_metadata("m", "")
            call = asyncio.ensure_future(dp.infer(_request()))
            (req, _), = await until(sched.requests)
            assert req.req_id >> 40 == os.getpid()
            stale = (os.getpid() + 1) << 40 | (req.req_id & ((1 << 40) - 1))   # same counter
            sched.send(m.InferResult(stale, 1, error=m.ErrorRecord(int(Code.INTERNAL), "stale")))
            sched.send(m.InferResult(stale, 1, stream=7, order=1))   # takes no order slot
            sched.send(m.InferResult(req.req_id, 1, stream=7, order=1))
            assert (await call).outputs == []

    asyncio.run(run())
