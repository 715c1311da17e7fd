"""How models stop: an unloaded or replaced version's retirement, and the server's
shutdown. Retirement is an object the ModelManager (lifecycle.py) owns and calls; it owns
the entries being retired, each worker's one stop in progress, and the closing flag.

    unload / replace ─▶ retire: queued requests fail, batches in flight get the unload
        timeout, then busy instances are killed (their requests fail) and the rest stop
    shutdown ─▶ work in flight and the frontends' own drain get --exit-timeout-secs; then
        the same, for every model; a worker that ignores SIGTERM is killed KILL_AFTER_S on

Every instance is stopped once (stop): a second SIGTERM could land inside the worker's
own SIGTERM handler.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable

from services.common.errors import Code, not_ready_text
from services.scheduler.dispatch import Instance
from services.scheduler.entries import ModelEntry
from services.scheduler.watchdog import Watchdog, exit_timeout_text, unload_timeout_text

log = logging.getLogger("trireme.models")

KILL_AFTER_S = 0.5          # shutdown: an idle worker's SIGTERM is followed by SIGKILL after this
DRAIN_POLL_S = 0.05


class Retirement:
    """Stops the ModelManager's instances. ``models`` (the loaded entries) and ``starting``
    (the loads in progress) are the ModelManager's, read here: shutdown stops their workers
    too. ``stop_instance``, ``withdraw`` and ``announce`` are the Scheduler's hooks, as
    the ModelManager is given them."""

    def __init__(self, models: dict[str, ModelEntry], starting: list[ModelEntry],
                 watchdog: Watchdog, *, stop_instance: Callable,
                 withdraw: Callable[[Instance], None],
                 announce: Callable[[Instance, int, str], None],
                 unload_timeout_s: float) -> None:
        self.models = models
        self.starting = starting
        self.watchdog = watchdog
        self.stop_instance = stop_instance        # async (Instance) -> None
        self.withdraw = withdraw                  # (Instance): no more direct requests (routes.py)
        self.announce = announce                  # (Instance, code, text): its direct requests' error
        self.unload_timeout_s = unload_timeout_s
        self.retiring: list[ModelEntry] = []     # unloads and replaced entries being stopped
        self.closing = False                      # shutdown() has begun: nothing (re)starts
        self._stops: dict[str, asyncio.Future] = {}   # worker_id -> its one stop in progress

    async def retire(self, entry: ModelEntry, reason: str) -> None:
        """Fail what is still queued, let the batches in flight finish within the unload
        timeout (an instance still executing then is killed, its requests fail), stop the
        workers. None of them restarts from now on."""
        for inst in entry.instances:
            inst.retired = True
            self.withdraw(inst)   # no more direct requests: what it runs counts as busy
        for vs in entry.versions.values():
            if vs.queue is not None:
                vs.queue.fail_queued(Code.UNAVAILABLE, not_ready_text(entry.name, vs.version))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.unload_timeout_s
        self.retiring.append(entry)
        try:
            while any(i.busy for i in entry.instances) and loop.time() < deadline:
                await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))
            for inst in list(entry.instances):
                if inst.busy:
                    self._kill_busy(entry, inst, unload_timeout_text(inst, self.unload_timeout_s))
            await self.stop_all(entry)
        finally:
            self.retiring.remove(entry)
        drop_override(entry)

    def _kill_busy(self, entry: ModelEntry, inst: Instance, why: str) -> None:
        """An instance that must stop while it executes: SIGKILL (whatever it runs may
        never return to see a SIGTERM), and each request it held fails UNAVAILABLE now."""
        log.error("%s", why)
        inst.loaded = False
        self.announce(inst, Code.UNAVAILABLE, why)   # its direct requests fail with this too
        if inst.handle is not None:
            inst.handle.kill()
        vs = entry.versions.get(inst.version)
        if vs is not None and vs.queue is not None:
            vs.queue.worker_died(inst, why, Code.UNAVAILABLE)

    async def stop_all(self, entry: ModelEntry) -> None:
        for vs in entry.versions.values():
            if vs.queue is not None:
                self.watchdog.unwatch(vs.queue)
        insts = list(entry.instances)
        await asyncio.gather(*(self.stop(i) for i in insts), return_exceptions=True)
        stopped = {id(i) for i in insts}
        entry.instances[:] = [i for i in entry.instances if id(i) not in stopped]

    def stop(self, inst: Instance) -> asyncio.Future:
        """Stop an instance once. A second caller (a cancelled load cleaning up while
        shutdown() stops the same workers) waits for the same stop: a second SIGTERM can
        land inside the worker's SIGTERM handler and deadlock it (services/workers/main.py)."""
        fut = self._stops.get(inst.worker_id)
        if fut is None:
            fut = self._stops[inst.worker_id] = asyncio.ensure_future(self.stop_instance(inst))
            fut.add_done_callback(lambda _f, k=inst.worker_id: self._stops.pop(k, None))
        return asyncio.shield(fut)

    async def shutdown(self, grace_s: float = 0.0, drained: asyncio.Future | None = None) -> None:
        """Stop every worker within ``grace_s`` + KILL_AFTER_S: queued and running work
        (and ``drained``, the frontends' own shutdown) gets ``grace_s`` to finish; then an
        instance still executing is killed and its requests fail, what is still queued
        fails, and the idle workers are stopped (SIGTERM, SIGKILL after KILL_AFTER_S)."""
        self.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        for e in (*self.models.values(), *self.retiring, *self.starting):
            for inst in e.instances:
                self.withdraw(inst)   # new requests through the queues; direct ones finish
        while loop.time() < deadline and ((drained is not None and not drained.done())
                                          or self._has_work()):
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))
        self.watchdog.close()
        entries = list({id(e): e for e in (*self.models.values(), *self.retiring,
                                           *self.starting)}.values())
        for e in entries:
            for vs in e.versions.values():
                if vs.queue is not None:
                    vs.queue.fail_queued(Code.UNAVAILABLE, not_ready_text(e.name, vs.version))
            for inst in list(e.instances):
                if inst.busy:
                    self._kill_busy(e, inst, exit_timeout_text(inst, grace_s))
        stops = asyncio.gather(*(self.stop_all(e) for e in entries), return_exceptions=True)
        kill_at = max(deadline, loop.time()) + KILL_AFTER_S
        try:
            await asyncio.wait_for(asyncio.shield(stops), max(0.0, kill_at - loop.time()))
        except TimeoutError:   # a worker that does not end on SIGTERM (its finalize hangs)
            for e in entries:
                for inst in e.instances:
                    if inst.handle is not None:
                        inst.handle.kill()
            await stops
        # Loads still in progress (explicit-mode requests are not cancelled) fail now that
        # their workers are gone and stop whatever they started; wait for them, bounded.
        until = loop.time() + KILL_AFTER_S
        while (self.starting or self.retiring or self._stops) and loop.time() < until:
            await asyncio.sleep(DRAIN_POLL_S)
        for e in self.models.values():
            drop_override(e)

    def _has_work(self) -> bool:
        """A batch running, or requests queued where an instance can still run them."""
        for e in self.models.values():
            for vs in e.versions.values():
                q = vs.queue
                if q is not None and q.instances and q.busy:
                    return True
        return False


def drop_override(entry: ModelEntry) -> None:
    if entry.override_dir is not None:
        shutil.rmtree(entry.override_dir.parent, ignore_errors=True)
