"""The scheduler's control plane: the statistics extension, readiness probes of models that
check themselves, explicit load and unload, the log settings every process follows, the
figures /metrics shows.

``ControlPlane`` is an object the Scheduler (main.py) owns and calls from its frontend
socket's handler table (and Metrics from /metrics); it is given the model manager, the
statistics, and the sending and probing hooks it uses, and keeps no state of its own:

    GetStats ─▶ statistics          CheckReady ─▶ check_ready ─▶ Workers.probe (worker_side.py)
    LoadModelRequest ─▶ load, UnloadModelRequest ─▶ unload ─▶ ModelManager.load / unload,
                                                              --model-state-file
    SetLogSettings ─▶ log_settings_changed ─▶ every frontend, worker and worker host
    /metrics ─▶ ready_versions, cluster_metrics
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from services.common import logsettings
from services.common import messages as m
from services.common.errors import Code, LoadFailed, TriremeError, explicit_load_failed, poll_failed
from services.common.states import ModelState
from services.scheduler.metrics import cluster_families, memory_families

if TYPE_CHECKING:
    from services.scheduler.hosts import Hosts
    from services.scheduler.lifecycle import ModelManager
    from services.scheduler.state import LoadedModels
    from services.scheduler.stats import StatsRegistry

log = logging.getLogger("trireme.scheduler")

PROBE_TIMEOUT_S = 10.0


def _check_model_name(name: str) -> None:
    """Triton's ValidateModelName (core model_repository_manager.cc), on load only."""
    trimmed = name.strip()
    if not trimmed:
        raise TriremeError(Code.INVALID_ARG, "Model name cannot be empty. Please enter a "
                                             "valid name to deploy.")
    if trimmed == ".." or "/" in trimmed:
        raise TriremeError(Code.INVALID_ARG, f"invalid model name '{name}', model name must "
                                             f"not contain path traversal characters")


