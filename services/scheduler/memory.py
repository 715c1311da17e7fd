"""Memory-aware model serving: a byte budget per worker host for the models' instances
(--model-memory-budget), and models loaded when a request names them
(--model-load-on-demand), making room by evicting the least recently used idle models.
Owned by the ModelManager (lifecycle.py), which calls it around each load:

    a load of a model with instances ─▶ admit: evict idle models, least recently used
        first, until the model's expected size fits on the fullest host (its own last
        measured size, else the loaded instances' mean); loads under a budget go one at
        a time, so two of them never count the same free bytes
    it serves ─▶ settle: each instance's worker measured itself after load
        and warmup (ModelLoaded.resident_bytes, its proportional set size); a host still
        over the budget evicts more, or says so in the log when nothing can go
    a request for a model that is not loaded (on demand) ─▶ demand: one load per model
        that every such request waits for, bounded by --model-load-on-demand-timeout-secs

Idle means: every version READY, nothing queued or running on the scheduler's side, and
no request seen for IDLE_MS (the direct path's requests are seen through their workers'
statistics, which arrive at most every 0.5 s). Never evicted: a model pinned by its config
(`parameters { key: "trireme.pinned" value { string_value: "true" } }`), an ensemble (it
holds no memory of its own), and a model an ensemble that is loaded uses as a step.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.common.errors import Code, TriremeError
from services.scheduler.entries import READY, ModelEntry

log = logging.getLogger("trireme.models")

IDLE_MS = 1000            # no request for this long: a model may be evicted
ROOM_POLL_S = 0.05        # how often a load waiting for room looks again
PIN_PARAMETER = "trireme.pinned"
EVICTED_REASON = "unloaded: evicted to fit the model memory budget (least recently used)"


@dataclass
class MemorySettings:
    budget_bytes: int = 0          # --model-memory-budget, per worker host (0: none)
    on_demand: bool = False        # --model-load-on-demand
    on_demand_timeout_s: float = 60.0   # --model-load-on-demand-timeout-secs


def pinned(config: Any) -> bool:
    p = config.parameters.get(PIN_PARAMETER) if config is not None else None
    return p is not None and p.string_value.strip().lower() in ("true", "1", "yes")


def over_budget_text(name: str, budget: int, held_by: list[str]) -> str:
    return (f"failed to load '{name}': the model memory budget of {budget} bytes is held by "
            f"models in use or pinned ({', '.join(held_by) or 'none'})")


def on_demand_timeout_text(name: str, timeout_s: float) -> str:
    return f"'{name}' is loading on demand and was not ready within {timeout_s:g} s"


class ModelMemory:
    def __init__(self, settings: MemorySettings, models: dict[str, ModelEntry],
                 evict: Callable[[str], Awaitable[None]],
                 clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> None:
        self.settings = settings
        self.models = models
        self.evict = evict                 # async (key): unload it, reason EVICTED_REASON
        self.clock_ms = clock_ms
        self._touched: dict[str, int] = {}      # key -> wall ms of its last load or demand
        self._sizes: dict[str, int] = {}        # key -> its instances' bytes when last loaded
        self._room = asyncio.Lock()             # one load under the budget at a time
        self._demands: dict[str, asyncio.Future] = {}
        self.loads: dict[str, int] = {}         # key -> loads (trireme_model_loads_total)
        self.evictions: dict[str, int] = {}     # key -> evictions (trireme_model_evictions_total)

    @property
    def budget(self) -> int:
        return self.settings.budget_bytes

    # ------------------------------------------------------------------ accounting
    def touch(self, key: str) -> None:
        self._touched[key] = self.clock_ms()

    def last_used_ms(self, e: ModelEntry) -> int:
        last = self._touched.get(e.key, 0)
        for v in e.versions.values():
            if v.queue is not None and v.queue.stats is not None:
                last = max(last, v.queue.stats.last_inference_ms)
        return last

    def resident(self, e: ModelEntry) -> int:
        return sum(i.resident_bytes for i in e.instances)

    def host_usage(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for e in self.models.values():
            for i in e.instances:
                h = _host_name(i)
                used[h] = used.get(h, 0) + i.resident_bytes
        return used

    def _fullest(self) -> int:
        return max(self.host_usage().values(), default=0)

    def _estimate(self, key: str, instances: int) -> int:
        if key in self._sizes:
            return self._sizes[key]
        sizes = [i.resident_bytes for e in self.models.values() for i in e.instances
                 if i.resident_bytes]
        return (sum(sizes) // len(sizes)) * instances if sizes else 0

    # ------------------------------------------------------------------ eviction
    def _steps_in_use(self) -> set[str]:
        return {k for e in self.models.values() if e.versions and e.config is not None
                for k in e.composing}

    def candidates(self, exclude: str) -> list[ModelEntry]:
        """Idle models that hold memory and may go, least recently used first."""
        now, steps = self.clock_ms(), self._steps_in_use()
        out = []
        for e in self.models.values():
            if e.key == exclude or e.key in steps or not e.instances or e.config is None \
                    or pinned(e.config) or not e.versions:
                continue
            if any(v.state != READY or (v.queue is not None and v.queue.busy)
                   for v in e.versions.values()) or any(i.busy for i in e.instances):
                continue
            if now - self.last_used_ms(e) < IDLE_MS:
                continue
            out.append(e)
        return sorted(out, key=self.last_used_ms)

    def _evictable_later(self, exclude: str) -> bool:
        """Whether a model that holds memory could become a candidate once idle."""
        steps = self._steps_in_use()
        return any(e.instances and e.key != exclude and e.key not in steps and e.config is not None
                   and not pinned(e.config) for e in self.models.values())

    def _held_by(self, exclude: str) -> list[str]:
        return sorted(e.name for e in self.models.values() if e.instances and e.key != exclude)

    async def _evict(self, e: ModelEntry) -> None:
        log.info("evicting '%s' (%d bytes, idle %d ms) to fit the model memory budget",
                 e.name, self.resident(e), self.clock_ms() - self.last_used_ms(e))
        self.evictions[e.key] = self.evictions.get(e.key, 0) + 1
        await self.evict(e.key)

    async def admit(self, key: str, name: str, instances: int, deadline_s: float) -> None:
        """Make room for a model about to load (called with the room lock held: load())."""
        need = self._estimate(key, instances)
        loop = asyncio.get_running_loop()
        while self._fullest() + need > self.budget:
            found = self.candidates(key)
            if found:
                await self._evict(found[0])
                continue
            # (what holds the budget is pinned, or in use until the deadline: no room)
            if not self._evictable_later(key) or loop.time() >= deadline_s:
                raise TriremeError(Code.UNAVAILABLE, over_budget_text(name, self.budget,
                                                                      self._held_by(key)))
            await asyncio.sleep(ROOM_POLL_S)   # a model in use may turn idle

    async def settle(self, key: str) -> None:
        """After a load (the entry serving): its measured size is known; a host over the
        budget evicts more."""
        async with self._room:
            e = self.models.get(key)
            if e is not None:
                self._sizes[key] = self.resident(e)
            while self._fullest() > self.budget:
                found = self.candidates(key)
                if not found:
                    log.warning("the models' resident size %d bytes exceeds the model memory "
                                "budget of %d bytes, and no model can be evicted now",
                                self._fullest(), self.budget)
                    return
                await self._evict(found[0])

    async def load(self, key: str, name: str, instances: int,
                   start: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``start`` (the load of ``key``'s instances) once its expected size fits;
        loads under a budget run one at a time. The caller settles once it serves."""
        self.loads[key] = self.loads.get(key, 0) + 1
        self.touch(key)
        if not self.budget or not instances:
            return await start()
        loop = asyncio.get_running_loop()
        async with self._room:
            await self.admit(key, name, instances, loop.time() + self.settings.on_demand_timeout_s)
            result = await start()
        self.touch(key)
        return result

    # ------------------------------------------------------------------ on demand
    async def demand(self, key: str, name: str, load: Callable[[], Awaitable[None]]) -> None:
        """Load ``key`` for a request that names it; every request waiting for the same
        model shares one load. Raises the load's error, or UNAVAILABLE at the timeout."""
        self.touch(key)
        fut = self._demands.get(key)
        if fut is None:
            fut = self._demands[key] = asyncio.ensure_future(load())
            fut.add_done_callback(lambda _f: self._demands.pop(key, None))
            fut.add_done_callback(_retrieved)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.settings.on_demand_timeout_s)
        except TimeoutError:
            raise TriremeError(Code.UNAVAILABLE, on_demand_timeout_text(
                name, self.settings.on_demand_timeout_s)) from None


def _host_name(inst: Any) -> str:
    return getattr(inst.host, "name", "") or "local"


def _retrieved(fut: asyncio.Future) -> None:
    """(a load nobody awaits any more: its error is logged where it happened)"""
    if not fut.cancelled():
        fut.exception()
