"""A worker gives back what a burst left: output segments that fell idle once their blocks
came back, mappings of frontends' input segments no batch reads any more; its
housekeeping thread runs from start_housekeeping() until close()."""
from __future__ import annotations

import threading
import time

from services.common import shm
from services.common.client_shm import RegionMap
from services.common.shm import IDLE_S, Arena, SegmentMap
from services.workers.main import Worker
from services.workers.results import ResultSender

KIB = 1024


class _Sock:
    def close(self) -> None:
        pass


def _worker(arena: Arena) -> Worker:
    w = Worker.__new__(Worker)          # no scheduler, no model: only the tidying is exercised
    w.hub, w.direct = None, None       # (no direct path)
    w.arena, w.segments, w.regions = arena, SegmentMap(), RegionMap()
    w.backend, w.sock, w.lock = None, _Sock(), threading.Lock()
    w.housekeeper, w._housekeeping = shm.Housekeeper(arena, w.segments), threading.Event()
    w.results = ResultSender(w.sock, "", arena, w.lock)
    return w


def _until(cond, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def test_housekeep_gives_back_released_outputs_and_unread_inputs():
    frontend = Arena("in", segment_size=64 * KIB)
    w = _worker(Arena("out", segment_size=64 * KIB))
    try:
        inp = frontend.alloc(16)
        inp.view[:] = b"i" * 16
        assert bytes(w.segments.view(inp.segment, inp.offset, 16)) == b"i" * 16
        outs = [w.arena.alloc(64 * KIB)[:2] for _ in range(2)]   # a burst: two segments
        w.housekeeper.busy = True
        # Outputs still lent: nothing of the arena goes; the input was read this tick.
        assert not w.housekeep(time.monotonic() + IDLE_S + 1)
        assert len(w.arena.segments) == 2 and inp.segment in w.segments
        assert not w.housekeeper.busy
        w.results.release(outs)                                          # the frontend is done
        assert w.housekeep(time.monotonic() + IDLE_S + 1)
        assert w.arena.segments == [outs[0][0]]
        assert inp.segment not in w.segments                     # no batch read it since
        # The next batch maps it again.
        assert bytes(w.segments.view(inp.segment, inp.offset, 16)) == b"i" * 16
    finally:
        w.close()
        frontend.close()


def test_the_housekeeping_thread_runs_until_close():
    frontend = Arena("in", segment_size=64 * KIB)
    w = _worker(Arena("out", segment_size=64 * KIB))
    try:
        inp = frontend.alloc(16)
        w.segments.view(inp.segment, inp.offset, 16)
        thread = w.start_housekeeping(period=0.01)
        _until(lambda: inp.segment not in w.segments, what="a sweep")
    finally:
        w.close()
        frontend.close()
    thread.join(5.0)
    assert not thread.is_alive()