class ControlPlane:
    """Answers the control requests frontends send. ``models``, ``stats``, ``hosts`` and
    ``loaded_models`` are the Scheduler's; ``frontends`` and ``requests_from`` (identity ->
    [result address, requests]) its frontend side's, read here; ``send_frontend`` answers
    one frontend, ``frontend_send`` writes encoded parts to one (no answer: a broadcast);
    ``probe``, ``forget_probe`` and ``broadcast_workers`` are the worker side's."""

    def __init__(self, *, explicit: bool, models: ModelManager, stats: StatsRegistry,
                 hosts: Hosts, loaded_models: LoadedModels,
                 frontends: Callable[[], set[bytes]], requests_from: dict[bytes, list],
                 send_frontend: Callable[[bytes, Any], None],
                 frontend_send: Callable[[bytes, Sequence[Any]], bool],
                 probe: Callable[[str], tuple[int, asyncio.Future]],
                 forget_probe: Callable[[int], None],
                 broadcast_workers: Callable[[Sequence[Any]], None]) -> None:
        self._explicit = explicit                  # --model-control-mode explicit
        self._models = models
        self._stats = stats
        self._hosts = hosts
        self._loaded_models = loaded_models        # --model-state-file
        self._frontends = frontends
        self._requests_from = requests_from
        self._send_frontend = send_frontend
        self._frontend_send = frontend_send
        self._probe = probe                        # (worker id) -> (probe id, its ProbeResult)
        self._forget_probe = forget_probe
        self._broadcast_workers = broadcast_workers

    def log_settings_changed(self) -> None:
        """Triton's logging extension: every frontend, worker and worker host follows the
        scheduler's settings (services/common/logsettings.py), from the next message on."""
        parts = m.encode(logsettings.changed())
        for identity in list(self._frontends()):
            self._frontend_send(identity, parts)
        self._broadcast_workers(parts)

    def cluster_metrics(self) -> list[str]:
        memory = self._models.memory
        resident: dict[tuple[str, int], int] = {}
        for key, e in self._models.models.items():
            for i in e.instances:
                if i.loaded:
                    resident[(key, i.version)] = resident.get((key, i.version), 0) + i.resident_bytes
        return cluster_families({addr: n for addr, n in self._requests_from.values()},
                                {h.name: h.instances for h in self._hosts.all()}) + \
            memory_families(memory.loads, memory.evictions, resident)

    def ready_versions(self) -> list[tuple[str, int]]:
        """(model, version) of every READY version, sorted: what statistics and metrics show."""
        return [(n, v) for n, e in sorted(self._models.models.items())
                for v, s in sorted(e.versions.items()) if s.state == ModelState.READY]

    def statistics(self, msg: m.GetStats) -> m.Stats:
        """The statistics extension: every ready version, one model, or one version."""
        versions = self.ready_versions()
        if msg.model:
            entry = self._models.lookup(msg.model)   # (an ambiguous name: "not available")
            key = entry.key if entry is not None else ""
            ready = [v for n, v in versions if n == key]
            if not ready:
                return m.Stats(msg.ctl_id, error=m.ErrorRecord(
                    int(Code.INVALID_ARG), f"requested model '{msg.model}' is not available"))
            if msg.version >= 0 and msg.version not in ready:
                return m.Stats(msg.ctl_id, error=m.ErrorRecord(
                    int(Code.INVALID_ARG),
                    f"requested model version is not available for model '{msg.model}'"))
            versions = [(key, v) for v in ([msg.version] if msg.version >= 0 else ready)]
        return m.Stats(msg.ctl_id, [self._stats.get(k, v).to_message(self._models.split_key(k)[0], v)
                                    for k, v in versions])

    async def check_ready(self, identity: bytes, msg: m.CheckReady) -> None:
        """Ready when every instance of the version says so within PROBE_TIMEOUT_S (a
        worker answers between batches; a model that hangs is not ready)."""
        entry = self._models.lookup(msg.model)
        vs = entry.ready_version(msg.version) if entry is not None else None
        err = None
        if entry is None or vs is None:
            err = m.ErrorRecord(int(Code.UNAVAILABLE), f"'{msg.model}' is not ready")
        else:
            probes = {}
            for inst in entry.instances:
                if inst.version == vs.version and inst.probe and inst.loaded:
                    probe_id, answer = self._probe(inst.worker_id)
                    probes[probe_id] = answer
            try:
                results = await asyncio.wait_for(asyncio.gather(*probes.values()), PROBE_TIMEOUT_S)
                bad = [r for r in results if not r.ready]
                if bad:
                    err = m.ErrorRecord(int(Code.UNAVAILABLE), bad[0].reason or "not ready")
            except TimeoutError:
                err = m.ErrorRecord(int(Code.UNAVAILABLE), f"'{msg.model}' did not answer its "
                                                           f"readiness check in {PROBE_TIMEOUT_S:.0f} s")
            finally:
                for probe_id in probes:
                    self._forget_probe(probe_id)
        self._send_frontend(identity, m.ControlDone(msg.ctl_id, err))

    async def load(self, identity: bytes, msg: m.LoadModelRequest) -> None:
        """Explicit model control: load (or reload) a model, answered with ControlDone and
        remembered in --model-state-file."""
        async def load() -> None:
            _check_model_name(msg.model)
            override = None
            if msg.config_json:
                from services.common.config import config_from_json
                try:
                    override = config_from_json(msg.config_json)
                except TriremeError as e:   # Triton's words; why goes to the log
                    log.warning("load of '%s': %s", msg.model, e.message)
                    raise poll_failed(msg.model) from None
            try:
                await self._models.load(msg.model, override, msg.files)
            except LoadFailed as e:   # Triton's words around the reason the index shows
                raise explicit_load_failed(msg.model, e) from None
            self._loaded_models.loaded(msg.model, msg.config_json, msg.files)

        await self._control(identity, msg.ctl_id, load)

    async def unload(self, identity: bytes, msg: m.UnloadModelRequest) -> None:
        """Explicit model control: unload a model (and its dependents when asked),
        answered with ControlDone and remembered in --model-state-file."""
        async def unload() -> None:
            await self._models.unload(msg.model, msg.unload_dependents)
            self._loaded_models.unloaded(msg.model)

        await self._control(identity, msg.ctl_id, unload)

    async def _control(self, identity: bytes, ctl_id: int,
                       action: Callable[[], Awaitable[None]]) -> None:
        """Run an explicit load or unload (refused unless --model-control-mode explicit)
        and answer it: ControlDone, with the error if it failed."""
        err = None
        try:
            if not self._explicit:
                raise TriremeError(Code.UNAVAILABLE, "explicit model load / unload is not allowed "
                                                     "if polling is enabled")
            await action()
        except TriremeError as e:
            err = m.ErrorRecord(int(e.code), e.message)
        except Exception as e:
            log.exception("control request failed")
            err = m.ErrorRecord(int(Code.INTERNAL), str(e))
        self._send_frontend(identity, m.ControlDone(ctl_id, err))
