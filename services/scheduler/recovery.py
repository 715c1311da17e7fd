"""What a worker's death or a watchdog kill does to its model. InstanceRecovery is an object
the ModelManager (lifecycle.py) owns: the Scheduler's exits reach it through
ModelManager.instance_exited, the watchdog's catches directly.

    worker exits ─▶ what it held fails ─▶ (backoff) restart ─▶ serving again
                                                     ├─ fails ─▶ instance lost: with none
                                                     │  left the version is UNAVAILABLE
                                                     └─ no worker host fits (its host was
                                                        lost) ─▶ UNAVAILABLE with none left,
                                                        until a host that fits joins ─▶ READY

    one execution outlasts the watchdog's limit (watchdog.py) ─▶ SIGKILL, what it held
        fails UNAVAILABLE ─▶ with no live instance left the version is LOADING (not ready)
        ─▶ the exit above restarts it ─▶ READY

It owns no model state: the entries are the ModelManager's, and the state transitions it
makes on them follow the same rules as its loads and unloads (lifecycle.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.common.errors import Code, TriremeError, instance_exited_text, not_ready_text
from services.scheduler.dispatch import Instance
from services.scheduler.entries import LOADING, READY, UNAVAILABLE, ModelEntry, VersionState
from services.scheduler.hosts import NoWorkerHost
from services.scheduler.queues import SchedulingQueue
from services.scheduler.retirement import Retirement
from services.scheduler.watchdog import execution_timeout_text

log = logging.getLogger("trireme.models")


class InstanceRecovery:
    """Restarts the ModelManager's instances, or declares them lost. ``models`` is the
    ModelManager's; ``retirement`` its Retirement, asked whether the server is closing, which
    entries are being retired, and to stop an instance that came back too late;
    ``spawn_instance``, ``changed`` and ``wait_for_host`` are the ModelManager's hooks."""

    def __init__(self, models: dict[str, ModelEntry], retirement: Retirement, *,
                 spawn_instance: Callable[..., Awaitable[object]],
                 changed: Callable[[list[str]], None], restart_backoff_s: float,
                 wait_for_host: Callable[..., Awaitable[None]] | None) -> None:
        self.models = models
        self.retirement = retirement
        # async (Instance, config bytes, model_dir, autocomplete) -> mc.ModelConfig
        self.spawn_instance = spawn_instance
        self.changed = changed                    # (model keys): their state changed
        self.restart_backoff_s = restart_backoff_s
        # async (Instance, give_up: () -> bool): returns once a worker host could run it
        self.wait_for_host = wait_for_host

    async def instance_exited(self, inst: Instance, code: int) -> None:
        """A loaded instance's worker exited on its own (not stopped, not while loading):
        what it held fails now; then it is restarted with the same config, unless the
        server is shutting down or its model was unloaded or reloaded meanwhile. (An
        instance the watchdog killed comes here too, with nothing left to fail.)"""
        inst.loaded = False
        why = instance_exited_text(inst.name, inst.model, code)
        entry = self._owner(inst)
        vs = entry.versions.get(inst.version) if entry else None
        if vs is not None and vs.queue is not None:
            vs.queue.worker_died(inst, why)
        if self.retirement.closing or inst.retired:
            return
        if entry is None or inst not in entry.instances or entry.config is None:
            return
        await asyncio.sleep(self.restart_backoff_s)
        if self.retirement.closing or inst.retired or inst not in entry.instances:
            return
        await self._restart(entry, vs, inst)

    def _owner(self, inst: Instance) -> ModelEntry | None:
        """The entry an instance belongs to: its model's, or one being retired (a reload
        keeps the old entry's workers until their batches are done)."""
        for e in (self.models.get(inst.model), *self.retirement.retiring):
            if e is not None and inst in e.instances:
                return e
        return self.models.get(inst.model)

    def execution_timed_out(self, queue: SchedulingQueue, inst: Instance, limit_s: float) -> None:
        """The watchdog caught ``inst`` in one execution longer than ``limit_s``: kill it,
        fail what it held (UNAVAILABLE, naming the limit). Its exit restarts it
        (instance_exited); until then a version left with no live instance is LOADING,
        so it reports not ready and turns new requests away (queued ones wait)."""
        why = execution_timeout_text(inst, limit_s)
        log.error("%s", why)
        inst.loaded = False
        if inst.handle is not None:
            inst.handle.kill()
        entry = self.models.get(inst.model)
        vs = entry.versions.get(inst.version) if entry is not None else None
        if (entry is not None and vs is not None and vs.queue is queue and vs.state == READY
                and not self.retirement.closing and not inst.retired
                and list(queue.instances) == [inst.worker_id]):
            # Not ready before its requests fail: a client that asks once it has its error
            # hears "not ready" (the frontends get this change first).
            vs.state, vs.reason = LOADING, why
            entry.info = None
            self.changed([inst.model])
        queue.worker_died(inst, why, Code.UNAVAILABLE)

    async def _restart(self, entry: ModelEntry, vs: VersionState | None, inst: Instance) -> None:
        """Bring an instance back with its model's completed config; one that cannot come
        back is lost (instance_lost)."""
        inst.loaded = False
        while True:
            try:
                await self.spawn_instance(inst, entry.config.SerializeToString(), str(entry.path),
                                          False)
                break
            except NoWorkerHost as e:
                if self.wait_for_host is None:
                    self.instance_lost(entry, inst, e.message)
                    return
                log.error("restart of %s waits: %s", inst.name, e.message)
                self._without_host(entry, vs, inst, e.message)
                await self.wait_for_host(inst, lambda: self.retirement.closing or inst.retired
                                         or inst not in entry.instances)
                if self.retirement.closing or inst.retired or inst not in entry.instances:
                    return
            except TriremeError as e:
                log.error("restart of %s failed: %s", inst.name, e.message)
                self.instance_lost(entry, inst, e.message)
                return
        if self.retirement.closing or inst.retired:   # unloaded or shutting down while it started
            await self.retirement.stop(inst)
            return
        if vs is not None and vs.queue is not None and inst in entry.instances:
            vs.queue.add_instance(inst)
            log.info("instance %s restarted (pid %d)", inst.name, inst.pid)
            if vs.state in (LOADING, UNAVAILABLE):   # the watchdog's or a host's: live again
                vs.state, vs.reason = READY, ""
                entry.info = None
                self.changed([inst.model])

    def _without_host(self, entry: ModelEntry, vs: VersionState | None, inst: Instance,
                      reason: str) -> None:
        """``inst`` waits for a worker host: with no other instance serving, its version is
        UNAVAILABLE meanwhile and what waits in its queue fails now (it stays an instance
        of the model: it comes back with the host)."""
        if vs is None or vs.queue is None or vs.queue.instances or vs.state == UNAVAILABLE:
            return
        vs.state, vs.reason = UNAVAILABLE, reason
        vs.queue.fail_queued(Code.UNAVAILABLE, not_ready_text(inst.model, inst.version))
        entry.info = None
        self.changed([inst.model])

    def instance_lost(self, entry: ModelEntry, inst: Instance, reason: str) -> None:
        """An instance that cannot come back: with none left, the version is UNAVAILABLE and
        what waits for it fails now instead of waiting forever."""
        if inst in entry.instances:
            entry.instances.remove(inst)
        vs = entry.versions.get(inst.version)
        if vs is None or vs.queue is None or vs.queue.instances:
            return
        vs.state, vs.reason = UNAVAILABLE, reason
        vs.queue.fail_queued(Code.UNAVAILABLE, not_ready_text(inst.model, inst.version))
        entry.info = None
        self.changed([inst.model])
