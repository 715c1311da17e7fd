"""What a data plane knows of each model (owned by DataPlane, client.py): the ModelInfo the
scheduler answered, cached until the scheduler broadcasts a change to that model, so that
validating a request or answering metadata costs no round trip; and the metadata and
config answers made from it.

One fetch per model at a time, a task of its own that callers share: one caller going away
(cancelled) neither stops it for the others nor hands them its CancelledError, whose
traceback would keep that caller's request (its body) alive. A fetch a change raced with
answers its callers but is not cached.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from services.common import messages as m
from services.common.canary import choose
from services.common.states import ModelState
from services.dataplane.control import error_from
from services.dataplane.validation import resolve_version


class ModelCache:
    def __init__(self, fetch: Callable[[str, bool], Awaitable[m.ModelInfo]]) -> None:
        self._fetch_one = fetch                  # GetModelInfo(model, load), answered by the scheduler
        self.infos: dict[str, m.ModelInfo] = {}
        self._configs: dict[str, dict] = {}      # config_json, parsed once
        self._fetches: dict[str, asyncio.Task] = {}
        self._demands: dict[str, asyncio.Future] = {}   # on-demand loads asked for, by model
        self._generation = 0

    def get(self, model: str) -> m.ModelInfo | None:
        """The cached ModelInfo; None: not fetched (or changed since)."""
        return self.infos.get(model)

    async def info(self, model: str) -> m.ModelInfo:
        info = self.infos.get(model)
        if info is not None:
            return info
        fetch = self._fetches.get(model)
        if fetch is None:
            fetch = self._fetches[model] = asyncio.get_running_loop().create_task(
                self._fetch(model))
        try:
            return await asyncio.shield(fetch)
        finally:
            del fetch   # (a cycle through its error, as in DataPlane.infer)

    def want(self, model: str) -> None:
        """Fetch ``model``'s ModelInfo into the cache, awaited by nobody."""
        if model not in self._fetches:
            asyncio.get_running_loop().create_task(self.info(model)).add_done_callback(
                _retrieved)

    async def _fetch(self, model: str) -> m.ModelInfo:
        gen = self._generation
        try:
            info = await self._fetch_one(model, False)
        finally:
            del self._fetches[model]
        if gen == self._generation:   # no change raced with the fetch
            self.infos[model] = info
        return info

    def changed(self, models: list[str]) -> None:
        """The scheduler's word that these models changed ([]: any may have)."""
        self._generation += 1
        if models:
            for name in models:
                self.infos.pop(name, None)
                self._configs.pop(name, None)
        else:
            self.infos.clear()
            self._configs.clear()

    async def ready_info(self, model: str, version: str, load: bool = False
                         ) -> tuple[m.ModelInfo, int]:
        """``model``'s info and the version ``version`` names; raises the scheduler's error
        (unknown model, no such version ready). ``load``: a model the scheduler would load
        on demand is loaded first (one load asked for per model, whoever waits for it)."""
        info = await self.info(model)
        if info.loadable and load:   # (the scheduler says so only while none is READY)
            demand = self._demands.get(model)
            if demand is None:
                demand = self._demands[model] = asyncio.ensure_future(self._fetch_one(model, True))
                demand.add_done_callback(lambda _t: self._demands.pop(model, None))
                demand.add_done_callback(_retrieved)
            info = await asyncio.shield(demand)
        if info.error is not None:
            raise error_from(info.error)
        return info, resolve_version(info, version)

    async def serving(self, model: str, version: str, parameters: dict[str, Any]
                      ) -> tuple[m.ModelInfo, int]:
        """The info and the version a request runs on: the version it names; naming none,
        one of the model's canary split (canary.py) or else the default. A model loaded on
        demand (--model-load-on-demand) is loaded first."""
        info, v = await self.ready_info(model, version, load=True)
        if not version and info.split:
            key = parameters.get(info.sticky) if info.sticky else None
            chosen = choose(info.split, [n for n, s in info.versions.items()
                                         if s == ModelState.READY],
                            None if key is None else str(key))
            if chosen is not None:
                v = chosen
        return info, v

    async def metadata(self, model: str, version: str) -> dict:
        info, _ = await self.ready_info(model, version)
        return {
            "name": info.name,
            "versions": [str(v) for v, s in sorted(info.versions.items()) if s == ModelState.READY],
            "platform": info.platform,
            "inputs": [{"name": i.name, "datatype": i.datatype, "shape": i.shape} for i in info.inputs],
            "outputs": [{"name": o.name, "datatype": o.datatype, "shape": o.shape} for o in info.outputs],
        }

    async def config(self, model: str, version: str) -> dict:
        info, _ = await self.ready_info(model, version)
        cfg = self._configs.get(model)
        if cfg is None:
            cfg = self._configs[model] = json.loads(info.config_json)
        return cfg


def _retrieved(task: asyncio.Task) -> None:
    """(a fetch nobody awaited: its error, if any, is the next caller's to see)"""
    if not task.cancelled():
        task.exception()
