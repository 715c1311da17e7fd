"""The data plane's control-plane calls: the repository, statistics and client shared
memory, each a message to the scheduler answered by ctl_id (DataPlane's half, a mixin: it
holds ``_call`` and ``_ids``)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from services.common import messages as m
from services.common.errors import TriremeError, bad_version_string_text, invalid_arg


def error_from(rec: m.ErrorRecord) -> TriremeError:
    """The TriremeError a scheduler's or worker's ErrorRecord stands for."""
    return TriremeError(rec.code, rec.message)


class ControlCalls:
    _ids: Iterator[int]

    async def _call(self, msg: Any) -> Any:
        raise NotImplementedError

    async def repository_index(self, ready_only: bool) -> list[dict]:
        idx: m.Index = await self._call(m.GetIndex(next(self._ids), ready_only))
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
        done = await self._call(m.LoadModelRequest(next(self._ids), model, cfg or "", files))
        if done.error is not None:
            raise error_from(done.error)

    async def unload_model(self, model: str, parameters: dict) -> None:
        done = await self._call(m.UnloadModelRequest(
            next(self._ids), model, bool(parameters.get("unload_dependents", False))))
        if done.error is not None:
            raise error_from(done.error)

    # ------------------------------------------------------------------ client shared memory
    async def shm_status(self, kind: str, name: str = "") -> list[dict]:
        reply: m.ShmRegions = await self._call(m.ShmStatus(next(self._ids), kind, name))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.regions

    async def shm_register(self, kind: str, name: str, key: str = "", offset: int = 0,
                           byte_size: int = 0, device_id: int = 0,
                           raw_handle: bytes = b"") -> None:
        done = await self._call(m.ShmRegister(next(self._ids), kind, name, key, offset,
                                              byte_size, device_id, raw_handle))
        if done.error is not None:
            raise error_from(done.error)

    async def shm_unregister(self, kind: str, name: str = "") -> None:
        done = await self._call(m.ShmUnregister(next(self._ids), kind, name))
        if done.error is not None:
            raise error_from(done.error)

    async def statistics(self, model: str = "", version: str = "") -> list[m.ModelStat]:
        """Statistics extension: every ready version ("" model), a model, or one version."""
        try:
            v = int(version) if version else -1
        except ValueError:
            raise invalid_arg(bad_version_string_text(version, "stoll")) from None
        reply: m.Stats = await self._call(m.GetStats(next(self._ids), model, max(v, -1)))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.stats

    # ------------------------------------------------------------------ inference
