"""The direct path's routes: which instances frontends may send requests to without this
process, under which epoch, and the statistics those requests leave on their workers.
Owned by the Scheduler (main.py), which calls it at the moments below.

    an instance starts serving a qualifying version ─▶ open: a new epoch, DirectEpoch to
        its worker, frontends told (RepositoryChanged) and answered with its Route
    it is retired, or the server shuts down ─▶ withdraw: DirectEpoch(0), frontends told;
        the instance is busy (Instance.revoking) until its EpochSet says that what it read
        ran; requests still on their way are refused unrun and come here through the queue.
        Stopping it waits for that (revoke), at most the unload timeout
    it is killed while busy ─▶ announce: frontends fail what they sent it with that error
    its worker exits ─▶ exited: no route; frontends fail what they sent it, once, with the
        instance-exit text and its exit code (announce)
    statistics or metrics asked for ─▶ flush: each open route's worker sends its
        DirectStats, each frontend its EnsembleStats, applied before the answer, so both
        paths report exactly
    metrics asked for ─▶ count_pending: each frontend says how many requests wait on each
        route; all but the one an instance runs are pending
        (nv_inference_pending_request_count)

A version qualifies when the scheduler has nothing to decide per request: no dynamic or
sequence batcher, not an ensemble, not decoupled, no rate limiter, no execution timeout,
no TRITONSERVER_DELAY_SCHEDULER, no response cache; its frontends also keep requests with
client shared memory or a trace on the scheduled path.

An ensemble whose steps can only run one after another, with no max_inflight_requests,
is published as a chain (ModelInfo.chain): a frontend runs it over its steps' routes
(dataplane/chain.py) whenever every step has one, and reports it in EnsembleStats,
applied here like a worker's DirectStats (on_ensemble_stats; flush asks frontends too).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from services.common import messages as m
from services.scheduler.dispatch import Instance
from services.scheduler.ensemble_config import step_order
from services.scheduler.stats import StatsRegistry

log = logging.getLogger("trireme.scheduler")

FLUSH_WAIT_S = 2.0     # at most this long for a busy worker's statistics


def qualifies(config: Any, *, limiter: Any, execution_limit_s: float, delay_count: int,
              cached: bool = False) -> bool:
    """Whether requests to a version with this (completed) config may go direct (not when
    they are looked up in the response cache: the scheduler does that)."""
    return not (config.HasField("dynamic_batching") or config.HasField("sequence_batching")
                or config.HasField("ensemble_scheduling")
                or config.model_transaction_policy.decoupled
                or limiter is not None or execution_limit_s > 0 or delay_count > 0 or cached)


def chain(config: Any) -> list[m.ChainStep]:
    """The steps of an ensemble a frontend may run itself, in order; [] unless each step
    reads what the one before it wrote (a chain: nothing to run side by side) and
    max_inflight_requests leaves every request free to go (a limit is the scheduler's)."""
    if not config.HasField("ensemble_scheduling") or \
            config.ensemble_scheduling.max_inflight_requests:
        return []
    try:
        order = step_order(config)
    except ValueError:
        return []
    steps = [config.ensemble_scheduling.step[i] for i in order]
    for before, step in zip(steps, steps[1:], strict=False):
        if not set(step.input_map.values()) & set(before.output_map.values()):
            return []
    return [m.ChainStep(s.model_name, max(int(s.model_version), 0), dict(s.input_map),
                        dict(s.output_map)) for s in steps]


class DirectRoutes:
    def __init__(self, send_worker: Callable[[str, Any], bool],
                 send_frontend: Callable[[bytes, Any], None],
                 frontends: Callable[[], set[bytes]],
                 changed: Callable[..., None], stats: StatsRegistry,
                 custom_metrics: dict[str, list], revoke_wait_s: float) -> None:
        self._send_worker = send_worker
        self._send_frontend = send_frontend
        self._frontends = frontends
        self._counts: dict[tuple[int, bytes], asyncio.Future] = {}   # (ctl id, frontend) -> Pending
        self._changed = changed
        self._stats = stats
        self._custom_metrics = custom_metrics
        self._revoke_wait_s = revoke_wait_s   # --model-unload-timeout-secs
        self._epochs = itertools.count(1)
        self._open: dict[str, Instance] = {}                  # worker id -> instance with a route
        self._revoking: dict[str, Instance] = {}              # worker id -> withdrawn, not yet EpochSet
        self._announced: set[str] = set()                     # worker ids whose end frontends know
        self._acks: dict[tuple[str, int], asyncio.Future] = {}   # (worker id, epoch) -> EpochSet
        # (flush id, worker id or frontend identity) -> its DirectStats / EnsembleStats
        self._flushes: dict[tuple[int, str | bytes], asyncio.Future] = {}
        self._flush_ids = itertools.count(1)

    def open(self, inst: Instance) -> None:
        """``inst`` serves a qualifying version from now on: its route, under a new epoch."""
        if not inst.direct_addr:
            return
        inst.epoch = next(self._epochs)
        self._open[inst.worker_id] = inst
        self._send_worker(inst.worker_id, m.DirectEpoch(inst.epoch))
        self._changed([inst.model])

    def withdraw(self, inst: Instance) -> None:
        """No more direct requests for ``inst``; it is busy until its worker has run every
        one it read (EpochSet)."""
        if self._open.pop(inst.worker_id, None) is None:
            return
        inst.epoch = 0
        self._changed([inst.model])
        if self._send_worker(inst.worker_id, m.DirectEpoch(0)):
            inst.revoking = True
            self._revoking[inst.worker_id] = inst

    async def revoke(self, inst: Instance) -> None:
        """Withdraw ``inst``'s route; returns once its worker has run what it read, or
        after the unload timeout (it is then stopped all the same)."""
        self.withdraw(inst)
        if not inst.revoking:
            return
        fut = asyncio.get_running_loop().create_future()
        key = (inst.worker_id, 0)
        self._acks[key] = fut
        try:
            await asyncio.wait_for(fut, self._revoke_wait_s)
        except TimeoutError:
            log.warning("instance %s did not finish its direct requests within %.0f s",
                        inst.name, self._revoke_wait_s)
        finally:
            self._acks.pop(key, None)

    def announce(self, inst: Instance, code: int, text: str) -> None:
        """``inst``'s worker is killed or exited: frontends fail the requests they sent it
        directly with this error when its connection closes."""
        if inst.direct_addr and inst.worker_id not in self._announced:
            self._announced.add(inst.worker_id)   # (the first word stands: why it was killed)
            self._changed([inst.model], exits={inst.direct_addr: m.ErrorRecord(int(code), text)})

    def exited(self, inst: Instance) -> None:
        """``inst``'s worker is gone: its route with it (frontends see the connection close)."""
        if self._open.pop(inst.worker_id, None) is not None:
            inst.epoch = 0
        inst.revoking = False
        self._revoking.pop(inst.worker_id, None)
        self._announced.discard(inst.worker_id)
        waiting = [f for (worker_id, _), f in self._acks.items() if worker_id == inst.worker_id]
        waiting += [f for (_, worker_id), f in self._flushes.items() if worker_id == inst.worker_id]
        for fut in waiting:   # nothing more comes from it
            if not fut.done():
                fut.set_result(None)

    def frontend_lost(self, identity: bytes) -> None:
        """Nothing more comes from that frontend: what waits for it waits no longer."""
        for (_, who), fut in self._flushes.items():
            if who == identity and not fut.done():
                fut.set_result(None)
        for (_, who), fut in self._counts.items():
            if who == identity and not fut.done():
                fut.set_result({})   # (it holds no request any more)

    def routes(self, instances: list[Instance]) -> list[m.Route]:
        return [m.Route(i.version, i.direct_addr, i.epoch, i.name, i.shm_domain)
                for i in instances if i.epoch and i.worker_id in self._open]

    # ------------------------------------------------------------------ worker messages
    def on_epoch_set(self, msg: m.EpochSet) -> None:
        if msg.epoch == 0:
            inst = self._revoking.pop(msg.worker_id, None)
            if inst is not None:
                inst.revoking = False
        fut = self._acks.get((msg.worker_id, msg.epoch))
        if fut is not None and not fut.done():
            fut.set_result(None)

    def on_stats(self, inst: Instance | None, msg: m.DirectStats) -> None:
        """Apply a worker's direct executions to its version's statistics, as BatchDone's
        would be: each request arrived ``total_ns`` ago and waited ``queue_ns``."""
        if msg.metrics is not None:
            self._custom_metrics[msg.worker_id] = msg.metrics
        if inst is not None and msg.records:
            stats = self._stats.get(inst.model, inst.version)
            now = time.monotonic_ns()
            for r in msg.records:
                if r.cancelled:   # gone before it ran: as a request cancelled in a queue
                    stats.failed(r.total_ns, "CANCELED")
                    continue
                arrival = now - r.total_ns
                stats.executed(r.rows, [(arrival, arrival + r.queue_ns)], r.failed,
                               (r.compute_input_ns, r.compute_infer_ns, r.compute_output_ns), now)
        if msg.flush_id:
            fut = self._flushes.get((msg.flush_id, msg.worker_id))
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def flush_for_metrics(self) -> None:
        await asyncio.gather(self.flush(), self.count_pending())

    async def count_pending(self) -> None:
        """Each open route's version learns how many of its requests wait at its instances
        (VersionStats.direct_pending): every frontend says what it sent and has no answer
        for; an instance runs one of those."""
        if not self._open:
            return
        ctl_id = next(self._flush_ids)
        loop = asyncio.get_running_loop()
        asked = {}
        for identity in list(self._frontends()):
            fut = self._counts[(ctl_id, identity)] = loop.create_future()
            self._send_frontend(identity, m.GetPending(ctl_id))
            asked[identity] = fut
        try:
            if asked:
                await asyncio.wait(list(asked.values()), timeout=FLUSH_WAIT_S)
        finally:
            for identity in asked:
                self._counts.pop((ctl_id, identity), None)
        waiting: dict[str, int] = {}
        for fut in asked.values():
            if fut.done():
                for address, n in fut.result().items():
                    waiting[address] = waiting.get(address, 0) + n
        pending: dict[tuple[str, int], int] = {}
        for inst in self._open.values():
            key = (inst.model, inst.version)
            pending[key] = pending.get(key, 0) + max(0, waiting.get(inst.direct_addr, 0) - 1)
        for (model, version), n in pending.items():
            self._stats.get(model, version).direct_pending = n

    def on_pending(self, identity: bytes, msg: m.Pending) -> None:
        fut = self._counts.get((msg.ctl_id, identity))
        if fut is not None and not fut.done():
            fut.set_result(msg.waiting)

    def on_ensemble_stats(self, identity: bytes, msg: m.EnsembleStats) -> None:
        """Apply the ensemble requests a frontend ran over routes, as the ensemble's queue
        would have on the scheduled path (its steps count in their models' DirectStats)."""
        for r in msg.records:
            stats = self._stats.versions.get((r.model, r.version))
            if stats is None:   # (unloaded since)
                continue
            if r.reason:
                stats.failed(r.total_ns, r.reason)
            else:
                stats.completed(r.rows, r.total_ns)
        if msg.flush_id:
            fut = self._flushes.get((msg.flush_id, identity))
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def flush(self) -> None:
        """Every open route's worker sends what it ran since its last DirectStats (a busy
        one answers after its current execution), and every frontend the ensembles it ran
        over routes; at most FLUSH_WAIT_S is waited."""
        frontends = list(self._frontends())
        if not self._open and not frontends:
            return
        flush_id = next(self._flush_ids)
        loop = asyncio.get_running_loop()
        waits = []
        for worker_id in list(self._open):
            fut = self._flushes[(flush_id, worker_id)] = loop.create_future()
            if self._send_worker(worker_id, m.FlushStats(flush_id)):
                waits.append(fut)
        for identity in frontends:
            waits.append(loop.create_future())
            self._flushes[(flush_id, identity)] = waits[-1]
            self._send_frontend(identity, m.FlushStats(flush_id))
        try:
            if waits:
                await asyncio.wait(waits, timeout=FLUSH_WAIT_S)
        finally:
            for key in [k for k in self._flushes if k[0] == flush_id]:
                del self._flushes[key]
