"""The messages of the direct path: requests that go from a frontend straight to an
instance's worker, on routes the scheduler publishes and revokes. Registered and encoded
with every other message by services/common/messages.py, which re-exports them.

    scheduler ──ModelInfo.routes (address, epoch)──▶ frontend
    scheduler ──DirectEpoch──▶ worker ──EpochSet──▶ scheduler
    frontend ──InferRequest(epoch) / Cancel──▶ worker ──InferResult / Goodbye──▶ frontend
    worker ──DirectStats (batched; at once on FlushStats)──▶ scheduler
    scheduler ──GetPending──▶ frontend ──Pending──▶ scheduler   (a metrics scrape)

An ensemble whose steps run one after another (ModelInfo.chain) is run by the frontend
itself over its steps' routes; it reports the ensemble's own statistics:
    frontend ──EnsembleStats (batched; at once on FlushStats)──▶ scheduler
"""
from __future__ import annotations

from services.common.messages_ext import MetricFamilyRecord
from services.common.msgbase import Msg


class Route(Msg):
    """Where a frontend may send a version's requests itself: one instance's worker."""
    version: int
    address: str                   # the worker's direct listener (unix://)
    epoch: int                     # a request carries it; the worker refuses any other
    instance: str                  # Triton's instance name (the error when its worker dies)
    shm_domain: str = ""           # its worker's shm.domain(): who can map its segments


class ChainStep(Msg):
    """One step of an ensemble a frontend may run itself (ModelInfo.chain), in order."""
    model: str
    version: int                   # 0: the model's latest ready version
    inputs: dict[str, str]         # step input -> ensemble tensor
    outputs: dict[str, str]        # step output -> ensemble tensor


class DirectEpoch(Msg):
    """Scheduler -> worker: serve direct requests of this epoch; 0: none (the route is
    revoked: unload, reload, replacement). Answered with EpochSet once every direct request
    read before it was answered."""
    epoch: int


class EpochSet(Msg):
    """Worker -> scheduler: DirectEpoch is in force; what it ran directly before is done."""
    worker_id: str
    epoch: int


class FlushStats(Msg):
    """Scheduler -> worker: send the statistics of direct requests now (a statistics request
    or a metrics scrape waits for them)."""
    flush_id: int


class DirectRecord(Msg, frozen=True):  # type: ignore[misc]
    """One direct execution, as the scheduler's VersionStats.executed takes it."""
    rows: int
    failed: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    queue_ns: int                  # from the worker reading the request to its execution
    total_ns: int                  # from the worker reading the request to its answer
    cancelled: bool = False        # its caller went away before it ran: it did not


class DirectStats(Msg):
    """Worker -> scheduler: direct executions since the last DirectStats (at most
    DIRECT_STATS_S apart while traffic lasts), with the model's custom metrics when they
    changed; ``flush_id`` answers a FlushStats."""
    worker_id: str
    records: list[DirectRecord] = []
    metrics: list[MetricFamilyRecord] | None = None   # as in BatchDone
    flush_id: int = 0


class GetPending(Msg):
    """Scheduler -> frontend: how many requests wait on each of its routes (for
    nv_inference_pending_request_count: a worker reads its requests one at a time)."""
    ctl_id: int


class Pending(Msg):
    """GetPending's answer: route address -> requests sent there and not answered yet."""
    ctl_id: int
    waiting: dict[str, int] = {}


class Goodbye(Msg):
    """Worker -> frontend, last on a direct connection before a clean exit: every request
    on it not answered before this was never run (the frontend sends it through the
    scheduler)."""
    reason: str = ""


class EnsembleRecord(Msg, frozen=True):  # type: ignore[misc]
    """One ensemble request a frontend ran over its steps' routes."""
    model: str
    version: int
    rows: int
    total_ns: int                  # from the frontend sending its first step to its answer
    reason: str = ""               # a failure's (VersionStats.failed); "": it succeeded


class EnsembleStats(Msg):
    """Frontend -> scheduler: the ensemble requests it ran since its last EnsembleStats (at
    most ENSEMBLE_STATS_S apart while traffic lasts); ``flush_id`` answers a FlushStats."""
    records: list[EnsembleRecord] = []
    flush_id: int = 0
