"""A load-generating process over gRPC: tritonclient.grpc.aio on an asyncio loop, one task and
one channel per concurrency slot, or (request-rate mode) a scheduler task firing requests on
one shared channel. --streaming: each slot (each request in flight, in request-rate mode)
owns a bidirectional ModelStreamInfer stream of the sync tritonclient, which is the one that
asks for the empty final response; a request ends at its final response, its latency at
its last non-empty one (perf_analyzer's rule), and every response counts.

    profiler ──pipe──▶ control reader (load_async: loop.add_reader)
                          │ sets targets
                          ▼
               slot tasks / rate_schedule ──ModelInfer / stream──▶ server
                          │ record(start, end, send, recv)
                          ▼
                      WorkerState (answers "collect")

The client's time split: tritonclient marshals the request inside infer(), so "send" is
not measured apart (0); "recv" is decoding the outputs.
"""
from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

from services.perf import clients, load_async
from services.perf.load_async import DRAIN_S, rate_schedule
from services.perf.payload import Payload
from services.perf.worker_core import SEQUENCE_END, Planned, WorkerSpec, WorkerState, now_ns


class _Stream:
    """One ModelStreamInfer stream; one request in flight on it at a time."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.client = clients.grpc_client(spec.url, spec.ssl)
        self.client.start_stream(self._callback, headers=spec.headers or None,
                                 compression_algorithm=spec.grpc_compression)
        self.waiter: asyncio.Future | None = None
        self.responses = 0
        self.last = 0
        self.read: Any = None

    def _callback(self, result: Any, error: Any) -> None:   # (on gRPC's thread)
        t = now_ns()
        self.loop.call_soon_threadsafe(self._on_response, result, error, t)

    def _on_response(self, result: Any, error: Any, t: int) -> None:
        w = self.waiter
        if w is None or w.done():
            return
        if error is not None:
            w.set_exception(error)
            return
        resp = result.get_response()
        if len(resp.outputs) > 0:
            self.responses += 1
            self.last = t
            if self.read is not None:
                self.read(result)
        final = resp.parameters["triton_final_response"].bool_param \
            if "triton_final_response" in resp.parameters else True
        if final:
            w.set_result(None)

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


class GrpcLoad:
    def __init__(self, spec: WorkerSpec, state: WorkerState, payload: Payload) -> None:
        self.spec, self.state, self.payload = spec, state, payload
        self.loop = asyncio.get_running_loop()
        self.slots: dict[int, asyncio.Task] = {}
        self.scheduler: asyncio.Task | None = None
        self.pool: list[Any] = []
        self.in_flight: set[asyncio.Task] = set()
        self.shared: Any = None
        self.ids = itertools.count(1)
        self.rng = random.Random(spec.seed * 104729 + spec.index)

    def _conn(self, own: bool) -> Any:
        if self.pool:
            return self.pool.pop()
        if self.spec.streaming:
            return _Stream(self.spec, self.loop)
        if not own:   # (request-rate mode: one channel multiplexes every request)
            if self.shared is None:
                self.shared = clients.grpc_aio_client(self.spec.url, self.spec.ssl)
            return self.shared
        return clients.grpc_aio_client(self.spec.url, self.spec.ssl)

    def _give(self, conn: Any) -> None:
        if conn is not self.shared:
            self.pool.append(conn)

    async def one(self, conn: Any, plan: Planned, flags: int = 0) -> None:
        spec, state, payload = self.spec, self.state, self.payload
        outputs, entry = payload.take_outputs()
        flags |= SEQUENCE_END if plan.end else 0
        kw = dict(model_version=spec.version, outputs=outputs, sequence_id=plan.sequence_id,
                  sequence_start=plan.start, sequence_end=plan.end,
                  parameters=spec.parameters or None)
        t0 = now_ns()
        try:
            if isinstance(conn, _Stream):
                recv = [0]

                def read(result: Any) -> None:
                    r0 = now_ns()
                    payload.read(result, entry)
                    recv[0] += now_ns() - r0
                conn.waiter, conn.responses, conn.last, conn.read = \
                    self.loop.create_future(), 0, 0, read
                conn.client.async_stream_infer(spec.model, payload.inputs[plan.data],
                                               request_id=str(next(self.ids)),
                                               enable_empty_final_response=True, **kw)
                await conn.waiter
                end = conn.last or now_ns()
                state.record(t0, end, 0, recv[0], conn.responses, flags)
                return
            result = await conn.infer(spec.model, payload.inputs[plan.data],
                                      headers=dict(spec.headers) if spec.headers else None,
                                      compression_algorithm=spec.grpc_compression, **kw)
            t1 = now_ns()
            payload.read(result, entry)
            t2 = now_ns()
            state.record(t0, t2, 0, t2 - t1, 1, flags)
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001  (every failure ends the run, with its text)
            state.fail(str(e) or type(e).__name__)
        finally:
            payload.give_outputs(entry)

    async def _slot(self, i: int) -> None:
        state = self.state
        cursor = state.source.slot(i)
        conn = self._conn(own=True)
        try:
            while (i < state.concurrency or cursor.left > 0) and state.may_start():
                await self.one(conn, cursor.next())
        finally:
            self._give(conn)

    async def _fire(self, plan: Planned, flags: int) -> None:
        conn = self._conn(own=False)
        try:
            await self.one(conn, plan, flags)
        finally:
            self._give(conn)

    def _fire_task(self, plan: Planned, flags: int) -> None:
        task = self.loop.create_task(self._fire(plan, flags))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _schedule(self) -> None:
        await rate_schedule(self.state, self.spec, self.rng, self._fire_task,
                            lambda: len(self.in_flight))

    def apply(self) -> None:
        for i in range(self.state.concurrency):
            t = self.slots.get(i)
            if t is None or t.done():
                self.slots[i] = self.loop.create_task(self._slot(i))
        if self.state.rate > 0 and (self.scheduler is None or self.scheduler.done()):
            self.scheduler = self.loop.create_task(self._schedule())

    async def drain(self) -> None:
        live = [t for t in [*self.slots.values(), self.scheduler, *self.in_flight] if t]
        if live:
            _, pending = await asyncio.wait(live, timeout=DRAIN_S)
            for t in pending:
                t.cancel()
        for c in self.pool:
            if isinstance(c, _Stream):
                c.close()
            else:
                await c.close()
        if self.shared is not None:
            await self.shared.close()


async def _make(spec: WorkerSpec, state: WorkerState) -> tuple[GrpcLoad, Any]:
    control = clients.Control("grpc", spec.url, spec.ssl, spec.headers) \
        if spec.shared_memory == "system" else None
    payload = Payload(spec, control)

    def close() -> None:
        payload.close()
        if control is not None:
            control.close()
    return GrpcLoad(spec, state, payload), close


def serve(conn: Any, spec: WorkerSpec) -> None:
    load_async.serve(conn, spec, _make, fast_loop=False)
