"""The one interface of a model version's queue: what the scheduler calls on
``VersionState.queue``, whichever of the three it is.

    VersionQueue   (dispatch.py)   the dynamic batcher over the version's instances
    SequenceQueue  (sequence.py)   Triton's sequence batcher, a VersionQueue with slots
    EnsembleQueue  (ensemble.py)   an ensemble's steps, run on their own models' queues

Scheduler._make_queue (main.py) picks one per version from its config; the callers are the
request path (main.py: enqueue, cancel), the worker side (worker_side.py: batch_done), the
ModelManager and what it owns (lifecycle.py, recovery.py, retirement.py: add_instance,
worker_died, fail_queued, busy) and the watchdog (instances).

An ensemble has no instances of its own, and says so in these terms rather than through a
narrower interface: its ``instances`` is always empty, ``worker_died`` and ``batch_done``
have nothing to do, and ``add_instance`` refuses (lifecycle.py never starts an instance for
an ensemble). This keeps the callers as they are. The two that may hold an ensemble's queue
(a cancel forwarded to the instances, shutdown waiting for busy queues with instances) do
the right thing with an empty mapping; the others reach a queue through one of its
instances (a worker's exit or BatchDone, a watchdog kill, a restart), which an ensemble's
never is. A second Protocol for instance-backed queues would put an isinstance check at
every one of those call sites (nine, one on the BatchDone path), most of them for a branch
that is never taken.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from services.common.errors import Code
from services.scheduler.dispatch import Instance, Pending

if TYPE_CHECKING:
    from services.scheduler.stats import VersionStats


class SchedulingQueue(Protocol):
    """The queue of one loaded model version."""

    stats: VersionStats | None
    """The version's statistics record: each request queued here carries it (Pending.stats)."""

    @property
    def instances(self) -> Mapping[str, Instance]:
        """The version's live instances by worker id (empty for an ensemble, which runs on
        its steps' instances)."""

    @property
    def busy(self) -> bool:
        """Requests waiting here or running: shutdown waits while a queue with instances is
        busy."""

    def enqueue(self, p: Pending) -> None:
        """Take a request: it runs, waits, or (refused by the queue's own checks) gets its
        error through the queue's fail callback. Raises TriremeError without queueing it
        when the queue is full."""

    def cancel(self, frontend: bytes, req_ids: list[int]) -> tuple[list[Pending], list[int]]:
        """These requests' caller went away. Returns the ones taken out of the queue (the
        caller answers each CANCELLED) and the ids of the others: running, answered, or
        answered by the queue itself (an ensemble's); the caller tells the instances that
        can stop early about those."""

    def fail_queued(self, code: int, message: str) -> None:
        """Fail every request still waiting here with ``code`` and ``message``: the version
        is being retired or has no instance left. Batches on workers are not touched."""

    def add_instance(self, inst: Instance) -> None:
        """``inst``, a loaded worker of this version, serves from now on (it starts idle).
        An ensemble's queue raises TypeError: it has no instances of its own."""

    def worker_died(self, inst: Instance, why: str, code: int = Code.INTERNAL) -> None:
        """``inst``'s worker is gone (it exited, or was killed by the watchdog or a timed-out
        unload): every request it held fails with ``code`` and ``why``, and it is no longer
        one of ``instances``. Called again for it, there is nothing left to fail."""

    def batch_done(self, inst: Instance, batch_id: int) -> None:
        """``inst``'s worker finished batch ``batch_id`` (its BatchDone): the instance is
        idle again. Called for one of ``instances`` only."""
