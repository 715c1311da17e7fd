"""A frontend never waits forever on a scheduler that went away: when its
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
from services.dataplane.client import FIRST_CONNECT_S, SCHEDULER_DOWN_TEXT, SCHEDULER_LOST_TEXT, DataPlane
from services.dataplane.types import CoreRequest, InputTensor
from services.frontend.settings import FrontendSettings
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


@pytest.mark.parametrize("wire", ["unix", "ipc"])
def test_calls_fail_fast_until_the_scheduler_is_first_reached(tmp_path, wire):
    """A frontend started where no scheduler listens (yet, or ever: its own died at start)
    answers every call UNAVAILABLE at once, holding nothing; queued for a scheduler that
    never came, they used to hang, each with its request body. Served once it comes."""
    async def run():
        addr = f"{wire}://{tmp_path}/s.sock"
        dp = DataPlane(FrontendSettings(addr, f"{wire}://{tmp_path}/r.sock", use_shm=False))
        await asyncio.wait_for(dp.start(), FIRST_CONNECT_S + 2)
        sched = FakeScheduler(addr)
        try:
            for call in (dp.infer(_request()), dp.model_metadata("m", ""),
                         dp.repository_index(False)):
                with pytest.raises(TriremeError) as e:
                    await asyncio.wait_for(call, 0.5)
                assert (e.value.code, e.value.message) == (Code.UNAVAILABLE, SCHEDULER_DOWN_TEXT)
            assert not dp._pending and not dp.models._fetches and not dp.ready()
            await sched.start()
            await until(dp.ready, 10, "ready once the scheduler listens")
            assert len(sched.of(m.FrontendHello)) == 1
            call = asyncio.ensure_future(dp.infer(_request()))
            (req, _), = await until(sched.requests, what="the request")
            sched.send(m.InferResult(req.req_id, 1))
            assert (await call).outputs == []
        finally:
            dp.close()
            sched.stop()

    asyncio.run(run())


def test_a_caller_gone_during_a_model_info_fetch_fails_no_other_caller(tmp_path):
    """Requests for a model whose metadata is being fetched share one fetch: the first
    caller going away (its client disconnected) must not end the others' with its
    CancelledError (they would get no answer at all), and leaves nothing waiting."""
    async def run():
        async with plane(tmp_path) as (sched, dp):
            sched.hold_info = True
            first = asyncio.ensure_future(dp.infer(_request()))
            second = asyncio.ensure_future(dp.infer(_request()))
            (info,) = await until(lambda: sched.held_info, what="the model info fetch")
            first.cancel()
            await asyncio.sleep(0)   # (the cancel lands before the answer)
            sched.answer_info(info)
            (req, _), = await until(sched.requests, what="the second request")
            sched.send(m.InferResult(req.req_id, 1))
            assert (await asyncio.wait_for(second, 2)).outputs == []
            assert first.cancelled()
            assert not dp._pending and not dp.models._fetches

    asyncio.run(run())


def test_a_message_no_frontend_handles_is_dropped_and_logged(tmp_path, caplog):
    """The data plane's socket dispatches through one table; anything else is logged, and
    the connection goes on serving."""
    async def run():
        async with plane(tmp_path) as (sched, dp):
            with caplog.at_level("WARNING", logger="trireme.dataplane"):
                sched.send(m.WorkerReady("w0", 1))
                await until(lambda: "dropped a WorkerReady from the scheduler" in caplog.text,
                            what="the dropped message to be logged")
            call = asyncio.ensure_future(dp.model_metadata("m", ""))
            assert (await call)["name"] == "m"

    asyncio.run(run())
