"""The scheduler's worker side: the worker socket (workers' messages, hosts' messages,
results relayed to frontends) and the instances' processes (placed on a worker host,
spawned, stopped, their exits).

``Workers`` is an object the Scheduler (main.py) owns: the Scheduler's worker socket
delivers every message to ``on_message`` (one handler table), the queues send their
batches through ``send_batch``, and the ModelManager (lifecycle.py) is given ``spawn``,
``stop`` and ``wait_for_host``. It owns the loaded instances by pid and by worker id, the
loads in progress and the readiness probes in flight.

    spawn ─▶ hosts.place ─▶ host.process(...).start() ─▶ WorkerReady ─▶ LoadModel
          ◀─ ModelLoaded (completed config) ─┘
    worker exits (or its host is lost) ─▶ exited ─▶ ModelManager.instance_exited
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from services.common import logsettings
from services.common import messages as m
from services.common.errors import Code, TriremeError, instance_exited_text
from services.scheduler.dispatch import Instance, Pending

if TYPE_CHECKING:
    from services.scheduler.entries import ModelEntry
    from services.scheduler.hosts import Hosts
    from services.scheduler.routes import DirectRoutes

log = logging.getLogger("trireme.scheduler")

LOAD_TIMEOUT_S = 300.0


class Workers:
    """The worker socket's messages and the instances' processes. ``send`` writes encoded
    parts to a peer of the worker socket, ``relay`` a worker's result message to the
    frontend of a result address (False: none to go to); ``entries`` is the ModelManager's
    (read: a batch's queue), ``model_name`` turns a model key into the name workers load,
    ``instance_exited`` is the ModelManager's (restart, or fail what it held); ``hosts``,
    ``direct``, ``limiter`` and ``custom_metrics`` are the Scheduler's, and ``changed``,
    ``answered``, ``step_answered`` and ``send_frontend`` its hooks. A LoadModel tells the
    worker ``frontend_addr`` and ``step_addr()`` (the step socket, bound at start)."""

    def __init__(self, *, send: Callable[[bytes, Sequence[Any]], bool],
                 relay: Callable[[str, list[Any]], bool],
                 send_frontend: Callable[[bytes, Any], None],
                 hosts: Hosts, direct: DirectRoutes, limiter: Any,
                 custom_metrics: dict[str, list],
                 entries: dict[str, ModelEntry], model_name: Callable[[str], str],
                 instance_exited: Callable[[Instance, int], Awaitable[None]],
                 changed: Callable[..., None], answered: Callable[[Pending], None],
                 step_answered: Callable[[Any, list[Any]], None],
                 frontend_addr: str, step_addr: Callable[[], str]) -> None:
        self._send = send
        self._relay = relay
        self._send_frontend = send_frontend
        self._hosts = hosts
        self._direct = direct
        self._limiter = limiter                    # RateLimiter, or None
        self._custom_metrics = custom_metrics      # worker id -> its model's custom families
        self._entries = entries
        self._model_name = model_name
        self._instance_exited = instance_exited
        self._changed = changed
        self._answered = answered
        self._step_answered = step_answered
        self._frontend_addr = frontend_addr
        self._step_addr = step_addr
        self.by_pid: dict[int, Instance] = {}      # loaded instances by worker pid
        self.by_id: dict[str, Instance] = {}       # ... and by worker id
        self._spawning: dict[str, tuple[asyncio.Future, asyncio.Future]] = {}
        self._probes: dict[int, asyncio.Future] = {}
        self._probe_ids = itertools.count(1)
        self._handlers = self._handler_table()

    # ------------------------------------------------------------------ sending
    def send(self, worker_id: str, msg: Any, frames: Sequence[Any] = ()) -> bool:
        if self._send(worker_id.encode(), m.encode(msg, frames)):
            return True
        log.warning("cannot reach worker %s", worker_id)
        return False

    def send_batch(self, inst: Instance, batch: m.ExecuteBatch, frames: list[Any]) -> None:
        if not self.send(inst.worker_id, batch, frames):
            # The worker is going away; its exit handler fails what it holds.
            pass

    def broadcast(self, parts: Sequence[Any]) -> None:
        """``parts`` to every worker (one not connected yet gets what it needs with its
        WorkerReady) and every worker host."""
        for worker_id in {*self.by_id, *self._spawning}:
            self._send(worker_id.encode(), parts)
        for host in self._hosts.remote.values():
            self._send(host.identity, parts)

    def probe(self, worker_id: str) -> tuple[int, asyncio.Future]:
        """Ask a worker whether its model is ready: the future gets its ProbeResult (until
        ``forget_probe``)."""
        probe_id = next(self._probe_ids)
        answer = self._probes[probe_id] = asyncio.get_running_loop().create_future()
        self.send(worker_id, m.ProbeReady(probe_id))
        return probe_id, answer

    def forget_probe(self, probe_id: int) -> None:
        self._probes.pop(probe_id, None)

    # ------------------------------------------------------------------ the worker socket
    def on_message(self, identity: bytes, parts: list[Any]) -> None:
        msg, frames = m.decode(parts)
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s on the worker socket", type(msg).__name__)
            return
        handler(identity, msg, frames)

    def _handler_table(self) -> dict[type, Callable[[bytes, Any, list[Any]], None]]:
        """What workers and worker hosts send, and who handles it: the worker socket's one
        table."""
        def step_results(identity: bytes, msg: Any, frames: list[Any]) -> None:
            self._step_answered(msg, frames)   # a decoupled step's, after its batch

        return {
            m.BatchDone: self._on_batch_done,
            m.InferResult: step_results,
            m.InferResults: step_results,
            m.StreamsDone: self._on_streams_done,
            m.Relay: self._on_relay,
            m.DirectStats: lambda identity, msg, frames: self._direct.on_stats(
                self.by_id.get(msg.worker_id), msg),
            m.EpochSet: lambda identity, msg, frames: self._direct.on_epoch_set(msg),
            m.ProbeResult: self._on_probe_result,
            m.WorkerReady: self._on_worker_ready,
            m.ModelLoaded: self._on_model_loaded,
            m.HostHeartbeat: lambda identity, msg, frames: self._hosts.on_heartbeat(identity, msg),
            m.HostHello: lambda identity, msg, frames: self._hosts.on_hello(identity, msg),
            m.WorkerExited: lambda identity, msg, frames: self._hosts.on_worker_exited(identity, msg),
        }

    def _on_batch_done(self, identity: bytes, msg: m.BatchDone, frames: list[Any]) -> None:
        if msg.results:   # ensemble steps' results: their next steps go first
            self._step_answered(m.InferResults(msg.results), frames)
        if msg.metrics is not None:
            self._custom_metrics[msg.worker_id] = msg.metrics
        inst = self.by_id.get(msg.worker_id)
        if inst is None:
            return
        entry = self._entries.get(inst.model)
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

    def _on_streams_done(self, identity: bytes, msg: m.StreamsDone, frames: list[Any]) -> None:
        inst = self.by_id.get(msg.worker_id)
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

    def _on_relay(self, identity: bytes, msg: m.Relay, frames: list[Any]) -> None:
        # Results the worker could not send straight to the frontend: the frames are
        # the result message itself, passed on untouched.
        if not self._relay(msg.reply_to, frames):
            log.warning("results for %s have no frontend to go to", msg.reply_to)

    def _on_probe_result(self, identity: bytes, msg: m.ProbeResult, frames: list[Any]) -> None:
        fut = self._probes.get(msg.probe_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _on_worker_ready(self, identity: bytes, msg: m.WorkerReady, frames: list[Any]) -> None:
        self._send(identity, m.encode(logsettings.changed()))   # before its LoadModel
        futs = self._spawning.get(msg.worker_id)
        if futs and not futs[0].done():
            futs[0].set_result(msg)

    def _on_model_loaded(self, identity: bytes, msg: m.ModelLoaded, frames: list[Any]) -> None:
        if msg.metrics is not None:
            self._custom_metrics[msg.worker_id] = msg.metrics
        futs = self._spawning.get(msg.worker_id)
        if futs and not futs[1].done():
            futs[1].set_result(msg)

    # ------------------------------------------------------------------ processes
    async def spawn(self, inst: Instance, config: bytes, model_dir: str, autocomplete: bool):
        from protos import model_config_pb2 as mc
        host = self._hosts.place(inst)   # NoWorkerHost when none can run it
        loop = asyncio.get_running_loop()
        ready, loaded = loop.create_future(), loop.create_future()
        self._spawning[inst.worker_id] = (ready, loaded)
        handle = host.process(inst, lambda h, code: self.exited(inst, h, code))
        inst.handle, inst.host = handle, host
        host.instances += 1
        try:
            await handle.start()
            hello: m.WorkerReady = await asyncio.wait_for(ready, LOAD_TIMEOUT_S)
            inst.pid = hello.pid
            inst.direct_addr = hello.direct_addr
            domain_before, inst.shm_domain = inst.shm_domain, hello.shm_domain
            self.send(inst.worker_id, m.LoadModel(   # (the model's name, not its key)
                self._model_name(inst.model), inst.version, model_dir, config, inst.name, inst.kind,
                0 if inst.kind == "KIND_GPU" else inst.device_id, autocomplete,
                self._frontend_addr, self._step_addr()))
            reply: m.ModelLoaded = await asyncio.wait_for(loaded, LOAD_TIMEOUT_S)
        except TimeoutError:
            await handle.stop(1.0)
            raise TriremeError(Code.INTERNAL, f"instance '{inst.name}' of '{inst.model}' did not "
                                              f"load within {LOAD_TIMEOUT_S:.0f} s") from None
        finally:
            self._spawning.pop(inst.worker_id, None)
        if reply.error is not None:
            await handle.stop()
            raise TriremeError(reply.error.code, reply.error.message)
        inst.loaded = True
        inst.probe = reply.probe
        inst.resident_bytes = reply.resident_bytes
        inst.cancellable = reply.cancellable
        self.by_pid[inst.pid] = inst
        self.by_id[inst.worker_id] = inst
        if domain_before and domain_before != inst.shm_domain:
            self._changed([inst.model])   # restarted on another host: frontends ask again
        return mc.ModelConfig.FromString(reply.config)

    async def wait_for_host(self, inst: Instance, give_up: Any) -> None:
        await self._hosts.wait(lambda: give_up() or any(h.fits(inst) for h in self._hosts.all()))

    async def stop(self, inst: Instance) -> None:
        await self._direct.revoke(inst)   # what it ran directly ends first (and is counted)
        self.by_pid.pop(inst.pid, None)
        self.by_id.pop(inst.worker_id, None)
        self._custom_metrics.pop(inst.worker_id, None)
        if self._limiter is not None:    # its resources stop counting toward the defaults
            self._limiter.unregister(inst)
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

    async def exited(self, inst: Instance, handle: Any, code: int) -> None:
        if inst.host is not None:
            inst.host.instances -= 1
            inst.host = None
        self.by_pid.pop(inst.pid, None)
        self.by_id.pop(inst.worker_id, None)
        self._custom_metrics.pop(inst.worker_id, None)
        if (inst.epoch or inst.revoking) and not handle.stopping:
            # what frontends sent it directly fails as what the scheduler dispatched there
            self._direct.announce(inst, Code.INTERNAL, instance_exited_text(inst.name, inst.model, code))
        self._direct.exited(inst)
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
        await self._instance_exited(inst, code)   # fail what it held; restart it
