"""The execution watchdog: finds a model instance that stays in one execution too long.

Off by default (Triton has none). The limit of a model version is its config parameter
``execution_timeout_secs`` when the config has one, else the scheduler's
``--model-execution-timeout-secs``; 0 turns it off (a model can opt out of the server's
limit, or opt in on a server without one).

One periodic sweep, not one timer per batch: every VersionQueue already records when each
batch left for its worker (Pending.dispatch_ns, set for the statistics) and which batches
each instance holds, so the hot path does nothing at all for the watchdog, on or off. The
sweep runs only while some version has a limit, every ``period_s`` (a fraction of the
smallest limit, at most 0.25 s), and reads one timestamp per busy instance of the watched
versions: an execution is caught at most ``period_s`` after its limit.

What happens to an instance caught is the ModelManager's business (lifecycle.py): it is
killed, its requests fail with execution_timeout_text(), and it restarts.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from services.common.errors import invalid_arg
from services.scheduler.dispatch import Instance
from services.scheduler.queues import SchedulingQueue

PARAMETER = "execution_timeout_secs"
MAX_PERIOD_S = 0.25
MIN_PERIOD_S = 0.01


def _secs(s: float) -> str:
    return f"{s:g}"


def execution_timeout_text(inst: Instance, limit_s: float) -> str:
    return (f"model instance '{inst.name}' of model '{inst.model}' exceeded the execution "
            f"timeout of {_secs(limit_s)} s and was restarted")


def unload_timeout_text(inst: Instance, timeout_s: float) -> str:
    return (f"model instance '{inst.name}' of model '{inst.model}' was still executing when "
            f"the unload timeout of {_secs(timeout_s)} s ended and was stopped")


def exit_timeout_text(inst: Instance, timeout_s: float) -> str:
    return (f"model instance '{inst.name}' of model '{inst.model}' was still executing when "
            f"the exit timeout of {_secs(timeout_s)} s ended and was stopped: the server is "
            f"shutting down")


def execution_limit(cfg: Any, default_s: float) -> float:
    """The limit in seconds for a model (0: none): its ``execution_timeout_secs`` parameter,
    else ``default_s``. Raises INVALID_ARG naming the parameter on a value that is not a
    finite number of seconds >= 0."""
    param = cfg.parameters.get(PARAMETER) if cfg.parameters else None
    if param is None:
        return default_s
    raw = param.string_value.strip()
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise invalid_arg(f"model '{cfg.name}': parameter '{PARAMETER}' must be a number of "
                          f"seconds >= 0 (0: no limit), got '{param.string_value}'")
    return value


class Watchdog:
    """Sweeps the watched versions; ``expired(queue, instance, limit_s)`` is called once for
    an instance whose current execution began more than its version's limit ago.

    ``call_later`` and ``clock`` (nanoseconds, the queues' clock) are injectable: the unit
    tests drive sweep() with a fake clock and no event loop."""

    def __init__(self, expired: Callable[[SchedulingQueue, Instance, float], None],
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.expired = expired
        self._call_later = call_later
        self.clock = clock
        self.watched: dict[SchedulingQueue, float] = {}   # queue -> its limit in seconds
        self._timer: Any = None

    @property
    def period_s(self) -> float:
        if not self.watched:
            return MAX_PERIOD_S
        return min(MAX_PERIOD_S, max(MIN_PERIOD_S, min(self.watched.values()) / 8))

    def watch(self, queue: SchedulingQueue, limit_s: float) -> None:
        if limit_s <= 0:
            return
        self.watched[queue] = limit_s
        self._arm()   # (again: a smaller limit sweeps more often)

    def unwatch(self, queue: SchedulingQueue) -> None:
        if self.watched.pop(queue, None) is not None and not self.watched:
            self._disarm()

    def close(self) -> None:
        self.watched.clear()
        self._disarm()

    def sweep(self) -> list[tuple[Instance, float]]:
        """One pass: every instance over its limit, handed to ``expired``. Returns them."""
        now = self.clock()
        caught: list[tuple[SchedulingQueue, Instance, float]] = []
        for queue, limit_s in self.watched.items():
            limit_ns = int(limit_s * 1e9)
            for inst in queue.instances.values():
                if not inst.inflight:
                    continue
                started = min((b[0].dispatch_ns for b in inst.inflight.values() if b), default=now)
                if now - started >= limit_ns:
                    caught.append((queue, inst, limit_s))
        # (expired() changes the queues' instances: not while iterating them)
        for queue, inst, limit_s in caught:
            self.expired(queue, inst, limit_s)
        return [(inst, limit_s) for _, inst, limit_s in caught]

    # -------------------------------------------------------------------- timer
    def _arm(self) -> None:
        self._disarm()
        call_later = self._call_later
        if call_later is None:
            call_later = asyncio.get_running_loop().call_later
        self._timer = call_later(self.period_s, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        try:
            self.sweep()
        finally:
            if self.watched:
                self._arm()
