"""The messages of Triton's statistics extension: a frontend asks for a model's (or every
model's) statistics and the scheduler answers with one record per version, Triton's
ModelStatistics field for field. Registered and encoded with every other message by
services/common/messages.py, which re-exports them."""
from __future__ import annotations

from services.common.msgbase import ErrorRecord, Msg


class GetStats(Msg):
    """Statistics extension: every loaded version when ``model`` is empty."""
    ctl_id: int
    model: str = ""
    version: int = -1              # -1: every ready version of the model


# msgspec lets a frozen Struct subclass a non-frozen one; mypy applies the dataclass rule
class Duration(Msg, frozen=True):  # type: ignore[misc]
    count: int = 0
    ns: int = 0


class BatchStat(Msg):
    """Executions of one batch size: count = executions, ns = their cumulative time."""
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class ModelStat(Msg):
    """One version's statistics, Triton's ModelStatistics field for field."""
    name: str
    version: str
    last_inference: int = 0        # ms since the epoch
    inference_count: int = 0       # rows (batch_size summed over successful requests)
    execution_count: int = 0       # model executions (batches)
    success: Duration = Duration()
    fail: Duration = Duration()
    queue: Duration = Duration()
    compute_input: Duration = Duration()
    compute_infer: Duration = Duration()
    compute_output: Duration = Duration()
    cache_hit: Duration = Duration()
    cache_miss: Duration = Duration()
    batch_stats: list[BatchStat] = []


class Stats(Msg):
    ctl_id: int
    stats: list[ModelStat] = []
    error: ErrorRecord | None = None
