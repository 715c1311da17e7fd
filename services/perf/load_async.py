"""What the asyncio load processes share (tritonclient's gRPC path and the lean paths): the
event loop (uvloop), the control loop on the profiler's pipe, and the request-rate schedule.

    profiler ──pipe──▶ control reader (loop.add_reader) ──handle──▶ WorkerState
                          │ load.apply(): start what the targets ask for
                          ▼
                   slots / rate_schedule ──fire(plan, flags)──▶ the runtime's requests
    ("stop": load.drain(), the answer, then the process ends)
"""
from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from services.perf.worker_core import DELAYED, Planned, WorkerSpec, WorkerState, now_ns

MAX_IN_FLIGHT = 4096   # request-rate mode: the most requests one process keeps open
LATE_NS = 1_000_000    # a request sent this late after its schedule counts as delayed
DRAIN_S = 30.0


class AsyncLoad(Protocol):
    def apply(self) -> None: ...

    async def drain(self) -> None: ...


async def rate_schedule(state: WorkerState, spec: WorkerSpec, rng: random.Random,
                        fire: Callable[[Planned, int], Any], in_flight: Callable[[], int]) -> None:
    """Fire requests at the level's rate (this process's share, at its phase) until the rate
    is 0, the budget is spent or the load stops; `fire(plan, flags)` starts one."""
    cursor = state.source.slot(0)
    rate, local, next_t = 0.0, 1.0, 0
    while state.rate > 0 and not state.stopping:
        if state.rate != rate:   # (a new level: restart the schedule, this process's phase)
            rate = state.rate
            local = rate / spec.processes
            next_t = now_ns() + int(state.phase * 1e9)
        while in_flight() >= MAX_IN_FLIGHT:
            await asyncio.sleep(0.001)
        if not state.may_start():
            break
        # (perf_analyzer's rule: late before the wait, not by the wait's own wake-up)
        wait = next_t - now_ns()
        late = wait < -LATE_NS
        if late:
            state.delayed += 1
        elif wait > 0:
            await asyncio.sleep(wait / 1e9)
        fire(cursor.next(), DELAYED if late else 0)
        gap = 1.0 / local if state.distribution == "constant" else rng.expovariate(local)
        next_t += int(gap * 1e9)


async def _serve(conn: Any, spec: WorkerSpec,
                 make: Callable[[WorkerSpec, WorkerState], Awaitable[tuple[AsyncLoad, Any]]]
                 ) -> None:
    loop = asyncio.get_running_loop()
    state = WorkerState(spec)
    load, close = await make(spec, state)
    done = loop.create_future()

    def on_message() -> None:
        msg = conn.recv()
        reply = state.handle(msg)
        if msg[0] == "stop":
            loop.remove_reader(conn.fileno())
            done.set_result(reply)
            return
        load.apply()
        conn.send(reply)

    loop.add_reader(conn.fileno(), on_message)
    os.set_blocking(conn.fileno(), True)   # (uvloop made it non-blocking: a large answer
    conn.send(("ready", None))              # would fail with EAGAIN mid-write)
    try:
        reply = await done
        await load.drain()
        conn.send(reply)
    finally:
        if close is not None:
            close()


def serve(conn: Any, spec: WorkerSpec,
          make: Callable[[WorkerSpec, WorkerState], Awaitable[tuple[AsyncLoad, Any]]],
          fast_loop: bool = True) -> None:
    """Run a load process: `make(spec, state)` (on the loop) builds the load and what closes
    its resources at the end (or None). `fast_loop`: on uvloop (grpc.aio keeps asyncio's
    own loop: it supports no other)."""
    if fast_loop:
        import uvloop
        uvloop.run(_serve(conn, spec, make))
    else:
        asyncio.run(_serve(conn, spec, make))
