"""Triton's sequence batcher: the queue of a model with `sequence_batching`.

    request (sequence_id, sequence_start, sequence_end)
        ─▶ checks (a correlation ID; batch size 1; START on a new sequence: Triton's texts)
        ─▶ its sequence: bound to a slot of one instance, or waiting in the backlog
        ─▶ each idle instance runs one request of each of its sequences that has one
           (the oldest heads first, up to max_batch_size), in order within a sequence

A sequence keeps its instance (a stateful model's state lives there) from its START until
its END has run; then the slot goes to the first sequence in the backlog. A sequence that
gets no request for `max_sequence_idle_microseconds` (default 1 s) loses its slot, and its
next request is refused as one without START. Slots per instance: `direct`, max_batch_size
(at least 1); `oldest`, max_candidate_sequences (at least that). A batch is sent when every
slot with a request has contributed one, once the strategy's max_queue_delay_microseconds
has passed for the oldest of them, or at once when it reaches a preferred size (`oldest`).

Decided here, where Triton differs: a batch holds only sequences that have a request (no
READY=0 filler rows; every row is READY=1), so a model sees its rows compacted rather than
at fixed slot positions; implicit state (`state`) is kept per correlation ID by the worker
(services/workers/sequence.py), not per slot. The control inputs themselves are made by the
worker from the request's parameters.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import Code
from services.scheduler.dispatch import Instance, Pending, VersionQueue

log = logging.getLogger("trireme.sequence")

DEFAULT_IDLE_US = 1_000_000   # Triton: max_sequence_idle_microseconds 0 means 1 s


def no_correlation_id_text(model: str) -> str:
    return (f"inference request to model '{model}' must specify a non-zero or non-empty "
            "correlation ID")


def batch_size_text(model: str) -> str:
    return (f"inference request to model '{model}' must specify batch-size 1 due to "
            "requirements of sequence batcher")


def no_start_text(model: str, corrid: int | str) -> str:
    return (f"inference request for sequence {corrid} to model '{model}' must specify the "
            "START flag on the first request of the sequence")


@dataclass
class SequenceConfig:
    slots: int                  # per instance
    max_batch: int
    delay_ns: int = 0
    preferred: frozenset[int] = frozenset()
    idle_ns: int = DEFAULT_IDLE_US * 1000

    @classmethod
    def from_model_config(cls, cfg: Any) -> SequenceConfig:
        sb = cfg.sequence_batching
        max_batch = max(cfg.max_batch_size, 1)
        idle_ns = (sb.max_sequence_idle_microseconds or DEFAULT_IDLE_US) * 1000
        if sb.WhichOneof("strategy_choice") == "oldest":
            o = sb.oldest
            return cls(slots=max(o.max_candidate_sequences, max_batch), max_batch=max_batch,
                       delay_ns=o.max_queue_delay_microseconds * 1000,
                       preferred=frozenset(o.preferred_batch_size), idle_ns=idle_ns)
        return cls(slots=max_batch, max_batch=max_batch,
                   delay_ns=sb.direct.max_queue_delay_microseconds * 1000, idle_ns=idle_ns)


@dataclass(eq=False)
class Sequence:
    corrid: int | str
    inst: Instance | None = None                  # None: in the backlog
    pending: collections.deque[Pending] = field(default_factory=collections.deque)
    running: bool = False                         # one request of it is executing
    ended: bool = False                           # its END arrived: nothing more will come
    last_ns: int = 0


class _Pending:
    """What nv_inference_pending_request_count counts (stats.batcher's __len__)."""

    def __init__(self, queue: SequenceQueue) -> None:
        self.queue = queue

    def __len__(self) -> int:
        return sum(len(s.pending) for s in self.queue.all_sequences())


class SequenceQueue(VersionQueue):
    def __init__(self, *args: Any, sequence: SequenceConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seq = sequence
        self.sequences: dict[int | str, Sequence] = {}          # correlation ID -> open one
        self.bound: dict[str, list[Sequence]] = {}              # worker id -> its sequences
        self.backlog: collections.deque[Sequence] = collections.deque()
        self._reaper: Any = None
        if self.stats is not None:
            self.stats.batcher = _Pending(self)

    def all_sequences(self) -> list[Sequence]:
        return [s for seqs in self.bound.values() for s in seqs] + list(self.backlog)

    # ------------------------------------------------------------------ instances
    def add_instance(self, inst: Instance) -> None:
        self.bound.setdefault(inst.worker_id, [])
        super().add_instance(inst)      # pumps: _fill_slots first
        self._fill_slots()
        self.pump()

    def remove_instance(self, inst: Instance) -> None:
        super().remove_instance(inst)
        # Its sequences wait for a slot elsewhere (a model's state there is gone with it).
        for s in reversed(self.bound.pop(inst.worker_id, [])):
            s.inst = None
            self.backlog.appendleft(s)
        self._fill_slots()

    def worker_died(self, inst: Instance, why: str, code: int = Code.INTERNAL) -> None:
        """Its sequences end here: their state died with it. What they had queued fails
        with the running request's error; their next request needs a START."""
        for s in self.bound.pop(inst.worker_id, []):
            self._forget(s)
            while s.pending:
                self.fail(s.pending.popleft(), code, why, "OTHER")
        super().worker_died(inst, why, code)

    # ------------------------------------------------------------------ requests
    def enqueue(self, p: Pending) -> None:
        r, model = p.req, self.model
        params = r.parameters
        corrid = params.get("sequence_id", 0) if params else 0
        if r.batch_size > 1:
            return self.fail(p, Code.INVALID_ARG, batch_size_text(model), "OTHER")
        if not corrid or isinstance(corrid, bool) or not isinstance(corrid, int | str):
            return self.fail(p, Code.INVALID_ARG, no_correlation_id_text(model), "OTHER")
        start = params.get("sequence_start") is True
        end = params.get("sequence_end") is True
        s = self.sequences.get(corrid)
        if s is None:
            if not start:
                return self.fail(p, Code.INVALID_ARG, no_start_text(model, corrid), "OTHER")
            s = self.sequences[corrid] = Sequence(corrid)
            self.backlog.append(s)
            self._fill_slots()
        elif start:
            log.warning("sequence %s for model '%s' has a conflict. The previous sequence did "
                        "not end before this sequence start. Previous sequence will be "
                        "terminated early.", corrid, model)
        s.pending.append(p)
        s.last_ns = p.arrival_ns
        p.sequence = s
        if end:   # a later START with this ID opens a new sequence
            s.ended = True
            del self.sequences[corrid]
        self.pump()

    def cancel(self, frontend: bytes, req_ids: list[int]) -> tuple[list[Pending], list[int]]:
        wanted = set(req_ids)
        removed: list[Pending] = []
        for s in self.all_sequences():
            for p in [p for p in s.pending if p.frontend == frontend and p.req.req_id in wanted]:
                s.pending.remove(p)
                removed.append(p)
                wanted.discard(p.req.req_id)
            self._maybe_release(s)
        return removed, [i for i in req_ids if i in wanted]

    def fail_queued(self, code: int, message: str) -> None:
        for s in self.all_sequences():
            while s.pending:
                self.fail(s.pending.popleft(), code, message, "OTHER")
        self.sequences.clear()
        self.backlog.clear()
        for seqs in self.bound.values():
            seqs.clear()

    @property
    def busy(self) -> bool:
        return any(s.pending or s.running for s in self.all_sequences()) or \
            any(i.inflight for i in self.instances.values())

    def batch_done(self, inst: Instance, batch_id: int) -> None:
        for p in inst.inflight.get(batch_id, ()):
            s = p.sequence
            if s is not None:
                s.running = False
                s.last_ns = self.clock()
                self._maybe_release(s)
        super().batch_done(inst, batch_id)

    # ------------------------------------------------------------------ scheduling
    def pump(self) -> None:
        now = self.clock()
        wait_ns: int | None = None
        for inst in list(self.idle):
            ready = [s for s in self.bound.get(inst.worker_id, ()) if s.pending and not s.running]
            if not ready:
                continue
            ready.sort(key=lambda s: s.pending[0].arrival_ns)
            chosen = ready[:self.seq.max_batch]
            age = now - chosen[0].pending[0].arrival_ns
            if (self.seq.delay_ns and age < self.seq.delay_ns and len(chosen) < self.seq.max_batch
                    and len(chosen) not in self.seq.preferred):
                left = self.seq.delay_ns - age
                wait_ns = left if wait_ns is None else min(wait_ns, left)
                continue
            batch = []
            for s in chosen:
                s.running = True
                batch.append(s.pending.popleft())
            self._dispatch(inst, batch, now)
        if wait_ns is not None:
            self._arm(wait_ns)
        self._arm_reaper()

    def _fill_slots(self) -> None:
        """Bind backlog sequences to the instances with free slots (the emptiest first)."""
        while self.backlog:
            free = [(len(seqs), wid) for wid, seqs in self.bound.items()
                    if wid in self.instances and len(seqs) < self.seq.slots]
            if not free:
                return
            _, wid = min(free)
            s = self.backlog.popleft()
            s.inst = self.instances[wid]
            self.bound[wid].append(s)

    def _maybe_release(self, s: Sequence) -> None:
        """A sequence whose END has run gives its slot up."""
        if s.ended and not s.pending and not s.running:
            self._unbind(s)

    def _unbind(self, s: Sequence) -> None:
        if s.inst is not None:
            seqs = self.bound.get(s.inst.worker_id)
            if seqs is not None and s in seqs:
                seqs.remove(s)
            s.inst = None
        elif s in self.backlog:
            self.backlog.remove(s)
        self._forget(s)
        self._fill_slots()

    def _forget(self, s: Sequence) -> None:
        if self.sequences.get(s.corrid) is s:
            del self.sequences[s.corrid]

    # ------------------------------------------------------------------ idle sequences
    def _arm_reaper(self) -> None:
        if self._reaper is None and any(self.bound.values()):
            self._reaper = self.call_later(self.seq.idle_ns / 2e9, self._reap)

    def _reap(self) -> None:
        """Free the slots of sequences idle for max_sequence_idle_microseconds."""
        self._reaper = None
        now = self.clock()
        for s in [s for seqs in self.bound.values() for s in seqs]:
            if not s.pending and not s.running and now - s.last_ns >= self.seq.idle_ns:
                log.info("sequence %s of model '%s' was idle for %.3f s: its slot is released",
                         s.corrid, self.model, (now - s.last_ns) / 1e9)
                self._unbind(s)
        self.pump()


def is_sequence_model(cfg: Any) -> bool:
    return cfg.HasField("sequence_batching")
