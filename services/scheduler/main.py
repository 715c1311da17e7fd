"""The scheduler process: routes requests from frontends to instance workers.

    frontends ──connect──▶ [frontend listener] ─┐
                                                ├─ one asyncio loop: ModelManager + queues
    workers   ──connect──▶ [worker listener]  ──┘
    workers ──connect──▶ frontends' result listeners (results go straight back; the
                         scheduler only hears BatchDone)

The Scheduler owns the sockets, the frontend side (its handler table, requests into their
queues, ensemble steps, answers) and the objects it calls, each given the state and hooks
it needs:

    Workers (worker_side.py)       the worker socket's handler table, the instances'
                                   processes: spawn, stop, exits; readiness probes
    ControlPlane (control_side.py) statistics, readiness, explicit load / unload, the log
                                   settings broadcast, the figures /metrics shows
    ModelManager (lifecycle.py)    the repository and every model state transition
    DirectRoutes (routes.py)       the direct path's routes and the statistics it leaves

Listeners and connections are services/common/transport's (stream sockets or ZeroMQ).
Tensor bytes never pass through here as copies: inline frames are forwarded by reference
(the received buffers) and shared-memory tensors are only references.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from services.common import logsettings, shm, transport
from services.common import messages as m
from services.common.errors import (
    CANCELLED_TEXT,
    Code,
    TriremeError,
    not_ready_text,
    still_loading,
    unknown_model,
)
from services.common.states import ModelState
from services.scheduler.batcher import BatcherConfig
from services.scheduler.control_side import ControlPlane
from services.scheduler.dispatch import Pending, VersionQueue, log_request
from services.scheduler.ensemble import EnsembleQueue
from services.scheduler.ensemble_config import step_order
from services.scheduler.entries import is_unloaded
from services.scheduler.hosts import Hosts, LocalHost
from services.scheduler.lifecycle import ModelManager
from services.scheduler.metrics import Metrics
from services.scheduler.queues import SchedulingQueue
from services.scheduler.rate_limiter import RateLimiter
from services.scheduler.response_cache import ResponseCache, make_cache, step_key
from services.scheduler.routes import DirectRoutes, qualifies
from services.scheduler.sequence import SequenceConfig, SequenceQueue
from services.scheduler.settings import SchedulerSettings
from services.scheduler.shm_regions import Registry
from services.scheduler.state import LoadedModels
from services.scheduler.stats import StatsRegistry
from services.scheduler.status_table import status_table
from services.scheduler.trace_settings import TraceManager
from services.scheduler.watchdog import execution_limit
from services.scheduler.worker_side import Workers

log = logging.getLogger("trireme.scheduler")

STEP_IDENTITY = b"\x00ensemble-steps"   # the "frontend" of ensemble steps: answers come back here


class Scheduler:
    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.frontends: set[bytes] = set()
        self._frontend_domains: dict[bytes, str] = {}   # identity -> its shm.domain()
        self._routes: dict[str, bytes] = {}             # result address -> frontend identity
        self._requests_from: dict[bytes, list] = {}     # identity -> [result address, count]
        self._step_queues: dict[int, Any] = {}          # ensemble step request id -> its EnsembleQueue
        self.loaded_models = LoadedModels(settings.state_file)
        self.hosts = Hosts(LocalHost(settings.worker_addr, settings.worker_args)
                           if settings.local_workers else None,
                           lambda identity, msg: self.wsock.send(identity, m.encode(msg)),
                           settings.worker_args)
        self.stats = StatsRegistry.for_settings(settings)
        self.regions = Registry(settings.allow_client_shm)
        # Triton's trace extension: settings, sampling, trace files (trace_settings.py)
        self.traces = TraceManager(settings.trace, self._send_frontend, lambda: self.frontends,
                                   STEP_IDENTITY)
        self.custom_metrics: dict[str, list] = {}   # worker id -> its model's custom families
        # The direct path's routes and the statistics its workers keep (routes.py); it
        # reaches workers through the worker side, made below (which calls it in turn)
        self.direct = DirectRoutes(lambda worker_id, msg: self.workers.send(worker_id, msg),
                                   self._send_frontend, lambda: self.frontends, self._changed,
                                   self.stats, self.custom_metrics, settings.unload_timeout_secs)
        # Triton's response cache, shared by every frontend (response_cache.py)
        self.cache = ResponseCache(make_cache(settings.cache, settings.repositories),
                                   self._send_frontend, lambda: list(self.frontends))
        self.limiter = (RateLimiter(settings.rate_limit_resources)
                        if settings.rate_limit == "execution_count" else None)
        # Triton's batching test hook: each batcher holds requests until this many are queued.
        self.delay_count = int(os.environ.get("TRITONSERVER_DELAY_SCHEDULER", "0") or 0)
        self.ready = False
        self._stopping = False
        # Instances' processes are the worker side's, made next (it reads the entries)
        self.models = ModelManager(
            settings.repositories,
            spawn_instance=lambda inst, config, model_dir, autocomplete: self.workers.spawn(
                inst, config, model_dir, autocomplete),
            stop_instance=lambda inst: self.workers.stop(inst), make_queue=self._make_queue,
            withdraw=self.direct.withdraw, announce=self.direct.announce,
            changed=self._changed, config_name=settings.config_name,
            disable_autocomplete=settings.disable_autocomplete, limiter=self.limiter,
            execution_timeout_s=settings.execution_timeout_secs,
            unload_timeout_s=settings.unload_timeout_secs,
            wait_for_host=lambda inst, give_up: self.workers.wait_for_host(inst, give_up),
            namespacing=settings.model_namespacing, memory=settings.memory)
        # The worker socket and the instances' processes (worker_side.py)
        self.workers = Workers(
            send=lambda identity, parts: self.wsock.send(identity, parts), relay=self._relay,
            send_frontend=self._send_frontend, hosts=self.hosts, direct=self.direct,
            limiter=self.limiter, custom_metrics=self.custom_metrics,
            entries=self.models.models, model_name=lambda key: self.models.split_key(key)[0],
            instance_exited=self.models.instance_exited, changed=self._changed,
            answered=self._answered, step_answered=self._step_answered,
            frontend_addr=settings.frontend_addr, step_addr=lambda: self.step_addr)
        # Statistics, readiness, explicit load / unload, log settings (control_side.py)
        self.control = ControlPlane(
            explicit=settings.control_mode == "explicit", models=self.models,
            stats=self.stats, hosts=self.hosts, loaded_models=self.loaded_models,
            frontends=lambda: self.frontends, requests_from=self._requests_from,
            send_frontend=self._send_frontend,
            frontend_send=lambda identity, parts: self.fsock.send(identity, parts),
            probe=self.workers.probe, forget_probe=self.workers.forget_probe,
            broadcast_workers=self.workers.broadcast)
        self.metrics = Metrics(self.stats, self.control.ready_versions,
                               lambda: list(self.custom_metrics.values()),
                               self.control.cluster_metrics,
                               lambda key: self.models.split_key(key),
                               self.direct.flush_for_metrics,
                               lambda: self.cache.cache.gauges() if self.cache.cache else [])
        self._frontend_handlers = self._frontend_table()
        # What answers an ensemble step (the step socket's table; the worker socket's
        # results and the errors made here for a step come through it too)
        self._step_handlers: dict[type, Callable[[Any, list[Any]], None]] = {
            m.InferResult: self._step_result,
            m.InferResults: self._step_results,
        }

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for seg in shm.sweep_stale():
            log.info("removed stale shared-memory segment %s", seg)
        self.fsock = await transport.listen(self.settings.frontend_addr, self._on_frontend,
                                            on_lost=self._frontend_lost)
        self.wsock = await transport.listen(self.settings.worker_addr, self.workers.on_message,
                                            on_lost=self.hosts.peer_lost)
        self.hosts.start()
        # Results of ensemble steps come here: a socket beside the worker socket's path, or a
        # TCP port on every interface (workers reach it by their own route to the scheduler).
        addr = self.settings.worker_addr
        scheme, _, path = addr.partition("://")
        self.ssock = await transport.listen(
            f"{scheme}://{os.path.join(os.path.dirname(path), 'steps.sock')}"
            if scheme in ("unix", "ipc") else "stream://0.0.0.0:0", self._on_step_results)
        self.step_addr = self.ssock.address
        self.metrics_runner = None
        if self.settings.allow_metrics:
            self.metrics_runner = await self.metrics.serve(self.settings.host, self.settings.metrics_port)

    async def load_initial(self) -> list[str]:
        """Load what the repository and the flags name; returns the models that failed."""
        if not self.hosts.any_host():
            log.info("waiting for a worker host (trireme workers --scheduler %s)",
                     self.settings.worker_addr)
            await self.hosts.wait(self.hosts.any_host)
        sources = self.models.scan()
        loads: dict[str, tuple[Any, dict[str, bytes]]] = {}   # name -> (override, files)
        if self.settings.control_mode == "explicit":
            for n in self.settings.load_models:
                loads.update({s: (None, {}) for s in (sources if n == "*" else [n])})
            from services.common.config import config_from_json
            for n, config_json, files in self.loaded_models.entries():
                loads[n] = (config_from_json(config_json) if config_json else None, files)
        else:
            loads = {n: (None, {}) for n in sources}
        names = sorted(loads)
        results = await asyncio.gather(*(self.models.load(n, *loads[n]) for n in names),
                                       return_exceptions=True)
        # (each failure was logged where it happened, once: lifecycle.py)
        failed = [n for n, r in zip(names, results) if isinstance(r, BaseException)]
        log.info("\n%s", status_table(self.models.index(ready_only=False)), extra={"table": True})
        self.ready = True
        self._changed([])
        if self.settings.control_mode == "poll":
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        return failed

    async def _poll_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.models.poll()
            except Exception:
                log.exception("repository poll failed")

    async def stop(self, grace_s: float = 0.0, drained: asyncio.Future | None = None) -> None:
        """Work in flight gets ``grace_s`` (--exit-timeout-secs) to finish, and the frontends
        (``drained``: their own shutdown) to answer; then every worker stops, bounded
        (ModelManager.shutdown)."""
        self._stopping = True
        if getattr(self, "_poller", None) is not None:
            self._poller.cancel()
        await self.models.shutdown(grace_s, drained)
        self.hosts.close()
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        self.fsock.close()
        self.wsock.close()
        self.ssock.close()
        self.traces.close()   # traces still held go to the trace file

    # ------------------------------------------------------------------ frontends
    def _send_frontend(self, identity: bytes, msg: Any, frames: Sequence[Any] = ()) -> None:
        if identity == STEP_IDENTITY:   # an ensemble step's answer, made here (an error)
            self._step_answered(msg, list(frames))
            return
        if not self.fsock.send(identity, m.encode(msg, frames)):   # that frontend is gone
            (log.debug if self._stopping else log.warning)("cannot reach frontend %r", identity)
            self.frontends.discard(identity)

    def _relay(self, reply_to: str, parts: list[Any]) -> bool:
        """A worker's result message, relayed to the frontend of its result address (False:
        no frontend to go to)."""
        frontend = self._routes.get(reply_to)
        return frontend is not None and self.fsock.send(frontend, parts)

    def _frontend_lost(self, identity: bytes) -> None:
        """Its connection closed: forget it (a frontend that comes back says hello again)."""
        self.frontends.discard(identity)
        self._frontend_domains.pop(identity, None)
        self.direct.frontend_lost(identity)
        self.cache.frontend_lost(identity)
        self.traces.frontend_lost(identity)   # its traces never complete
        route = self._requests_from.pop(identity, None)
        if route is not None and self._routes.get(route[0]) == identity:
            del self._routes[route[0]]

    def _on_frontend(self, identity: bytes, parts: list[Any]) -> None:
        msg, frames = m.decode(parts)
        handler = self._frontend_handlers.get(type(msg))
        if handler is None:
            log.warning("dropped a %s from frontend %r: not a message frontends send",
                        type(msg).__name__, identity)
            return
        handler(identity, msg, frames)

    def _frontend_table(self) -> dict[type, Callable[[bytes, Any, list[Any]], None]]:
        """What a frontend sends, and who handles it: the frontend socket's one table."""
        def load(identity: bytes, msg: m.LoadModelRequest, frames: list[Any]) -> None:
            asyncio.get_running_loop().create_task(self.control.load(identity, msg))

        def unload(identity: bytes, msg: m.UnloadModelRequest, frames: list[Any]) -> None:
            asyncio.get_running_loop().create_task(self.control.unload(identity, msg))

        def check_ready(identity: bytes, msg: m.CheckReady, frames: list[Any]) -> None:
            asyncio.get_running_loop().create_task(self.control.check_ready(identity, msg))

        def regions(identity: bytes, msg: Any, frames: list[Any]) -> None:
            reply, forget = self.regions.answer(msg)
            self._forget_regions(forget)
            self._send_frontend(identity, reply)

        def set_log_settings(identity: bytes, msg: m.SetLogSettings, frames: list[Any]) -> None:
            settings = logsettings.answer(msg)
            if settings.error is None:
                self.control.log_settings_changed()   # (before the answer: the asker has them then)
            self._send_frontend(identity, settings)

        return {
            m.InferRequest: self._infer_one,
            m.InferRequests: self._on_infer_requests,
            m.ReleaseBlocks: self._on_release_blocks,
            m.GetModelInfo: self._on_model_info,
            m.GetStats: lambda identity, msg, frames: self._after_flush(
                identity, lambda: self.control.statistics(msg), self.direct.flush),
            m.CheckReady: check_ready,
            m.GetIndex: lambda identity, msg, frames: self._send_frontend(
                identity, m.Index(msg.ctl_id, self.models.index(msg.ready_only))),
            m.LoadModelRequest: load,
            m.UnloadModelRequest: unload,
            m.Cancel: lambda identity, msg, frames: self._cancel(identity, msg),
            m.ShmRegister: regions,
            m.ShmUnregister: regions,
            m.ShmStatus: regions,
            m.GetLogSettings: lambda identity, msg, frames: self._send_frontend(
                identity, logsettings.answer(msg)),
            m.SetLogSettings: set_log_settings,
            m.FrontendHello: self._on_hello,
            m.Pending: lambda identity, msg, frames: self.direct.on_pending(identity, msg),
            m.CacheInsert: self.cache.on_insert,
            m.CacheHit: self._on_cache_hit,
            m.EnsembleStats: lambda identity, msg, frames: self.direct.on_ensemble_stats(
                identity, msg),
            m.TraceSettingsRequest: self._on_trace_settings,
            m.TraceRecord: lambda identity, msg, frames: self.traces.record(msg),
            m.GetMetrics: lambda identity, msg, frames: self._after_flush(
                identity, lambda: m.MetricsText(msg.ctl_id, self.metrics.render()
                                                if self.settings.allow_metrics else ""),
                self.direct.flush_for_metrics),
        }

    def _after_flush(self, identity: bytes, answer: Callable[[], Any],
                     flush: Callable[[], Awaitable[None]]) -> None:
        """Answer with what ``answer()`` makes once the direct path's figures are in
        (``flush``: routes.py; at once when no route is open)."""
        async def flushed() -> None:
            await flush()
            self._send_frontend(identity, answer())
        asyncio.get_running_loop().create_task(flushed())

    def _on_infer_requests(self, identity: bytes, msg: m.InferRequests,
                           frames: list[Any]) -> None:
        for req in msg.requests:   # they share `frames` (indexes count over it)
            self._infer_one(identity, req, frames)

    def _on_release_blocks(self, identity: bytes, msg: m.ReleaseBlocks,
                           frames: list[Any]) -> None:
        inst = self.workers.by_pid.get(msg.owner_pid)
        if inst is not None:
            self.workers.send(inst.worker_id, m.ReleaseOutputs(msg.blocks))

    def _on_model_info(self, identity: bytes, msg: m.GetModelInfo, frames: list[Any]) -> None:
        # The cached ModelInfo is shared: answer with a copy carrying this ctl_id.
        info = self.models.info(msg.model)
        if not self.ready and (info.error is not None or ModelState.READY not in
                               info.versions.values()):
            # Starting (or restarted): nothing is "unknown" or "unavailable" for good yet.
            err = still_loading(msg.model)
            info = m.ModelInfo(0, msg.model, error=m.ErrorRecord(int(err.code), err.message))
        elif ModelState.READY not in info.versions.values() and \
                (key := self.models.loadable(msg.model)) is not None:
            if msg.load:   # an inference request: answered once the model is loaded
                asyncio.get_running_loop().create_task(self._load_then_info(identity, msg, key))
                return
            info = msgspec.structs.replace(info, loadable=True)
        self._send_info(identity, msg, info)

    async def _load_then_info(self, identity: bytes, msg: m.GetModelInfo, key: str) -> None:
        try:
            await self.models.demand(key)
            info = self.models.info(msg.model)
        except TriremeError as e:
            info = m.ModelInfo(0, msg.model, error=m.ErrorRecord(int(e.code), e.message))
        self._send_info(identity, msg, info)

    def _send_info(self, identity: bytes, msg: m.GetModelInfo, info: m.ModelInfo) -> None:
        entry = self.models.lookup(msg.model)
        self._send_frontend(identity, msgspec.structs.replace(
            info, ctl_id=msg.ctl_id, shm=self._shares_memory(identity, msg.model),
            routes=self.direct.routes(entry.instances) if entry is not None else [],
            cache=entry is not None and entry.config is not None
            and self.cache.enabled(entry.name, entry.config),
            cache_bytes=self.cache.frontend_bytes))

    def _on_cache_hit(self, identity: bytes, msg: m.CacheHit, frames: list[Any]) -> None:
        entry = self.models.lookup(msg.model)
        vs = entry.versions.get(msg.version) if entry is not None else None
        if vs is not None and vs.queue is not None and vs.queue.stats is not None:
            self.cache.frontend_hit(msg, vs.queue.stats)

    def _on_hello(self, identity: bytes, msg: m.FrontendHello, frames: list[Any]) -> None:
        self.frontends.add(identity)
        self._frontend_domains[identity] = msg.shm_domain
        if msg.result_addr:
            self._routes[msg.result_addr] = identity
        self._requests_from[identity] = [msg.result_addr or repr(identity), 0]
        self._send_frontend(identity, m.RepositoryChanged([], self.server_ready()))
        self._send_frontend(identity, logsettings.changed())
        self.traces.hello(identity)   # which requests to mark as traceable

    def _on_trace_settings(self, identity: bytes, msg: m.TraceSettingsRequest,
                           frames: list[Any]) -> None:
        entry = self.models.lookup(msg.model) if msg.model else None
        self._send_frontend(identity, self.traces.answer(
            msg, entry is not None and entry.ready_version(0) is not None))

    def _shares_memory(self, identity: bytes, model: str) -> bool:
        """Whether every instance of ``model`` can map this frontend's segments: then it
        puts large inputs in shared memory, else it sends them inline."""
        domain = self._frontend_domains.get(identity, "")
        domains = self._instance_domains(model, set())
        return bool(domain) and domains == {domain}

    def _instance_domains(self, model: str, seen: set[str]) -> set[str]:
        """The shm domains of a model's instances (an ensemble's: its steps' models')."""
        entry = self.models.lookup(model)
        if entry is None or model in seen:
            return set()
        seen.add(model)
        out = {i.shm_domain for i in entry.instances}
        for name in entry.composing:
            out |= self._instance_domains(name, seen)
        return out

    def server_ready(self) -> bool:
        if not self.ready:
            return False
        if not self.settings.strict_readiness:
            return True
        # Strict readiness: every model that should be loaded is.
        return all(any(v.state == ModelState.READY for v in e.versions.values())
                   for e in self.models.models.values() if e.versions and
                   not all(is_unloaded(v.reason) for v in e.versions.values()))

    def _changed(self, names: list[str], dead_pids: list[int] | None = None,
                 exits: dict[str, m.ErrorRecord] | None = None) -> None:
        if not hasattr(self, "fsock"):
            return
        msg = m.RepositoryChanged(names, self.server_ready(), dead_pids or [], exits or {})
        for identity in list(self.frontends):
            self._send_frontend(identity, msg)

    def _infer_one(self, identity: bytes, req: m.InferRequest, frames: list[Any],
                   shm_domain: str | None = None, entry: Any = None) -> None:
        """Queue one request; whatever it holds, it alone fails (the requests that came in
        the same message are queued all the same) and it still gets its answer."""
        counter = self._requests_from.get(identity)
        if counter is not None:
            counter[1] += 1
        self._infer_guarded(identity, req, frames, shm_domain, entry)

    def _infer_guarded(self, identity: bytes, req: m.InferRequest, frames: list[Any],
                       shm_domain: str | None, entry: Any) -> None:
        try:
            self._infer(identity, req, frames, shm_domain, entry)
        except Exception as e:
            log.exception("request %d for model '%s' could not be queued", req.req_id, req.model)
            self._fail_req(identity, req, Code.INTERNAL,
                           f"the request could not be queued: {type(e).__name__}: {e}")

    def _infer(self, identity: bytes, req: m.InferRequest, frames: list[Any],
               shm_domain: str | None = None, entry: Any = None) -> None:
        arrived = time.monotonic_ns()
        if entry is None:   # (an ensemble step's comes resolved: ModelManager.step_entry)
            entry = self.models.lookup(req.model)
        vs = entry.ready_version(req.version) if entry is not None else None
        if vs is None or vs.queue is None:
            if self.ready and (key := self.models.loadable(req.model)) is not None:
                asyncio.get_running_loop().create_task(
                    self._load_then_infer(identity, req, frames, shm_domain, key))
            elif entry is None:
                err = unknown_model(req.model) if self.ready else still_loading(req.model)
                self._fail_req(identity, req, err.code, err.message)
            else:
                v = req.version or max(entry.versions, default=0)
                self._fail_req(identity, req, Code.UNAVAILABLE, not_ready_text(req.model, v))
            return
        req.version = vs.version
        if req.cache_key and vs.queue.stats is not None and vs.queue.stats.cached and \
                self.cache.lookup(identity, req, vs.queue.stats, arrived, lambda: self._looked_up(
                    identity, req, frames, shm_domain, entry)):
            return   # answered from the response cache, or being looked up
        regions: tuple[str, ...] = ()
        if req.out_regions or any(t.region for t in req.inputs):
            try:
                regions = self.regions.resolve(req)
            except TriremeError as e:
                self._fail_req(identity, req, e.code, e.message)
                return
        p = Pending(identity, req, frames, time.monotonic_ns(), stats=vs.queue.stats,
                    shm_domain=self._frontend_domains.get(identity, "")
                    if shm_domain is None else shm_domain, regions=regions)
        if req.trace:   # its frontend may trace it: sampled here (trace_settings.py)
            p.trace = self.traces.sample(identity, req, p.arrival_ns)
        try:
            vs.queue.enqueue(p)
        except TriremeError as e:    # the queue is full
            self._fail(p, e.code, log_request(req.request_id, e.message), "REJECTED")

    async def _load_then_infer(self, identity: bytes, req: m.InferRequest, frames: list[Any],
                               shm_domain: str | None, key: str) -> None:
        """A request for a model loaded on demand (one a direct route refused as it was
        evicted, or one sent before its frontend knew): queued once it is loaded."""
        try:
            await self.models.demand(key)
        except TriremeError as e:
            self._fail_req(identity, req, e.code, e.message)
            return
        self._infer_guarded(identity, req, frames, shm_domain, None)

    def _looked_up(self, identity: bytes, req: m.InferRequest, frames: list[Any],
                   shm_domain: str | None, entry: Any) -> None:
        """A request the (awaited) response cache did not have: queued now."""
        req.cache_key = b""
        self._infer_guarded(identity, req, frames, shm_domain, entry)

    def _cancel(self, identity: bytes, msg: m.Cancel) -> None:
        """Callers gone: a queued request leaves its queue and gets its one final answer,
        CANCELLED, so the frontend frees its inputs (counted as Triton does: a failure,
        reason CANCELED). The others are running: the instances that can stop early are
        told (a decoupled request may still be streaming after its batch is done, so all
        of the version's); the rest finish and their results are dropped."""
        entry = self.models.lookup(msg.model)
        vs = entry.versions.get(msg.version) if entry is not None else None
        if vs is None or vs.queue is None:
            return
        removed, running = vs.queue.cancel(identity, msg.req_ids)
        for p in removed:
            self._fail(p, Code.CANCELLED, CANCELLED_TEXT, "CANCELED")
        if running:
            fwd = m.encode(m.Cancel(msg.reply_to, msg.model, msg.version, running))
            for inst in vs.queue.instances.values():
                channel = inst.worker_id.encode() + m.CANCEL_CHANNEL
                if inst.cancellable and not self.wsock.send(channel, fwd):
                    log.debug("cannot reach the cancel channel of %s", inst.worker_id)

    def _make_queue(self, model: str, version: int, config: Any) -> SchedulingQueue:
        args = (model, version, BatcherConfig.from_model_config(config, self.delay_count),
                self.workers.send_batch, self._fail, asyncio.get_running_loop().call_later, self.limiter)
        stats = self.stats.fresh(model, version, config)
        stats.cached = self.cache.enabled(self.models.split_key(model)[0], config)
        if config.HasField("ensemble_scheduling"):
            return EnsembleQueue(model, version, config, step_order(config), self._submit_step,
                                 self._respond, self._fail, self._release_blocks, stats)
        if config.HasField("sequence_batching"):
            return SequenceQueue(*args, stats=stats,
                                 sequence=SequenceConfig.from_model_config(config))
        direct = self.settings.direct_path and qualifies(
            config, limiter=self.limiter, delay_count=self.delay_count,
            execution_limit_s=execution_limit(config, self.settings.execution_timeout_secs),
            cached=stats.cached)
        return VersionQueue(*args, stats=stats, on_serving=self.direct.open if direct else None)

    # ------------------------------------------------------------------ ensemble steps
    def _submit_step(self, queue: EnsembleQueue, req: m.InferRequest, frames: list[Any],
                     shm_domain: str) -> None:
        """Queue an ensemble step at its composing model; its answer reaches ``queue``."""
        req.reply_to = self.step_addr
        self._step_queues[req.req_id] = queue
        if self._instance_domains(queue.model, set()) != {shm_domain}:
            shm_domain = ""   # a step's output in shared memory must be mappable by every next one
        run = queue.runs.get(req.req_id)
        if run is not None and run[0].p.trace is not None:   # a traced request's step: a child trace
            req.trace = 1
            self.traces.expect_child(req.req_id, run[0].p.trace)
        entry = self.models.step_entry(queue.model, req.model)
        if self.cache.cache is not None:   # its model's own cache, as Triton's composing models
            model = entry if entry is not None else self.models.lookup(req.model)
            if model is not None:
                req.cache_key = step_key(model, req, frames)
        self._infer_one(STEP_IDENTITY, req, frames, shm_domain, entry)

    def _on_step_results(self, identity: bytes, parts: list[Any]) -> None:
        """The step socket's loop: workers send only ensemble steps' results here."""
        msg, frames = m.decode(parts)
        self._step_answered(msg, frames)

    def _step_answered(self, msg: Any, frames: list[Any]) -> None:
        """An ensemble step's answer (from the step socket, from the worker socket, or made
        here: an error): the step table's entry for it."""
        handler = self._step_handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s as an ensemble step's answer", type(msg).__name__)
            return
        handler(msg, frames)

    def _step_results(self, msg: m.InferResults, frames: list[Any]) -> None:
        for r in msg.results:   # (they share `frames`)
            self._step_result(r, frames)

    def _step_result(self, r: m.InferResult, frames: list[Any]) -> None:
        # (a decoupled step answers several times: the last has final set)
        queue = (self._step_queues.pop if r.final else self._step_queues.get)(r.req_id, None)
        if r.trace and r.final:   # a traced step: its part of the trace
            self.traces.step_done(r)
        if r.final and self.cache.cache is not None:   # a miss's answer: kept
            self.cache.step_answered(STEP_IDENTITY, r, frames)
        if queue is not None:
            queue.step_result(r, frames)

    def _respond(self, p: Pending, result: m.InferResult, frames: list[Any]) -> None:
        if p.trace is not None and result.final:   # a traced ensemble request's answer
            self.traces.answered(p.trace, result)
        self._send_frontend(p.frontend, result, frames)
        if result.final:
            self._answered(p)

    def _answered(self, p: Pending) -> None:
        """``p`` has its final answer: the client regions it held may go."""
        if p.regions:
            self._forget_regions(self.regions.release(p.regions))

    def _forget_regions(self, keys: list[str]) -> None:
        """Workers unmap these objects: sent after every batch that may use them, on the
        same connections."""
        if keys:
            for worker_id in list(self.workers.by_id):
                self.workers.send(worker_id, m.ForgetRegions(keys))

    def _release_blocks(self, blocks: list[tuple[str, int]]) -> None:
        """Hand shared-memory blocks back to the workers that own them."""
        for pid, owned in shm.by_owner(blocks).items():
            inst = self.workers.by_pid.get(pid)
            if inst is not None:
                self.workers.send(inst.worker_id, m.ReleaseOutputs(owned))

    def _fail_req(self, identity: bytes, req: m.InferRequest, code: int, message: str) -> None:
        self._send_frontend(identity, m.InferResult(req.req_id, error=m.ErrorRecord(int(code), message)))

    def _fail(self, p: Pending, code: int, message: str, reason: str = "OTHER") -> None:
        p.stats.failed(time.monotonic_ns() - p.arrival_ns, reason)
        self._send_frontend(p.frontend, m.InferResult(
            p.req.req_id, error=m.ErrorRecord(int(code), message), stream=p.stream, order=p.order,
            trace=p.trace.head if p.trace is not None else []))
        self._answered(p)
