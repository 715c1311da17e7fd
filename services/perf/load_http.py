"""A load-generating process over HTTP: tritonclient.http (geventhttpclient) on gevent's loop,
one greenlet and one connection per concurrency slot, or (request-rate mode) a scheduler
greenlet that fires each request on a connection of a pool.

    profiler ──pipe──▶ control loop (waits on the pipe's fd cooperatively)
                          │ sets targets
                          ▼
               slot greenlets / rate scheduler ──infer()──▶ server
                          │ record(start, end, send, recv)
                          ▼
                      WorkerState (answers "collect")

The client's time split: "send" is tritonclient building the body, up to the moment its
plugin hook runs just before the bytes go out; "recv" is decoding the outputs.
"""
from __future__ import annotations

import random
from typing import Any

from services.perf import clients
from services.perf.payload import Payload
from services.perf.worker_core import DELAYED, SEQUENCE_END, Planned, WorkerSpec, WorkerState, now_ns

MAX_IN_FLIGHT = 4096   # request-rate mode: the most requests one process keeps open
LATE_NS = 1_000_000    # a request sent this late after its schedule counts as delayed
DRAIN_S = 30.0


class _SentAt:
    """tritonclient plugin: called with the request right before it is sent."""

    sent = 0

    def __call__(self, request: Any) -> None:
        self.sent = now_ns()


class HttpLoad:
    def __init__(self, spec: WorkerSpec, state: WorkerState, payload: Payload) -> None:
        self.spec, self.state, self.payload = spec, state, payload
        self.slots: dict[int, Any] = {}
        self.scheduler: Any = None
        self.pool: list[tuple[Any, _SentAt]] = []
        self.in_flight: set[Any] = set()
        self.rng = random.Random(spec.seed * 104729 + spec.index)

    def _client(self) -> tuple[Any, _SentAt]:
        if self.pool:
            return self.pool.pop()
        c = clients.http_client(self.spec.url, self.spec.ssl)
        hook = _SentAt()
        c.register_plugin(hook)
        return c, hook

    def one(self, conn: tuple[Any, _SentAt], plan: Planned, flags: int = 0) -> None:
        spec, state, payload = self.spec, self.state, self.payload
        client, hook = conn
        outputs, entry = payload.take_outputs()
        t0 = now_ns()
        try:
            result = client.infer(spec.model, payload.inputs[plan.data], model_version=spec.version,
                                  outputs=outputs, sequence_id=plan.sequence_id,
                                  sequence_start=plan.start, sequence_end=plan.end,
                                  headers=dict(spec.headers) if spec.headers else None,
                                  parameters=spec.parameters or None)
            t1 = now_ns()
            payload.read(result, entry)
        except Exception as e:   # noqa: BLE001  (every failure ends the run, with its text)
            state.fail(str(e) or type(e).__name__)
            return
        finally:
            payload.give_outputs(entry)
        t2 = now_ns()
        send = hook.sent - t0 if hook.sent >= t0 else 0
        state.record(t0, t2, send, t2 - t1, 1, flags | (SEQUENCE_END if plan.end else 0))

    def _slot(self, i: int) -> None:
        state = self.state
        cursor = state.source.slot(i)
        conn = self._client()
        try:
            # (a slot whose sequence is open finishes it before it leaves)
            while (i < state.concurrency or cursor.left > 0) and state.may_start():
                self.one(conn, cursor.next())
        finally:
            self.pool.append(conn)

    def _fire(self, plan: Planned, flags: int) -> None:
        conn = self._client()
        try:
            self.one(conn, plan, flags)
        finally:
            self.pool.append(conn)

    def _schedule(self) -> None:
        import gevent  # type: ignore[import-untyped]
        state = self.state
        cursor = state.source.slot(0)
        rate, local, next_t = 0.0, 1.0, 0
        while state.rate > 0 and not state.stopping:
            if state.rate != rate:   # (a new level: restart the schedule, this process's phase)
                rate = state.rate
                local = rate / self.spec.processes
                next_t = now_ns() + int(state.phase * 1e9)
            while len(self.in_flight) >= MAX_IN_FLIGHT:
                gevent.sleep(0.001)
            if not state.may_start():
                break
            # (perf_analyzer's rule: late before the wait, not by the wait's own wake-up)
            wait = next_t - now_ns()
            late = wait < -LATE_NS
            if late:
                state.delayed += 1
            elif wait > 0:
                gevent.sleep(wait / 1e9)
            g = gevent.spawn(self._fire, cursor.next(), DELAYED if late else 0)
            self.in_flight.add(g)
            g.link(self.in_flight.discard)
            gap = 1.0 / local if state.distribution == "constant" else self.rng.expovariate(local)
            next_t += int(gap * 1e9)

    def apply(self) -> None:
        """Start what the targets ask for (slots leave by themselves when lowered)."""
        import gevent
        for i in range(self.state.concurrency):
            g = self.slots.get(i)
            if g is None or g.dead:
                self.slots[i] = gevent.spawn(self._slot, i)
        if self.state.rate > 0 and (self.scheduler is None or self.scheduler.dead):
            self.scheduler = gevent.spawn(self._schedule)

    def drain(self) -> None:
        import gevent
        live = [g for g in [*self.slots.values(), self.scheduler, *self.in_flight] if g]
        gevent.joinall(live, timeout=DRAIN_S)
        gevent.killall([g for g in live if not g.dead], block=False)
        for c, _ in self.pool:
            c.close()
        self.pool = []


def serve(conn: Any, spec: WorkerSpec) -> None:
    import gevent.socket  # type: ignore[import-untyped]
    state = WorkerState(spec)
    control = clients.Control("http", spec.url, spec.ssl, spec.headers) \
        if spec.shared_memory == "system" else None
    payload = Payload(spec, control)
    load = HttpLoad(spec, state, payload)
    conn.send(("ready", None))
    try:
        while True:
            gevent.socket.wait_read(conn.fileno())
            msg = conn.recv()
            reply = state.handle(msg)
            if msg[0] == "stop":
                load.drain()
                conn.send(reply)
                return
            load.apply()
            conn.send(reply)
    finally:
        payload.close()
        if control is not None:
            control.close()
