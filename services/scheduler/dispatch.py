"""Per-version request dispatch: a queue, the idle instances, and what each worker holds.

Without dynamic batching (Triton's default scheduler) each request is one execution,
sent to whichever instance is idle, in arrival order. Every request a worker holds is
recorded, so the moment that worker dies each of them gets its error (invariant 1).
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from services.common import messages as m
from services.common.errors import Code

_batch_ids = itertools.count(1)


@dataclass(slots=True)
class Pending:
    """A request waiting in a queue or running on a worker."""
    frontend: bytes            # the frontend's identity on the scheduler's ROUTER socket
    req: m.InferRequest
    frames: list[Any]


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


class VersionQueue:
    """Queue + idle instances for one loaded model version."""

    def __init__(self, model: str, version: int,
                 send_batch: Callable[[Instance, m.ExecuteBatch, list[Any]], None],
                 fail: Callable[[Pending, int, str], None]) -> None:
        self.model = model
        self.version = version
        self.send_batch = send_batch
        self.fail = fail
        self.queue: collections.deque[Pending] = collections.deque()
        self.idle: collections.deque[Instance] = collections.deque()
        self.instances: dict[str, Instance] = {}

    def add_instance(self, inst: Instance) -> None:
        self.instances[inst.worker_id] = inst
        self.idle.append(inst)
        self.pump()

    def remove_instance(self, inst: Instance) -> None:
        self.instances.pop(inst.worker_id, None)
        try:
            self.idle.remove(inst)
        except ValueError:
            pass

    def enqueue(self, p: Pending) -> None:
        self.queue.append(p)
        self.pump()

    def pump(self) -> None:
        while self.queue and self.idle:
            inst = self.idle.popleft()
            p = self.queue.popleft()
            batch_id = next(_batch_ids)
            r = p.req
            item = m.BatchItem(r.reply_to, r.req_id, r.inputs, r.outputs, r.parameters, r.batch_size)
            inst.inflight[batch_id] = [p]
            self.send_batch(inst, m.ExecuteBatch(batch_id, [item]), p.frames)

    def batch_done(self, inst: Instance, batch_id: int) -> None:
        inst.inflight.pop(batch_id, None)
        if inst.worker_id in self.instances:
            self.idle.append(inst)
            self.pump()

    def worker_died(self, inst: Instance, why: str) -> None:
        """Fail everything the worker held; it is no longer an instance of this version."""
        self.remove_instance(inst)
        for batch in inst.inflight.values():
            for p in batch:
                self.fail(p, Code.INTERNAL, why)
        inst.inflight.clear()

    def fail_queued(self, code: int, message: str) -> None:
        while self.queue:
            self.fail(self.queue.popleft(), code, message)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(i.inflight for i in self.instances.values())
