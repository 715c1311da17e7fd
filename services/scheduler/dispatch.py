"""Per-version request dispatch: the batcher's queue, the idle instances, what each worker holds.

Whenever a request arrives, an instance becomes idle or the batcher's delay runs out, pump()
asks the Batcher for the next batch and sends it to an idle instance (one the rate limiter
lets run). Every request a worker holds is recorded, so the moment that worker dies each of
them gets its error (invariant 1). A request whose caller went away is taken out of the
queue by cancel(), in O(1), and never runs.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common import messages as m
from services.common.errors import Code
from services.scheduler.batcher import TIMEOUT_EXPIRED, Batcher, BatcherConfig

_batch_ids = itertools.count(1)
_stream_ids = itertools.count(1)


@dataclass(slots=True)
class Pending:
    """A request waiting in a queue or running on a worker."""
    frontend: bytes            # the frontend's identity on the scheduler's ROUTER socket
    req: m.InferRequest
    frames: list[Any]
    arrival_ns: int = 0
    dispatch_ns: int = 0
    stream: int = 0            # preserve_ordering: (stream, order) travel with the result
    order: int = 0
    stats: Any = None          # the version's stats.VersionStats when it was queued
    shm_domain: str = ""       # the frontend's shared-memory domain (shm.domain())
    sequence: Any = None       # its sequence.Sequence (models with sequence_batching)
    regions: tuple[str, ...] = ()   # client shared-memory regions it holds until answered
    trace: Any = None          # a sampled request's trace_settings.OpenTrace


@dataclass
class Instance:
    """One worker process serving one model instance."""
    worker_id: str
    name: str                  # Triton's instance name, e.g. "add_sub_0_1"
    model: str
    version: int
    kind: str
    device_id: int = 0
    handle: Any = None         # supervisor.ProcessHandle
    pid: int = 0
    loaded: bool = False
    inflight: dict[int, list[Pending]] = field(default_factory=dict)
    config: Any = None         # its inference.ModelInstanceGroup (rate_limiter settings)
    probe: bool = False        # its backend checks readiness itself (ProbeReady)
    cancellable: bool = False  # its worker reads Cancel on m.CANCEL_CHANNEL (Python models)
    retired: bool = False      # its model is being unloaded or replaced: never restarted
    host: Any = None           # the hosts.LocalHost or RemoteHost it runs on
    # (reply_to, req_id) -> requests its decoupled model still answers after their batch
    streaming: dict[tuple[str, int], Pending] = field(default_factory=dict)
    shm_domain: str = ""       # its worker's shm.domain(): who can map its segments
    direct_addr: str = ""      # its worker's direct listener ("": none; routes.py)
    epoch: int = 0             # its route's epoch while frontends may send to it directly
    revoking: bool = False     # its route was withdrawn and its worker has not said EpochSet
    resident_bytes: int = 0    # its worker's size after load and warmup (memory.py)

    @property
    def busy(self) -> bool:
        """Running something: a batch, or direct requests its worker has not finished."""
        return bool(self.inflight) or self.revoking


def log_request(request_id: str, message: str) -> str:
    """Triton's InferenceRequest::LogRequest() prefix on the errors it gives a request (the
    full queue's, not the timeout's), here only when the request has an id."""
    return f"[request id: {request_id}] {message}" if request_id else message


def _int_param(params: dict[str, Any], key: str) -> int:
    v = params.get(key, 0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _shape_tensors(inputs: list[m.TensorRef], frames: list[Any],
                   names: frozenset[str]) -> dict[str, bytes]:
    """The bytes of the shape tensors among a request's inputs, for the batcher to compare.
    Only inline ones: shape tensors are a few integers, far below the inline threshold; one
    in shared memory is left out and so batched with no other request, as Triton does with
    contents it cannot compare in place (RequiredEqualInputs::HasEqualInputs)."""
    return {t.name: bytes(frames[t.frame]) for t in inputs if t.name in names and t.frame >= 0}


class VersionQueue:
    """The batcher + idle instances of one loaded model version (a SchedulingQueue:
    queues.py)."""

    def __init__(self, model: str, version: int, config: BatcherConfig,
                 send_batch: Callable[[Instance, m.ExecuteBatch, list[Any]], None],
                 fail: Callable[[Pending, int, str, str], None],
                 call_later: Callable[[float, Callable[[], None]], Any],
                 limiter: Any = None, clock: Callable[[], int] = time.monotonic_ns,
                 stats: Any = None, on_serving: Callable[[Instance], None] | None = None) -> None:
        self.model = model
        self.version = version
        self.stats = stats
        self.batcher = Batcher(config)
        if stats is not None:   # nv_inference_pending_request_count is what waits here
            stats.batcher = self.batcher
        self.send_batch = send_batch
        self.fail = fail
        self.call_later = call_later
        self.limiter = limiter
        self.clock = clock
        # a version with nothing to decide per request: each instance gets a route (routes.py)
        self.on_serving = on_serving
        self.idle: list[Instance] = []
        self.instances: dict[str, Instance] = {}
        self._timer: Any = None
        self._stream = next(_stream_ids) if config.preserve_ordering else 0
        self._orders: dict[bytes, int] = {}     # frontend -> last order number handed out
        # (frontend, req_id) -> batcher entry of every queued request: what a cancel finds.
        # Built by the first cancel, kept up while requests wait, dropped when none do: a
        # server nobody cancels on pays nothing for it.
        self._queued: dict[tuple[bytes, int], Any] | None = None

    # ------------------------------------------------------------------ instances
    def add_instance(self, inst: Instance) -> None:
        self.instances[inst.worker_id] = inst
        if self.limiter is not None:
            self.limiter.register(inst)
        self.idle.append(inst)
        if self.on_serving is not None:
            self.on_serving(inst)
        self.pump()

    def remove_instance(self, inst: Instance) -> None:
        self.instances.pop(inst.worker_id, None)
        if inst in self.idle:
            self.idle.remove(inst)
        if self.limiter is not None and not inst.inflight:
            self.limiter.unregister(inst)

    # ------------------------------------------------------------------ requests
    def enqueue(self, p: Pending) -> None:
        """Queue a request; raises TriremeError (queue full) without queueing it."""
        r = p.req
        params = r.parameters
        b = self.batcher
        entry = b.enqueue(
            p, p.arrival_ns, batch_size=r.batch_size,
            priority=_int_param(params, "priority") if params else 0,
            timeout_us=_int_param(params, "timeout") if params else 0,
            shapes={t.name: t.shape for t in r.inputs} if b.needs_shapes else None,
            contents=(_shape_tensors(r.inputs, p.frames, b.shape_tensors)
                      if b.shape_tensors else None))
        if self._queued is not None:
            self._queued[(p.frontend, r.req_id)] = entry
        self.pump()

    def cancel(self, frontend: bytes, req_ids: list[int]) -> tuple[list[Pending], list[int]]:
        """Take the queued ones among these requests out of the queue. Returns them (the
        caller answers each) and the ids that were not queued: running, or already done."""
        queued = self._queued
        if queued is None:   # O(queue) once, then O(1) a cancel while requests wait
            queued = self._queued = {(e.item.frontend, e.item.req.req_id): e
                                     for e in self.batcher.entries()}
        removed, rest = [], []
        for req_id in req_ids:
            entry = queued.pop((frontend, req_id), None)
            if entry is None:
                rest.append(req_id)
            else:
                removed.append(self.batcher.cancel(entry))
        if not queued:
            self._queued = None
        return removed, rest

    def pump(self) -> None:
        while self.idle and len(self.batcher):
            inst = self._runnable()
            if inst is None:
                return
            now = self.clock()
            d = self.batcher.next_batch(now)
            for p in d.rejected:
                if self._queued is not None:
                    self._queued.pop((p.frontend, p.req.req_id), None)
                self.fail(p, Code.UNAVAILABLE, TIMEOUT_EXPIRED, "REJECTED")
            if not d.batch:
                if d.wait_ns is not None:
                    self._arm(d.wait_ns)
                return
            self._dispatch(inst, d.batch, now)

    def _runnable(self) -> Instance | None:
        """An idle instance allowed to run now (the rate limiter may hold them all)."""
        if self.limiter is None:
            return self.idle[0]
        return self.limiter.choose(self.idle, self)

    def _arm(self, wait_ns: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.call_later(wait_ns / 1e9, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.pump()

    def _dispatch(self, inst: Instance, batch: list[Pending], now: int) -> None:
        self.idle.remove(inst)
        if self.limiter is not None:
            self.limiter.acquire(inst)
        batch_id = next(_batch_ids)
        items = []
        frames: list[Any] = []
        bases: dict[int, int] = {}      # id(frame list) -> its first index in `frames`
        traced = False
        queued = self._queued
        if queued is not None:
            for p in batch:
                queued.pop((p.frontend, p.req.req_id), None)
            if not queued:
                self._queued = None
        for p in batch:
            p.dispatch_ns = now
            if self._stream:
                p.stream = self._stream
                p.order = self._orders[p.frontend] = self._orders.get(p.frontend, 0) + 1
            r = p.req
            inputs = r.inputs
            if p.frames:
                # Frame indexes are per message; requests that came in one message share
                # its frame list, so each list is sent once and indexes shift by its base.
                base = bases.get(id(p.frames))
                if base is None:
                    base = bases[id(p.frames)] = len(frames)
                    frames.extend(p.frames)
                if base:
                    inputs = [m.TensorRef(t.name, t.datatype, t.shape, t.nbytes, t.frame + base)
                              if t.frame >= 0 else t for t in inputs]
            items.append(m.BatchItem(r.reply_to, r.req_id, inputs, r.outputs, r.parameters,
                                     r.batch_size, p.stream, p.order, r.request_id,
                                     bool(p.shm_domain) and p.shm_domain == inst.shm_domain,
                                     r.out_regions))
            if p.trace is not None:   # sampled: the worker adds its times to the result
                items[-1].trace = p.trace.head
                traced = True
        inst.inflight[batch_id] = batch
        self.send_batch(inst, m.ExecuteBatch(batch_id, items, traced), frames)

    def batch_done(self, inst: Instance, batch_id: int) -> None:
        inst.inflight.pop(batch_id, None)
        if self.limiter is not None:
            self.limiter.release(inst)
        if inst.worker_id in self.instances:
            self.idle.append(inst)
            self.pump()

    def worker_died(self, inst: Instance, why: str, code: int = Code.INTERNAL) -> None:
        """Fail everything the worker held; it is no longer an instance of this version."""
        self.remove_instance(inst)
        held = list(inst.inflight.values())
        inst.inflight.clear()
        if self.limiter is not None:
            for _ in held:
                self.limiter.release(inst)
            self.limiter.unregister(inst)
        for batch in held:
            for p in batch:
                self.fail(p, code, why, "OTHER")

    def fail_queued(self, code: int, message: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queued = None
        for p in self.batcher.drain():
            self.fail(p, code, message, "OTHER")

    @property
    def busy(self) -> bool:
        return bool(len(self.batcher)) or any(i.busy for i in self.instances.values())

