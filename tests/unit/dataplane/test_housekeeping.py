"""The data plane gives back what a burst left: input segments that fell idle, mappings of
workers' output segments no response reads any more; responses handed out before keep
reading their outputs. Over Unix sockets to a fake scheduler, a test arena standing in
for a worker's."""
from __future__ import annotations

import asyncio
import contextlib
import time

from services.common import messages as m
from services.common.shm import IDLE_S, Arena, Housekeeper
from services.dataplane import client
from services.dataplane.client import DataPlane
from services.dataplane.types import CoreRequest, InputTensor
from services.frontend.settings import FrontendSettings
from tests.unit.dataplane.fake_scheduler import FakeScheduler, plane, until

KIB = 1024
N = 6 * KIB             # FP32 elements: 24 KiB a tensor, two to a 64 KiB segment


def mapped_in_process(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f
                   if line.rstrip().removesuffix(" (deleted)").endswith(f"/{name}"))


def _request(fill: int) -> CoreRequest:
    return CoreRequest("m", inputs=[InputTensor("X", "FP32", [N], bytes([fill]) * 4 * N)])


def _answer(sched: FakeScheduler, worker: Arena, req: m.InferRequest, fill: int) -> str:
    """Answer ``req`` with an output in the worker's arena, every byte ``fill``."""
    block = worker.alloc(4 * N)
    block.view[:] = bytes([fill]) * 4 * N
    sched.send(m.InferResult(req.req_id, 1, outputs=[m.TensorRef(
        "Y", "FP32", [N], 4 * N, segment=block.segment, offset=block.offset)]))
    return block.segment


@contextlib.asynccontextmanager
async def shm_plane(tmp_path):
    """A DataPlane with shared memory (every input in its arena, of 64 KiB segments) and no
    ticking of its own: the tests call housekeep() themselves."""
    sched = FakeScheduler(f"unix://{tmp_path}/s.sock")
    await sched.start()
    dp = DataPlane(FrontendSettings(f"unix://{tmp_path}/s.sock", f"unix://{tmp_path}/r.sock",
                                    inline_threshold=0))
    assert dp._arena is not None
    dp._arena.close()                  # (no segment yet) small segments: a burst of two
    dp._arena = Arena("in", segment_size=64 * KIB)
    dp._housekeeper = Housekeeper(dp._arena, dp._segments)
    await dp.start()
    if dp._tick is not None:
        dp._tick.cancel()
    worker = Arena("out", segment_size=64 * KIB)
    try:
        await until(dp.ready, what="the data plane to be ready")
        yield sched, dp, worker
    finally:
        dp.close()
        sched.stop()
        worker.close()


def test_a_burst_is_given_back_and_responses_keep_their_outputs(tmp_path):
    async def run():
        async with shm_plane(tmp_path) as (sched, dp, worker):
            arena = dp._arena
            calls = [asyncio.ensure_future(dp.infer(_request(i))) for i in (1, 2, 3)]
            got = await until(lambda: len(sched.requests()) == 3 and sched.requests())
            assert len(arena.segments) == 2            # the burst grew the input arena
            out_segs = {_answer(sched, worker, req, 10 + i) for i, (req, _) in enumerate(got)}
            resps = await asyncio.gather(*calls)
            assert arena.used_bytes == 0 and len(out_segs) == 2
            base = arena.segments[0]

            # Idle long enough: the input arena shrinks back to its first segment; the
            # workers' segments were read since the last tick, so stay mapped.
            assert dp.housekeep(time.monotonic() + IDLE_S + 1)
            assert arena.segments == [base]
            assert all(s in dp._segments for s in out_segs)
            # Nothing read them since: their mappings go, but the responses still read.
            assert dp.housekeep()
            assert not any(s in dp._segments for s in out_segs)
            for i, resp in enumerate(resps):
                assert bytes(resp.outputs[0].data) == bytes([10 + i]) * 4 * N
            # ... and the pages go with the last response that views them.
            for resp in resps:
                dp.release(resp)
            await until(lambda: len(sched.of(m.ReleaseBlocks)) >= 1, what="the release")
            del resps, resp, calls   # (a done future holds its response)
            assert all(mapped_in_process(s) == 1 for s in out_segs)   # the worker's own

            # A swept segment is mapped again by the next response that lives in it.
            call = asyncio.ensure_future(dp.infer(_request(7)))
            got = await until(lambda: len(sched.requests()) == 4 and sched.requests())
            assert got[-1][0].inputs[0].segment == base
            seg = _answer(sched, worker, got[-1][0], 42)
            resp = await call
            assert bytes(resp.outputs[0].data) == bytes([42]) * 4 * N
            assert seg in dp._segments
            dp.release(resp)

    asyncio.run(run())


def test_the_tick_runs_from_start_until_close(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "HOUSEKEEPING_S", 0.01)
    worker = Arena("out", segment_size=64 * KIB)
    block = worker.alloc(8)

    async def run():
        async with plane(tmp_path) as (_, dp):
            dp._segments.view(block.segment, block.offset, 8)
            assert block.segment in dp._segments
            await until(lambda: block.segment not in dp._segments, what="a sweep")
        assert dp._tick is not None and dp._tick.cancelled()   # the next one never comes

    try:
        asyncio.run(run())
    finally:
        worker.close()
