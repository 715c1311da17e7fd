"""What the scheduler's client needs to know: where the scheduler is, where results come
back, and how tensors travel. A frontend's settings extend these with its ports."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.shm import DEFAULT_INLINE_THRESHOLD


@dataclass
class DataPlaneSettings:
    scheduler_addr: str
    """The scheduler's frontend listener (unix://, stream://, or ZeroMQ's ipc:// / tcp://)."""
    result_addr: str = ""
    """Where workers send results to this client; empty: a socket path chosen at start,
    on the scheduler address's wire."""
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD
    """Tensors smaller than this travel as message frames instead of shared memory."""
    use_shm: bool = True
    """Place large tensors in shared memory (off when processes do not share a host)."""
    direct: bool = True
    """Send requests straight to an instance's worker where the scheduler publishes a
    route for it (direct.py); False: every request goes through the scheduler."""
