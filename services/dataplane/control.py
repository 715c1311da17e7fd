"""The data plane's control calls (owned by DataPlane, client.py): the repository (index,
load, unload), statistics, client shared memory, the log and trace settings and the
/metrics text, each a message to the scheduler answered by its ``ctl_id``. They go through
the owner's ``call`` (which fails them at once while the scheduler is unreachable, and
when the connection breaks), ids from the owner's ``new_id``."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.common import messages as m
from services.common.errors import TriremeError, bad_version_string_text, invalid_arg


def error_from(rec: m.ErrorRecord) -> TriremeError:
    """The TriremeError a scheduler's or worker's ErrorRecord stands for."""
    return TriremeError(rec.code, rec.message)


class ControlCalls:
    """DataPlaneAPI's repository, statistics, shared-memory, logging, trace-settings and
    metrics calls; the DataPlane binds them as its own."""

    def __init__(self, call: Callable[[Any], Awaitable[Any]],
                 new_id: Callable[[], int]) -> None:
        self._call = call       # send a message, await the scheduler's answer to its ctl_id
        self._new_id = new_id   # the next ctl_id (the owner's request ids)

    async def repository_index(self, ready_only: bool) -> list[dict]:
        idx: m.Index = await self._call(m.GetIndex(self._new_id(), ready_only))
        out = []
        for e in idx.entries:
            d = {"name": e.name}
            for k in ("version", "state", "reason"):
                if getattr(e, k):
                    d[k] = getattr(e, k)
            out.append(d)
        return out

    async def load_model(self, model: str, parameters: dict) -> None:
        cfg = parameters.get("config", "")
        if cfg and not isinstance(cfg, str):
            raise invalid_arg("'config' parameter must be a string")
        files = {k: bytes(v) for k, v in parameters.items() if k.startswith("file:")}
        if files and not cfg:
            raise invalid_arg("failed to load '" + model + "', failed to parse "
                              "'file:' parameters: model configuration must be provided when "
                              "model files are provided")
        done = await self._call(m.LoadModelRequest(self._new_id(), model, cfg or "", files))
        if done.error is not None:
            raise error_from(done.error)

    async def unload_model(self, model: str, parameters: dict) -> None:
        done = await self._call(m.UnloadModelRequest(
            self._new_id(), model, bool(parameters.get("unload_dependents", False))))
        if done.error is not None:
            raise error_from(done.error)

    # ------------------------------------------------------------------ client shared memory
    async def shm_status(self, kind: str, name: str = "") -> list[dict]:
        reply: m.ShmRegions = await self._call(m.ShmStatus(self._new_id(), kind, name))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.regions

    async def shm_register(self, kind: str, name: str, key: str = "", offset: int = 0,
                           byte_size: int = 0, device_id: int = 0,
                           raw_handle: bytes = b"") -> None:
        done = await self._call(m.ShmRegister(self._new_id(), kind, name, key, offset,
                                              byte_size, device_id, raw_handle))
        if done.error is not None:
            raise error_from(done.error)

    async def shm_unregister(self, kind: str, name: str = "") -> None:
        done = await self._call(m.ShmUnregister(self._new_id(), kind, name))
        if done.error is not None:
            raise error_from(done.error)

    # ------------------------------------------------------------------ logging extension
    async def log_settings(self, *, log_info: bool | None = None,
                           log_warning: bool | None = None, log_error: bool | None = None,
                           log_verbose_level: int | None = None,
                           log_format: str | None = None) -> m.LogConfig:
        """The scheduler's log settings, after changing those given (checked already)."""
        changes = (log_info, log_warning, log_error, log_verbose_level, log_format)
        msg: m.GetLogSettings | m.SetLogSettings = (
            m.GetLogSettings(self._new_id()) if all(v is None for v in changes) else
            m.SetLogSettings(self._new_id(), *changes))
        reply: m.LogSettings = await self._call(msg)
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.settings

    async def statistics(self, model: str = "", version: str = "") -> list[m.ModelStat]:
        """Statistics extension: every ready version ("" model), a model, or one version."""
        try:
            v = int(version) if version else -1
        except ValueError:
            raise invalid_arg(bad_version_string_text(version, "stoll")) from None
        reply: m.Stats = await self._call(m.GetStats(self._new_id(), model, max(v, -1)))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.stats

    async def metrics_text(self) -> str:
        """The scheduler's /metrics text ("" with metrics off)."""
        reply: m.MetricsText = await self._call(m.GetMetrics(self._new_id()))
        return reply.text

    # ------------------------------------------------------------------ trace extension
    async def trace_settings(self, model: str = "", update: m.TraceUpdate | None = None,
                             error: m.ErrorRecord | None = None) -> list[tuple[str, list[str]]]:
        """The trace settings of ``model`` ("": the global ones) after ``update``;
        ``error``: the request's own problem, raised after the scheduler's model check."""
        reply: m.TraceSettings = await self._call(
            m.TraceSettingsRequest(self._new_id(), model, update, error))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.settings
