"""The scheduler's client: the transport-agnostic core that the HTTP and gRPC adapters call
(through DataPlaneAPI) and that BLS runs inside a Python model's worker.

    adapter ─CoreRequest─▶ DataPlane.infer ─validate─▶ inputs → frames | shared memory
           ─InferRequest─▶ scheduler ─▶ worker ─InferResult─▶ (result socket) ─▶ CoreResponse
                        └──▶ worker (a route: direct.py) ─InferResult─┘ (same connection)

Model metadata is cached per model and dropped when the scheduler broadcasts a change, so
validation costs no round trip. Input blocks are freed when the request's final answer
arrives, whoever waits for it; output blocks go back to their worker when the adapter calls
release(). A caller that goes away first (its task cancelled) cancels its request: the
scheduler drops it from its queue (answering CANCELLED), or tells its worker, and its inputs
are freed by whichever final answer comes, also one that arrived while the caller was
leaving.

Every request gets exactly one answer (how requests leave, and what one that cannot be
encoded is answered: outbox.py). When the connection to the scheduler breaks, every request
and control call still waiting fails UNAVAILABLE at once, new ones fail fast, and health
says not ready until the scheduler is back (it answers the FrontendHello sent on connect).
Until the scheduler is first reached, calls fail fast the same way: queued for a scheduler
that never comes, they would hang, each holding its request body until its client gave up.
Request ids carry the process id in their high bits, so results meant for an earlier
process on the same result address (a frontend respawned by `trireme serve`) never match.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from services.common import logsettings, transport
from services.common import messages as m
from services.common.errors import Code, TriremeError, invalid_arg
from services.common.shm import (
    HOUSEKEEPING_S,
    SHM_DIR,
    Arena,
    Housekeeper,
    SegmentMap,
    ShmUnavailable,
    by_owner,
)
from services.common.shm import domain as shm_domain
from services.dataplane.chain import Chains
from services.dataplane.classification import classify_outputs
from services.dataplane.control import ControlCalls, error_from
from services.dataplane.direct import DirectPath
from services.dataplane.metadata import ModelCache
from services.dataplane.outbox import Outbox
from services.dataplane.regions import output_region, region_ref, uses_regions
from services.dataplane.response_cache import Copy, FrontendCache
from services.dataplane.settings import DataPlaneSettings
from services.dataplane.tracing import Tracer
from services.dataplane.types import CoreRequest, CoreResponse, OutputTensor
from services.dataplane.validation import validate_infer

log = logging.getLogger("trireme.dataplane")

SCHEDULER_LOST_TEXT = ("the connection to the scheduler was lost; the request did not "
                       "complete (retry when the server is ready)")
SCHEDULER_DOWN_TEXT = "the scheduler is not reachable; the server is not ready"
FIRST_CONNECT_S = 2.0   # start() waits this long for the scheduler: a client started with it
                        # (BLS in a worker, a frontend of `trireme serve`) finds it reached
_ID_SHIFT = 40   # request ids: pid << 40 | a counter (pids are below 2**22: ids stay 62-bit)

class DataPlane:
    _outbox: Outbox   # how requests and cancels leave for the scheduler (made by start())

    def __init__(self, settings: DataPlaneSettings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self._ids = itertools.count((self.pid << _ID_SHIFT) + 1)
        # req_id or ctl_id -> who waits: a Future, or a Queue for a stream's responses
        self._pending: dict[int, asyncio.Future | asyncio.Queue] = {}
        # req_id -> input blocks, of every request until its final answer (freed then)
        self._inflight: dict[int, list[Any]] = {}
        # req_id -> its response cache key, of every looked-up request until its final answer
        self.models = ModelCache(lambda model, load: self._call(
            m.GetModelInfo(next(self._ids), model, load)))
        self._streams: dict[int, list[Any]] = {}      # preserve_ordering state per stream
        self._scheduler_ready = False
        # True until the scheduler is reached, and from a broken connection until it is
        # back: requests fail fast
        self._scheduler_lost = True
        self._reached = asyncio.Event()
        # True while the frontend is still opening its ports: health says neither live nor
        # ready, so a client that polled HTTP never finds the gRPC port closed.
        self.starting = False
        self._arena: Arena | None = Arena("in") if settings.use_shm else None
        self._shm_ok = self._arena is not None
        # Which workers can map our segments and we theirs: those reporting the same domain
        # (the scheduler compares; a model's ModelInfo.shm says it for its instances).
        self._domain = shm_domain() if self._arena is not None else ""
        if self._arena is not None and not self._domain:
            log.warning("shared memory is not usable here (%s): every tensor travels inline",
                        SHM_DIR)
            self._shm_ok = False
        self._segments = SegmentMap()
        # keys of looked-up requests, misses' answers, copies of hits (response_cache.py)
        self._cache = FrontendCache(self._send, self._segments.view)
        self._housekeeper = Housekeeper(self._arena, self._segments)
        # DataPlaneAPI's trace and control calls: its collaborators' own methods, bound here;
        # trace_on and trace_mode copy the tracer's (read per request: _on_trace_levels)
        t = self._tracer = Tracer(self._send, self._segments.view)
        self.trace_on, self.trace_mode, self.trace_level = t.on, t.mode, t.level
        c = self._control = ControlCalls(self._call, lambda: next(self._ids))
        self.repository_index, self.load_model, self.unload_model, self.statistics = (
            c.repository_index, c.load_model, c.unload_model, c.statistics)
        self.shm_status, self.shm_register, self.shm_unregister, self.metrics_text = (
            c.shm_status, c.shm_register, c.shm_unregister, c.metrics_text)
        self.log_settings, self.trace_settings = c.log_settings, c.trace_settings
        self._handlers = self._handler_table()
        self._tick: asyncio.TimerHandle | None = None
        self.result_addr = settings.result_addr

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        # The loop every call of this data plane runs on, held: asyncio.get_running_loop()
        # checks the pid (a getpid syscall) on each call, 4-5 % of a frontend's samples.
        self._loop = asyncio.get_running_loop()
        if not self.result_addr:
            self.result_addr = await asyncio.to_thread(
                transport.result_address, self.settings.scheduler_addr, "results")
        self._results = await transport.listen(self.result_addr, self._on_result)
        self.result_addr = self._results.address   # with the port chosen at bind
        self._paths()
        self._sched = transport.connect(self.settings.scheduler_addr, self._on_message,
                                        on_state=self._on_scheduler_state)
        try:   # (the hello goes on connect: _on_scheduler_state)
            await asyncio.wait_for(self._reached.wait(), FIRST_CONNECT_S)
        except TimeoutError:
            log.warning("the scheduler at %s is not reachable yet: requests fail until it is",
                        self.settings.scheduler_addr)
        self._tick = self._loop.call_later(HOUSEKEEPING_S, self._on_tick)

    def _paths(self) -> None:
        """The ways requests leave: through the scheduler, to a route, along a chain."""
        self._outbox = Outbox(self._send_parts, self._deliver, self.result_addr, self._loop)
        self._direct = DirectPath(self._loop, self.result_addr, self._domain, self._on_results,
                                  self._deliver, self._resend)
        self._chains = Chains(self._direct, self.models, lambda: next(self._ids), self._resend,
                              self._outbox.cancel, self._deliver, self._release_blocks,
                              self._send)

    def _on_tick(self) -> None:
        try:
            self.housekeep()
        except Exception:   # a failed tick must not end the ticking
            log.exception("shared-memory housekeeping failed")
        self._tick = self._loop.call_later(HOUSEKEEPING_S, self._on_tick)

    def housekeep(self, now: float | None = None) -> bool:
        """Give back what a burst left: idle input segments, mappings of workers' segments
        no response reads any more, the C heap's free pages (shm.Housekeeper). Nothing an
        in-flight request uses: its blocks are live, and a view keeps its mapping."""
        return self._housekeeper.tick(now)

    def _hello(self) -> m.FrontendHello:
        return m.FrontendHello(self.pid, self._domain, self.result_addr)

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
        self._fail_waiting("server is shutting down")
        if not self._scheduler_lost:
            self._chains.send_stats()
        self._direct.close()
        self._sched.close()
        self._results.close()
        self._segments.close()
        if self._arena is not None:
            self._arena.close()

    def _send(self, msg: Any, frames: Sequence[Any] = ()) -> None:
        self._sched.send(m.encode(msg, frames))

    def _send_parts(self, parts: Sequence[Any]) -> None:
        self._sched.send(parts)

    def _fail_waiting(self, text: str) -> None:
        """Answer everything still waiting with UNAVAILABLE ``text``: requests (a stream's
        final response included) and control calls. Requests of this turn not yet sent
        are dropped with them."""
        pending, self._pending = self._pending, {}
        self._outbox.drop()
        self._direct.forget()
        self._chains.forget()
        inflight, self._inflight = self._inflight, {}
        self._cache.clear()
        for blocks in inflight.values():   # no answer is coming for any of them
            self._free_inputs(blocks)
        for req_id, waiter in pending.items():
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait((m.InferResult(req_id, error=m.ErrorRecord(
                    int(Code.UNAVAILABLE), text)), []))
            elif not waiter.done():
                waiter.set_exception(TriremeError(Code.UNAVAILABLE, text))

    def _on_scheduler_state(self, connected: bool) -> None:
        """The transport's word on the scheduler connection. Lost: whatever was sent may
        never be answered (the scheduler, or the requests it held, are gone), so everything
        waiting fails now instead of hanging; metadata is dropped (a new scheduler may serve
        another repository) and so are mappings of workers' segments (they died with it, or
        get mapped again). Back: announce ourselves, and readiness follows its answer."""
        if not connected:
            if self._scheduler_lost:
                return
            log.warning("connection to the scheduler lost: failing %d waiting call(s)",
                        len(self._pending))
            self._scheduler_lost = True
            self._scheduler_ready = False
            self.models.changed([])
            self._fail_waiting(SCHEDULER_LOST_TEXT)
            for held in self._streams.values():   # results held for ordering reach nobody
                for msg, _ in held[1].values():
                    self._release_refs(msg.outputs)
            self._streams.clear()
            self._segments.close()
        elif self._scheduler_lost:
            if self._reached.is_set():
                log.info("connection to the scheduler is back")
            self._reached.set()
            self._scheduler_lost = False
            self._send(self._hello())

    def _on_result(self, identity: bytes, parts: list[Any]) -> None:
        self._on_message(parts)   # results carry everything; who sent them does not matter

    def _on_message(self, parts: list[Any]) -> None:
        msg, frames = m.decode(parts)
        self._dispatch(msg, frames)

    def _dispatch(self, msg: Any, frames: list[Any]) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("dropped a %s from the scheduler: not a message for a frontend",
                        type(msg).__name__)
            return
        handler(msg, frames)

    def _handler_table(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        """What the scheduler (and workers, on the result socket) send: the one table."""
        answer = self._on_answer
        return {
            m.InferResult: self._on_results, m.InferResults: self._on_results,
            m.ModelInfo: answer, m.Index: answer, m.ControlDone: answer, m.Stats: answer,
            m.ShmRegions: answer, m.LogSettings: answer, m.TraceSettings: answer,
            m.MetricsText: answer,
            m.TraceLevels: self._on_trace_levels,
            m.GetPending: lambda msg, frames: self._send(
                m.Pending(msg.ctl_id, self._direct.waiting())),
            m.FlushStats: lambda msg, frames: self._chains.send_stats(msg.flush_id),
            m.LogSettingsChanged: self._on_log_settings,
            m.RepositoryChanged: self._on_repository_changed,
            m.CacheEvicted: lambda msg, frames: self._cache.copies.evicted(msg.keys),
        }

    def _on_results(self, msg: m.InferResult | m.InferResults, frames: list[Any]) -> None:
        # InferResults: one batch's results for this frontend, sharing the frames.
        for r in (msg,) if isinstance(msg, m.InferResult) else msg.results:
            if r.stale:   # a direct request its worker refused unrun
                self._direct.stale(r.req_id)
            elif not r.stream:
                self._deliver(r, frames)
            elif r.req_id in self._inflight:
                self._deliver_in_order(r, frames)
            else:   # not ours (an earlier process's, or answered already): no order slot
                self._drop(r, frames)

    def _on_answer(self, msg: Any, frames: list[Any]) -> None:
        """A control call's answer: to the Future _call left for its ctl_id."""
        fut = self._pending.pop(msg.ctl_id, None)
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_result(msg)

    def _on_trace_levels(self, msg: m.TraceLevels, frames: list[Any]) -> None:
        """Which requests to mark as traceable: the tracer's, and its flag and mode copied."""
        self._tracer.levels(msg)
        self.trace_on, self.trace_mode = self._tracer.on, self._tracer.mode

    def _on_log_settings(self, msg: m.LogSettingsChanged, frames: list[Any]) -> None:
        logsettings.apply(msg.settings)

    def _on_repository_changed(self, msg: m.RepositoryChanged, frames: list[Any]) -> None:
        self._direct.clear_dead()
        if msg.exits:   # workers killed or exited: the error of what was sent them directly
            self._direct.exits(msg.exits)
        self._scheduler_ready = msg.server_ready
        for pid in msg.dead_pids:
            self._segments.forget_owner(pid)
        self.models.changed(msg.models)
        self._cache.copies.changed(msg.models)

    def _deliver(self, msg: m.InferResult, frames: list[Any]) -> None:
        if msg.final:   # the worker is done with the inputs (a result) or never had them
            blocks = self._inflight.pop(msg.req_id, None)
            if blocks:
                self._free_inputs(blocks)
            if self._cache.keys:
                self._cache.answered(msg, frames)
            if self._direct.by_req:
                self._direct.answered(msg.req_id)
        waiter = self._pending.get(msg.req_id)
        if type(waiter) is asyncio.Queue:   # a stream: every response until the final one
            if msg.final:
                del self._pending[msg.req_id]
            waiter.put_nowait((msg, frames))
            return
        if waiter is not None:
            del self._pending[msg.req_id]
            # a Future: the Queue returned above; mypy narrows `type(x) is` on its true branch
            # only, and an isinstance() would cost every response a little
            if not waiter.done():  # type: ignore[union-attr]
                waiter.set_result((msg, frames))  # type: ignore[union-attr]
                return
        elif self._chains.by_step and self._chains.answered(msg, frames):
            return   # a step of an ensemble this data plane runs (chain.py)
        self._drop(msg, frames)

    def _drop(self, msg: m.InferResult, frames: list[Any]) -> None:
        """Nobody waits (the caller went away): hand back its output blocks now."""
        if msg.outputs:
            self._release_refs(msg.outputs)

    def _deliver_in_order(self, msg: m.InferResult, frames: list[Any]) -> None:
        """preserve_ordering: results of a stream reach callers in the order the scheduler
        dispatched their requests, whichever instance finishes first."""
        state = self._streams.get(msg.stream)
        if state is None:
            state = self._streams[msg.stream] = [0, {}]   # [last delivered, held results]
        held = state[1]
        held[msg.order] = (msg, frames)
        while state[0] + 1 in held:
            state[0] += 1
            self._deliver(*held.pop(state[0]))

    async def _call(self, msg: Any) -> Any:
        if self._scheduler_lost:
            raise TriremeError(Code.UNAVAILABLE, SCHEDULER_DOWN_TEXT)
        try:
            parts = m.encode(msg)
        except m.ENCODE_ERRORS as e:   # only a caller's names and values can be at fault
            raise invalid_arg(f"the request cannot be sent to the scheduler: {e}") from None
        fut = self._loop.create_future()
        self._pending[msg.ctl_id] = fut
        self._sched.send(parts)
        try:
            return await fut
        finally:   # a caller that went away leaves nothing waiting for the answer
            self._pending.pop(msg.ctl_id, None)
            del fut   # (a cycle through its error, as in infer)

    # ------------------------------------------------------------------ metadata
    def live(self) -> bool:
        return not self.starting

    def ready(self) -> bool:
        return self._scheduler_ready and not self.starting

    async def model_metadata(self, model: str, version: str) -> dict:
        return await self.models.metadata(model, version)

    async def model_ready(self, model: str, version: str) -> bool:
        try:
            info, v = await self.models.ready_info(model, version)
        except TriremeError:
            return False
        if info.probe_ready:   # its instances check themselves (a Python model's is_ready)
            done = await self._call(m.CheckReady(next(self._ids), model, v))
            return done.error is None
        return True

    async def model_config(self, model: str, version: str) -> dict:
        return await self.models.config(model, version)

    async def infer(self, req: CoreRequest, endpoint: str = "HTTP end point") -> CoreResponse:
        """One request, one response. ``endpoint`` names the caller in the error a decoupled
        model gives (Triton's text: such models answer over a stream only)."""
        info, version = await self.models.serving(req.model, req.version, req.parameters)
        if info.decoupled:
            raise TriremeError(Code.UNSUPPORTED, f"{endpoint} doesn't support models with "
                                                 "decoupled transaction policy")
        fut = self._loop.create_future()
        req_id = self._send_request(req, info, version, fut)
        try:
            result, rframes = await fut
        except asyncio.CancelledError:
            if not fut.done() or fut.cancelled():
                # The caller went away first. A worker may still be reading our input blocks:
                # they are freed (and any outputs handed back) when the request's final
                # answer arrives (its result, or the scheduler's CANCELLED), or were freed
                # by one that arrived while this task was being cancelled.
                if req_id in self._inflight:
                    self._outbox.cancel(req_id, req.model, version)
                    self._direct.cancel(req_id, req.model, version)
                    self._chains.cancel(req_id)
            elif fut.exception() is None:   # the result won the race: hand its outputs back
                self._release_refs(fut.result()[0].outputs)
            raise
        finally:
            self._pending.pop(req_id, None)
            # A future failed with an error refers to it, the error to its traceback, the
            # traceback to this frame and its callers' (the request, its body): held here,
            # that cycle waits for the cyclic GC, which an idle frontend hardly runs
            # (procutil.GC_THRESHOLDS), and each body with it.
            del fut
        if result.trace:   # sampled: its trace so far (tracing.py)
            self._tracer.result(result, rframes)
        return self._response(req, version, result, rframes, info)

    async def infer_stream(self, req: CoreRequest,
                           on_sent: Callable[[], None] | None = None) -> AsyncIterator[CoreResponse]:
        """Every response to one request, as the model sends them: one for a plain model,
        any number for a decoupled one. A final flag without a response yields a
        CoreResponse with ``final`` set and no outputs (``empty``). ``on_sent()`` once the
        request is queued for the scheduler or refused."""
        queue: asyncio.Queue = asyncio.Queue()
        try:
            info, version = await self.models.serving(req.model, req.version, req.parameters)
            req_id = self._send_request(req, info, version, queue)
        finally:
            if on_sent is not None:
                on_sent()
        final = False
        try:
            while not final:
                result, rframes = await queue.get()
                final = result.final
                if self.trace_on:   # a traced stream counts its responses (tracing.py)
                    self._tracer.stream(result, rframes, info.decoupled)
                if result.error is not None and not final:
                    yield CoreResponse(req.model, str(version), req.id, final=False,
                                       error=error_from(result.error))
                    continue
                resp = self._response(req, version, result, rframes, info)
                resp.final, resp.empty = final, result.empty
                yield resp
        finally:
            self._pending.pop(req_id, None)
            while not final and not queue.empty():   # arrived after the caller left
                result, _ = queue.get_nowait()
                final = result.final
                self._release_refs(result.outputs)
            if not final and req_id in self._inflight:
                # abandoned mid-stream: cancel it; the rest is dropped as it arrives, and
                # its final answer frees the inputs
                self._outbox.cancel(req_id, req.model, version)
                self._direct.cancel(req_id, req.model, version)
                self._chains.cancel(req_id)

    def _send_request(self, req: CoreRequest, info: m.ModelInfo, version: int,
                      waiter: asyncio.Future | asyncio.Queue) -> int:
        """Validate, place the input bytes (shared memory or frames) and queue the request;
        the result(s) reach ``waiter``, and the final one frees the input blocks. Returns
        the request id."""
        if self._scheduler_lost:
            raise TriremeError(Code.UNAVAILABLE, SCHEDULER_DOWN_TEXT)
        batch_size = validate_infer(info, req)
        self._housekeeper.busy = True
        # Straight to a worker where a route allows, or an ensemble's steps each to theirs
        # (not for client shared memory or traces: the scheduler resolves regions and
        # samples traces)
        route, plan, key = None, None, b""
        if info.cache:   # looked up in the response cache first: the scheduler's path
            key = self._cache.key(req, info, version)
            t0 = time.perf_counter_ns()
            copy = self._cache.copy(key, info) if key else None
            if copy is not None:   # a hit this frontend holds a copy of: answered here
                return self._answer_copy(req, version, key, copy, waiter,
                                         time.perf_counter_ns() - t0)
        elif (info.routes or info.chain) and self.settings.direct and not self.trace_on \
                and not uses_regions(req):
            if info.routes:
                route = self._direct.pick(info, version)
            else:
                plan = self._chains.plan(info)
                if plan is not None:
                    route = self._direct.pick(plan[0][1], plan[0][2])
        shm = self._shm_ok and (route.shm if route is not None else info.shm)
        refs: list[m.TensorRef] = []
        frames: list[Any] = []
        blocks: list[Any] = []
        try:
            for t in req.inputs:
                if t.data is None:   # in the client's shared memory: the scheduler resolves it
                    refs.append(region_ref(t))
                    continue
                nbytes = len(t.data) if not isinstance(t.data, memoryview) else t.data.nbytes
                ref = m.TensorRef(t.name, t.datatype, list(t.shape), nbytes)
                if shm and nbytes >= self.settings.inline_threshold:
                    assert self._arena is not None     # _shm_ok says so
                    try:
                        block = self._arena.alloc(nbytes)
                        block.view[:] = t.data
                        blocks.append(block)
                        ref.segment, ref.offset = block.segment, block.offset
                    except ShmUnavailable as e:
                        log.warning("input arena unavailable, sending tensors inline: %s", e)
                        self._shm_ok = shm = False   # keep the arena: in-flight blocks still need freeing
                if not ref.segment:
                    ref.frame = len(frames)
                    frames.append(t.data)
                refs.append(ref)
        except BaseException:
            self._free_inputs(blocks)
            raise
        req_id = next(self._ids)
        outputs, regions = [], {}
        if req.outputs:
            for o in req.outputs:
                outputs.append(o.name)
                if "shared_memory_region" in o.parameters:
                    regions[o.name] = output_region(o.parameters)
        self._pending[req_id] = waiter
        self._inflight[req_id] = blocks
        # trace: 1 when its adapter traces it, should the scheduler sample it (tracing.py)
        trace = self._tracer.begin(req, version) if self.trace_on else 0
        msg = m.InferRequest(req_id, self.result_addr, req.model, version, refs, outputs,
                             req.parameters, batch_size, req.id, regions, trace)
        if key:
            msg.cache_key = key
            self._cache.looked_up(req_id, key, info.name)
        if route is None:
            self._outbox.submit(msg, frames)
        elif plan is not None:
            self._chains.start(msg, frames, plan, route, info, version)
        else:
            self._direct.send(route, msg, frames)
        return req_id

    def _answer_copy(self, req: CoreRequest, version: int, key: bytes, copy: Copy,
                     waiter: asyncio.Future | asyncio.Queue, lookup_ns: int) -> int:
        """A response cache hit answered from this frontend's copy (response_cache.py); the scheduler
        counts it (CacheHit)."""
        req_id = next(self._ids)
        self._pending[req_id] = waiter
        self._loop.call_soon(self._deliver, m.InferResult(
            req_id, version, list(copy.outputs), cached=True), copy.frames)
        self._send(m.CacheHit(req.model, version, key, lookup_ns))
        return req_id

    def _resend(self, msg: m.InferRequest, frames: list[Any]) -> None:
        """A direct request its worker did not run: through the scheduler after all."""
        if self._scheduler_lost:   # (its caller was answered when the connection broke)
            return
        self._outbox.submit(msg, frames)

    def _response(self, req: CoreRequest, version: int, result: m.InferResult,
                  rframes: list[Any], info: m.ModelInfo | None = None) -> CoreResponse:
        if result.error is not None:
            raise error_from(result.error)
        resp = CoreResponse(req.model, str(version), req.id, parameters=result.parameters, keep=rframes)
        for ref in result.outputs:
            if ref.frame >= 0:
                data = rframes[ref.frame]
            elif ref.key:    # written into the client's shared memory: no bytes to send
                data = b""
            else:
                data = self._segments.view(ref.segment, ref.offset, ref.nbytes)
                resp.blocks.append((ref.segment, ref.offset))
            resp.outputs.append(OutputTensor(ref.name, ref.datatype, ref.shape, data))
        if req.outputs and info is not None:
            try:   # outputs asked for with "classification": their top-k, for every protocol
                classify_outputs(req, info, resp)
            except TriremeError:   # a datatype Triton refuses: the blocks go back first
                self.release(resp)
                raise
        return resp

    def _free_inputs(self, blocks: list[Any]) -> None:
        if self._arena is not None:
            for b in blocks:
                self._arena.free(b.segment, b.offset)

    def release(self, resp: CoreResponse) -> None:
        if resp.blocks:
            self._release_blocks(resp.blocks)
            resp.blocks = []
        resp.keep = None

    def _release_refs(self, refs: list[m.TensorRef]) -> None:
        self._release_blocks([(r.segment, r.offset) for r in refs if r.segment])

    def _release_blocks(self, blocks: list[tuple[str, int]]) -> None:
        for owner, owned in by_owner(blocks).items():
            self._send(m.ReleaseBlocks(owner, owned))

