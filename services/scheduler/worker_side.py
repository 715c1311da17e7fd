"""The scheduler's worker side, a mixin of the Scheduler (main.py) whose state it uses:
the worker socket (workers' messages, hosts' messages, results relayed to frontends) and
the instances' processes (placed on a worker host, spawned, stopped, their exits).

    _spawn_instance ─▶ hosts.place ─▶ host.process(...).start() ─▶ WorkerReady ─▶ LoadModel
                   ◀─ ModelLoaded (completed config) ─┘
    worker exits (or its host is lost) ─▶ _worker_exited ─▶ ModelManager.instance_exited
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common import logsettings
from services.common import messages as m
from services.common.errors import Code, TriremeError, instance_exited_text
from services.scheduler.dispatch import Instance

if TYPE_CHECKING:
    from services.scheduler.hosts import Hosts
    from services.scheduler.lifecycle import ModelManager
    from services.scheduler.main import SchedulerSettings
    from services.scheduler.routes import DirectRoutes

log = logging.getLogger("trireme.scheduler")

LOAD_TIMEOUT_S = 300.0


class WorkerSide:
    """Scheduler's worker-facing methods; the state they use is the Scheduler's."""

    settings: SchedulerSettings
    models: ModelManager
    hosts: Hosts
    wsock: Any
    fsock: Any
    custom_metrics: dict[str, list]
    _spawning: dict[str, tuple[asyncio.Future, asyncio.Future]]
    _probes: dict[int, asyncio.Future]
    _by_pid: dict[int, Instance]
    _workers: dict[str, Instance]
    _routes: dict[str, bytes]
    step_addr: str                 # where ensemble steps' results are addressed
    limiter: Any                   # RateLimiter, or None
    direct: DirectRoutes

    if TYPE_CHECKING:
        def _changed(self, names: list[str], dead_pids: list[int] | None = None,
                     exits: dict[str, m.ErrorRecord] | None = None) -> None: ...

        def _send_frontend(self, identity: bytes, msg: Any, frames: Sequence[Any] = ()) -> None: ...

        def _answered(self, p: Any) -> None: ...

        def _step_answered(self, msg: Any, frames: list[Any]) -> None: ...

    # ------------------------------------------------------------------ workers
    def _send_worker(self, worker_id: str, msg: Any, frames: Sequence[Any] = ()) -> bool:
        if self.wsock.send(worker_id.encode(), m.encode(msg, frames)):
            return True
        log.warning("cannot reach worker %s", worker_id)
        return False

    def _send_batch(self, inst: Instance, batch: m.ExecuteBatch, frames: list[Any]) -> None:
        if not self._send_worker(inst.worker_id, batch, frames):
            # The worker is going away; its exit handler fails what it holds.
            pass

    def _on_worker(self, identity: bytes, parts: list[Any]) -> None:
        msg, frames = m.decode(parts)
        if isinstance(msg, m.BatchDone):
            if msg.results:   # ensemble steps' results: their next steps go first
                self._step_answered(m.InferResults(msg.results), frames)
            if msg.metrics is not None:
                self.custom_metrics[msg.worker_id] = msg.metrics
            inst = self._workers.get(msg.worker_id)
            if inst is None:
                return
            entry = self.models.models.get(inst.model)
            batch = inst.inflight.get(msg.batch_id)
            if batch is not None and msg.streaming:
                open_ = set(msg.streaming)
                inst.streaming.update({key: p for p in batch
                                       if (key := (p.req.reply_to, p.req.req_id)) in open_})
            if batch is not None:
                batch[0].stats.executed(
                    sum(p.req.batch_size for p in batch),
                    [(p.arrival_ns, p.dispatch_ns) for p in batch], msg.failed,
                    (msg.compute_input_ns, msg.compute_infer_ns, msg.compute_output_ns),
                    time.monotonic_ns(), msg.first)
            if batch is not None:
                for p in batch:
                    if p.regions and (p.req.reply_to, p.req.req_id) not in inst.streaming:
                        self._answered(p)
            vs = entry.versions.get(inst.version) if entry else None
            if vs is not None and vs.queue is not None and inst.worker_id in vs.queue.instances:
                vs.queue.batch_done(inst, msg.batch_id)
            else:
                inst.inflight.pop(msg.batch_id, None)
        elif isinstance(msg, (m.InferResult, m.InferResults)):   # a decoupled step's, later
            self._step_answered(msg, frames)
        elif isinstance(msg, m.StreamsDone):
            inst = self._workers.get(msg.worker_id)
            if inst is not None:
                now = time.monotonic_ns()
                for key, first in zip(msg.keys, msg.first or [-1] * len(msg.keys)):
                    done = inst.streaming.pop(key, None)
                    if done is None:
                        continue
                    if first >= 0:   # its first response came after its batch: it left then
                        done.stats.first_response(now - first - done.arrival_ns)
                    if done.regions:
                        self._answered(done)
        elif isinstance(msg, m.Relay):
            # Results the worker could not send straight to the frontend: the frames are
            # the result message itself, passed on untouched.
            frontend = self._routes.get(msg.reply_to)
            if frontend is None or not self.fsock.send(frontend, frames):
                log.warning("results for %s have no frontend to go to", msg.reply_to)
        elif isinstance(msg, m.DirectStats):
            self.direct.on_stats(self._workers.get(msg.worker_id), msg)
        elif isinstance(msg, m.EpochSet):
            self.direct.on_epoch_set(msg)
        elif isinstance(msg, m.ProbeResult):
            fut = self._probes.get(msg.probe_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, m.WorkerReady):
            self.wsock.send(identity, m.encode(logsettings.changed()))   # before its LoadModel
            futs = self._spawning.get(msg.worker_id)
            if futs and not futs[0].done():
                futs[0].set_result(msg)
        elif isinstance(msg, m.ModelLoaded):
            if msg.metrics is not None:
                self.custom_metrics[msg.worker_id] = msg.metrics
            futs = self._spawning.get(msg.worker_id)
            if futs and not futs[1].done():
                futs[1].set_result(msg)
        elif not self.hosts.on_message(identity, msg):
            log.warning("unexpected %s on the worker socket", type(msg).__name__)

    async def _spawn_instance(self, inst: Instance, config: bytes, model_dir: str, autocomplete: bool):
        from protos import model_config_pb2 as mc
        host = self.hosts.place(inst)   # NoWorkerHost when none can run it
        loop = asyncio.get_running_loop()
        ready, loaded = loop.create_future(), loop.create_future()
        self._spawning[inst.worker_id] = (ready, loaded)
        handle = host.process(inst, lambda h, code: self._worker_exited(inst, h, code))
        inst.handle, inst.host = handle, host
        host.instances += 1
        try:
            await handle.start()
            hello: m.WorkerReady = await asyncio.wait_for(ready, LOAD_TIMEOUT_S)
            inst.pid = hello.pid
            inst.direct_addr = hello.direct_addr
            domain_before, inst.shm_domain = inst.shm_domain, hello.shm_domain
            self._send_worker(inst.worker_id, m.LoadModel(   # (the model's name, not its key)
                self.models.split_key(inst.model)[0], inst.version, model_dir, config, inst.name, inst.kind,
                0 if inst.kind == "KIND_GPU" else inst.device_id, autocomplete,
                self.settings.frontend_addr, self.step_addr))
            reply: m.ModelLoaded = await asyncio.wait_for(loaded, LOAD_TIMEOUT_S)
        except TimeoutError:
            await handle.stop(1.0)
            raise TriremeError(Code.INTERNAL, f"instance '{inst.name}' of '{inst.model}' did not "
                                              f"load within {LOAD_TIMEOUT_S:.0f} s") from None
        finally:
            self._spawning.pop(inst.worker_id, None)
        if reply.error is not None:
            await handle.stop(5.0)
            raise TriremeError(reply.error.code, reply.error.message)
        inst.loaded = True
        inst.probe = reply.probe
        inst.cancellable = reply.cancellable
        self._by_pid[inst.pid] = inst
        self._workers[inst.worker_id] = inst
        if domain_before and domain_before != inst.shm_domain:
            self._changed([inst.model])   # restarted on another host: frontends ask again
        return mc.ModelConfig.FromString(reply.config)

    async def _wait_for_host(self, inst: Instance, give_up: Any) -> None:
        await self.hosts.wait(lambda: give_up() or any(h.fits(inst) for h in self.hosts.all()))

    async def _stop_instance(self, inst: Instance) -> None:
        await self.direct.revoke(inst)   # what it ran directly ends first (and is counted)
        self._by_pid.pop(inst.pid, None)
        self._workers.pop(inst.worker_id, None)
        self.custom_metrics.pop(inst.worker_id, None)
        if self.limiter is not None:    # its resources stop counting toward the defaults
            self.limiter.unregister(inst)
        if inst.handle is not None:
            await inst.handle.stop()

    def _end_streams(self, inst: Instance, code: int) -> None:
        """A decoupled model's requests still answering when its worker exited (their batch
        was done; the model sent from its own threads) get their final answer here. One
        whose final response crossed this in flight was answered already: its frontend
        drops this one."""
        streams, inst.streaming = inst.streaming, {}
        for p in streams.values():
            self._send_frontend(p.frontend, m.InferResult(p.req.req_id, error=m.ErrorRecord(
                int(Code.UNAVAILABLE), f"model instance '{inst.name}' of model '{inst.model}' "
                f"exited (exit code {code}) before the final response; the request was not "
                "completed")))

    async def _worker_exited(self, inst: Instance, handle: Any, code: int) -> None:
        if inst.host is not None:
            inst.host.instances -= 1
            inst.host = None
        self._by_pid.pop(inst.pid, None)
        self._workers.pop(inst.worker_id, None)
        self.custom_metrics.pop(inst.worker_id, None)
        if (inst.epoch or inst.revoking) and not handle.stopping:
            # what frontends sent it directly fails as what the scheduler dispatched there
            self.direct.announce(inst, Code.INTERNAL, instance_exited_text(inst.name, inst.model, code))
        self.direct.exited(inst)
        # Frontends unmap the dead worker's output segments (unlinked already by the supervisor).
        self._changed([inst.model], dead_pids=[handle.pid])
        self._end_streams(inst, code)
        futs = self._spawning.get(inst.worker_id)
        if futs is not None:
            for f in futs:
                if not f.done():
                    f.set_exception(TriremeError(
                        Code.INTERNAL, f"instance '{inst.name}' of model '{inst.model}' exited "
                                       f"with code {code} while loading"))
            return
        if handle.stopping:   # stopped on purpose (unload, reload, shutdown)
            return
        await self.models.instance_exited(inst, code)   # fail what it held; restart it
