"""The Scheduler's control half (a mixin, as worker_side.py is its worker half): the
statistics extension, readiness probes of models that check themselves, explicit load and
unload, the log settings every process follows, the figures /metrics shows."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common import logsettings
from services.common import messages as m
from services.common.errors import Code, LoadFailed, TriremeError, explicit_load_failed, poll_failed
from services.common.states import ModelState
from services.scheduler.metrics import cluster_families

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


class ControlSide:
    settings: Any                  # SchedulerSettings
    models: ModelManager
    hosts: Hosts
    stats: StatsRegistry
    loaded_models: LoadedModels
    frontends: set[bytes]
    fsock: Any
    wsock: Any
    _requests_from: dict[bytes, list]
    _workers: dict[str, Any]
    _spawning: dict[str, Any]
    _probes: dict[int, asyncio.Future]
    _probe_ids: Any

    if TYPE_CHECKING:
        def _send_frontend(self, identity: bytes, msg: Any, frames: Sequence[Any] = ()) -> None: ...

        def _send_worker(self, worker_id: str, msg: Any, frames: Sequence[Any] = ()) -> bool: ...

    def _log_settings_changed(self) -> None:
        """Triton's logging extension: every frontend, worker and worker host follows the
        scheduler's settings (services/common/logsettings.py), from the next message on."""
        parts = m.encode(logsettings.changed())
        for identity in list(self.frontends):
            self.fsock.send(identity, parts)
        for worker_id in {*self._workers, *self._spawning}:   # (one not connected yet gets
            self.wsock.send(worker_id.encode(), parts)        # them with its WorkerReady)
        for host in self.hosts.remote.values():
            self.wsock.send(host.identity, parts)

    def _cluster_metrics(self) -> list[str]:
        return cluster_families({addr: n for addr, n in self._requests_from.values()},
                                {h.name: h.instances for h in self.hosts.all()})

    def _ready_versions(self) -> list[tuple[str, int]]:
        """(model, version) of every READY version, sorted: what statistics and metrics show."""
        return [(n, v) for n, e in sorted(self.models.models.items())
                for v, s in sorted(e.versions.items()) if s.state == ModelState.READY]

    def _statistics(self, msg: m.GetStats) -> m.Stats:
        """The statistics extension: every ready version, one model, or one version."""
        versions = self._ready_versions()
        if msg.model:
            entry = self.models.lookup(msg.model)   # (an ambiguous name: "not available")
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
        return m.Stats(msg.ctl_id, [self.stats.get(k, v).to_message(self.models.split_key(k)[0], v)
                                    for k, v in versions])

    async def _check_ready(self, identity: bytes, msg: m.CheckReady) -> None:
        """Ready when every instance of the version says so within PROBE_TIMEOUT_S (a
        worker answers between batches; a model that hangs is not ready)."""
        entry = self.models.lookup(msg.model)
        vs = entry.ready_version(msg.version) if entry is not None else None
        err = None
        if entry is None or vs is None:
            err = m.ErrorRecord(int(Code.UNAVAILABLE), f"'{msg.model}' is not ready")
        else:
            loop = asyncio.get_running_loop()
            probes = {}
            for inst in entry.instances:
                if inst.version == vs.version and inst.probe and inst.loaded:
                    probe_id = next(self._probe_ids)
                    probes[probe_id] = self._probes[probe_id] = loop.create_future()
                    self._send_worker(inst.worker_id, m.ProbeReady(probe_id))
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
                    self._probes.pop(probe_id, None)
        self._send_frontend(identity, m.ControlDone(msg.ctl_id, err))

    async def _control(self, identity: bytes, msg: Any) -> None:
        err = None
        try:
            if self.settings.control_mode != "explicit":
                raise TriremeError(Code.UNAVAILABLE, "explicit model load / unload is not allowed "
                                                     "if polling is enabled")
            if isinstance(msg, m.LoadModelRequest):
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
                    await self.models.load(msg.model, override, msg.files)
                except LoadFailed as e:   # Triton's words around the reason the index shows
                    raise explicit_load_failed(msg.model, e) from None
                self.loaded_models.loaded(msg.model, msg.config_json, msg.files)
            else:
                await self.models.unload(msg.model)
                self.loaded_models.unloaded(msg.model)
        except TriremeError as e:
            err = m.ErrorRecord(int(e.code), e.message)
        except Exception as e:
            log.exception("control request failed")
            err = m.ErrorRecord(int(Code.INTERNAL), str(e))
        self._send_frontend(identity, m.ControlDone(msg.ctl_id, err))
