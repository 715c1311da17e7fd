"""The model repository as the scheduler holds it: which models exist, which versions are
loaded, and the load / unload state machine that spawns and stops instance workers.

    scan ─▶ config + auto-complete ─▶ first instance (completes IO from the file)
         ─▶ validate ─▶ remaining instances ─▶ READY            (any failure: UNAVAILABLE)

The ModelManager owns every model entry (entries.py's records), the loads in progress and
the execution watchdog, and three collaborators it calls, each given the entries and the
hooks it needs:

    Retirement (retirement.py)        stops instances: unload, replace, bounded shutdown;
                                      owns the entries being retired and the closing flag
    InstanceRecovery (recovery.py)    a worker's exit or watchdog kill: restarts, lost
                                      instances (the watchdog reports to it)
    ModelNames (namespaces.py)        which entry a name means (--model-namespacing)

Every model and version state transition happens here or in these collaborators: the
Scheduler (main.py) only routes its messages and process events to ModelManager's methods.
Stopping is bounded: an unload waits ``unload_timeout_s`` for the batches in flight, a
shutdown its grace (--exit-timeout-secs); an instance still executing then is killed and its
requests fail UNAVAILABLE with a text naming that timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from protos import model_config_pb2 as mc
from services.common import config as cfgmod
from services.common import messages as m
from services.common import repository as repo
from services.common.errors import Code, LoadFailed, TriremeError, invalid_arg, poll_failed, unknown_model
from services.scheduler.dispatch import Instance
from services.scheduler.ensemble_config import (
    ensemble_labels,
    is_decoupled,
    missing_models_text,
    validate_ensemble,
    validate_steps,
)
from services.scheduler.entries import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    ModelEntry,
    VersionState,
    is_unloaded,
    model_info,
)
from services.scheduler.memory import EVICTED_REASON, MemorySettings, ModelMemory
from services.scheduler.namespaces import ModelNames
from services.scheduler.queues import SchedulingQueue
from services.scheduler.recovery import InstanceRecovery
from services.scheduler.retirement import Retirement, drop_override
from services.scheduler.watchdog import Watchdog, execution_limit

log = logging.getLogger("trireme.models")

RESTART_BACKOFF_S = 0.5
UNLOAD_TIMEOUT_S = 30.0     # batches in flight get this long to finish when their model unloads
_worker_ids = itertools.count(1)
# Worker ids are unique across scheduler restarts too: a worker host may still report the
# exit of a worker of the scheduler that came before this one.
_RUN = os.urandom(3).hex()


class ModelManager:
    """Owns every ModelEntry; the Scheduler gives it the process and messaging hooks, which
    it hands on to its Retirement and InstanceRecovery."""

    def __init__(self, repositories: list[Path], *, spawn_instance: Callable, stop_instance: Callable,
                 withdraw: Callable = lambda inst: None, announce: Callable = lambda *a: None,
                 make_queue: Callable[[str, int, Any], SchedulingQueue],
                 changed: Callable[[list[str]], None],
                 config_name: str | None = None, disable_autocomplete: bool = False,
                 limiter: Any = None, restart_backoff_s: float = RESTART_BACKOFF_S,
                 execution_timeout_s: float = 0.0, unload_timeout_s: float = UNLOAD_TIMEOUT_S,
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns,
                 wait_for_host: Callable | None = None, namespacing: bool = False,
                 memory: MemorySettings | None = None) -> None:
        self.repositories = repositories
        # --model-namespacing: models are keyed "<repository>::<name>" (namespaces.py)
        self.namespacing = namespacing
        self.models: dict[str, ModelEntry] = {}
        self.names = ModelNames(self.models, repositories, namespacing)
        # Name resolution is the ModelNames' own methods (lookup() is on every request's path)
        self.split_key = self.names.split_key
        self.resolve = self.names.resolve
        self.lookup = self.names.lookup
        self.step_entry = self.names.step_entry
        # async (Instance, config bytes, model_dir, autocomplete) -> mc.ModelConfig
        self.spawn_instance = spawn_instance
        self.make_queue = make_queue              # (model key, version, completed config) -> queue
        # (keys in, names out: frontends know models by name)
        self.changed = changed if not namespacing else (
            lambda keys: changed(list(dict.fromkeys(self.split_key(k)[0] for k in keys))))
        self.config_name = config_name
        self.disable_autocomplete = disable_autocomplete
        self.limiter = limiter                    # RateLimiter with --rate-limit execution_count
        self.execution_timeout_s = execution_timeout_s   # --model-execution-timeout-secs (0: off)
        self._locks: dict[str, asyncio.Lock] = {}
        self._starting: list[ModelEntry] = []    # loads in progress: not in self.models yet
        self._ensembles_loading: set[str] = set()      # (an ensemble must not contain itself)
        self._explicit: set[str] = set()   # keys loaded by name, not only as an ensemble's step
        # The watchdog reports to the recovery, made after it: the recovery asks the
        # retirement, which unwatches with the watchdog. (call_later and clock: the queues'
        # own, so the sweep compares like with like)
        self.watchdog = Watchdog(
            lambda queue, inst, limit_s: self.recovery.execution_timed_out(queue, inst, limit_s),
            call_later, clock)
        self.retirement = Retirement(self.models, self._starting, self.watchdog,
                                     stop_instance=stop_instance, withdraw=withdraw,
                                     announce=announce, unload_timeout_s=unload_timeout_s)
        # --model-memory-budget, --model-load-on-demand: loads within a budget (memory.py)
        self.memory = ModelMemory(memory or MemorySettings(), self.models,
                                  evict=lambda key: self._unload(key, EVICTED_REASON))
        self.recovery = InstanceRecovery(self.models, self.retirement,
                                         spawn_instance=spawn_instance, changed=self.changed,
                                         restart_backoff_s=restart_backoff_s,
                                         wait_for_host=wait_for_host)

    # ---------------------------------------------------------------- repository
    def scan(self) -> dict[str, repo.ModelSource]:
        """The repositories' models by key; each gets an entry (not loaded yet)."""
        sources, duplicates = repo.scan(self.repositories, self.namespacing)
        for name, why in duplicates.items():
            e = self.models.setdefault(name, ModelEntry(name))
            if e.reason != why:
                log.error(repo.DUPLICATE_POLL_ERROR.format(name=name))
            e.state, e.reason = UNAVAILABLE, why
        for key, src in sources.items():
            e = self.models.setdefault(key, ModelEntry(src.name, src.path, namespace=src.namespace))
            if e.override_dir is None:   # a model loaded from "file:" parameters stays there
                e.path = src.path
        self.names.reindex()   # (entries are only added here: its index stays complete)
        return sources

    def index(self, ready_only: bool) -> list[m.IndexEntry]:
        self.scan()
        out: list[m.IndexEntry] = []
        for e in sorted(self.models.values(), key=lambda e: (e.namespace, e.name)):   # (Triton's order)
            name = e.name
            if not e.versions:
                if not ready_only:
                    out.append(m.IndexEntry(name, state=e.state or "", reason=e.reason))
                continue
            for v in sorted(e.versions):
                s = e.versions[v]
                if ready_only and s.state != READY:
                    continue
                out.append(m.IndexEntry(name, str(v), s.state, s.reason))
        return out

    def info(self, name: str) -> m.ModelInfo:
        try:
            e = self.resolve(name)
        except TriremeError as ambiguous:
            return m.ModelInfo(0, name, error=m.ErrorRecord(int(ambiguous.code), ambiguous.message))
        # never loaded, or in two repositories without namespacing: unknown, as in Triton
        if e is None or not e.versions and (e.state is None or e.reason == repo.DUPLICATE_REASON):
            err = unknown_model(name)
            # (with namespacing Triton's lookup answers INVALID_ARG, in the same words)
            code = Code.INVALID_ARG if self.namespacing else err.code
            return m.ModelInfo(0, name, error=m.ErrorRecord(int(code), err.message))
        if e.info is None:
            e.info = model_info(e)
        return e.info

    # ---------------------------------------------------------------- load / unload
    async def load(self, name: str, override: Any = None, files: dict[str, bytes] | None = None) -> None:
        """Load (or reload) a model by key or by name: with namespacing a name loads the
        models of that name in every repository, as Triton's load does."""
        keys = [name]
        if self.namespacing and name not in self.models:
            keys = sorted(k for k, s in self.scan().items() if s.name == name) or keys
        self._explicit.update(keys)
        first: TriremeError | None = None
        for key in keys:
            async with self._locks.setdefault(key, asyncio.Lock()):
                if self.retirement.closing:
                    raise TriremeError(Code.UNAVAILABLE, f"failed to load '{name}': server is shutting down")
                try:
                    await self._load(key, override, files or {})
                except TriremeError as e:
                    first = first or e
        if first is not None:
            raise first

    async def _load(self, key: str, override: Any, files: dict[str, bytes]) -> None:
        name = self.split_key(key)[0]
        src = self.scan().get(key)
        old = self.models.get(key)
        if old is None or src is None:
            raise poll_failed(name)
        # (old.path is the override dir when the model was last loaded from "file:" parameters)
        model_dir = src.path                # new.path, as a Path that is never None
        new = ModelEntry(name, model_dir, fingerprint=repo.fingerprint(src.path),
                         namespace=src.namespace)
        old.fingerprint = new.fingerprint   # a failed load is retried only when files change
        try:
            if files:   # Triton's override model directory: these files, not the repository's
                model_dir = new.path = new.override_dir = _write_override(name, files)
            cfg = override if override is not None else cfgmod.load_config(src.path, self.config_name)
            if not self.disable_autocomplete:
                cfg = cfgmod.autocomplete(cfg, model_dir, name)
            elif not cfg.name:
                cfg.name = name
            cfgmod.validate(cfg, require_io=False)
        except TriremeError as e:
            drop_override(new)
            self._set_failed(old, e.message)
            raise
        try:   # (Triton: the load fails on this, not the repository's poll)
            versions = repo.select_versions(cfg, repo.available_versions(model_dir))
        except TriremeError as e:
            drop_override(new)
            self._set_failed(old, e.message)
            raise LoadFailed(e.code, e.message) from None
        for v in versions:
            new.versions[v] = VersionState(v)
            log.info("loading: %s:%d", name, v)
        if not old.versions:   # (a reload keeps the old versions serving until the new ones are up)
            old.versions = {v: VersionState(v) for v in versions}
            old.info = None
            self.changed([key])
        # Until it is READY the new entry is only here: shutdown() must see its workers too.
        self._starting.append(new)
        try:
            new.labels = repo.read_labels(model_dir, cfg)   # (Triton: per version, before instances)
            if cfg.HasField("ensemble_scheduling"):
                cfg = await self._start_ensemble(new, cfg, versions)
            else:
                count = len(versions) * max(1, sum(g.count for g in cfg.instance_group))
                cfg = await self.memory.load(key, name, count, functools.partial(
                    self._start_instances, new, cfg, versions))
        except TriremeError as e:
            await self.retirement.stop_all(new)
            drop_override(new)
            self._set_failed(old, e.message)   # (an ensemble fails as a model, as in Triton)
            raise LoadFailed(e.code, e.message, () if cfg.HasField("ensemble_scheduling")
                             else versions) from None
        except Exception as e:   # a bug of ours: the model still ends UNAVAILABLE, never LOADING
            log.exception("load of '%s' failed", name)
            await self.retirement.stop_all(new)
            drop_override(new)
            err = TriremeError(Code.INTERNAL, f"internal error: {type(e).__name__}: {e}")
            self._set_failed(old, err.message)
            raise err from e
        except BaseException:   # cancelled (shutdown): no worker of this load may outlive it
            await self.retirement.stop_all(new)
            drop_override(new)
            raise
        finally:
            self._starting.remove(new)
        new.config = cfg
        for _v, vs in new.versions.items():
            vs.state = READY
        previous = self.models.get(key)
        self.models[key] = new
        self.changed([key])
        log.info("successfully loaded '%s'", name)
        if previous is not None and previous is not new:
            await self.retirement.retire(previous, "unloaded")
        if self.memory.budget and new.instances:
            await self.memory.settle(key)

    def loadable(self, name: str) -> str | None:
        """The key an inference request for ``name`` loads on demand
        (--model-load-on-demand), or waits for while it loads: a model the repository holds
        that has no READY version; None otherwise."""
        if not self.memory.settings.on_demand or self.retirement.closing:
            return None
        e = self.lookup(name)
        # (never loaded, unloaded, evicted or loading now; not one whose load failed: no
        # retry per request)
        if e is not None and not (e.versions and all(
                v.state == LOADING or v.state == UNAVAILABLE and is_unloaded(v.reason)
                for v in e.versions.values()) or not e.versions and e.state is None):
            return None
        key = e.key if e is not None else name
        return key if key in self.scan() else None

    async def demand(self, key: str) -> None:
        """Load ``key`` for the requests that name it (ModelMemory.demand bounds the wait)."""
        async def load() -> None:
            self._explicit.add(key)
            await self._ensure_loaded(key)
        await self.memory.demand(key, self.split_key(key)[0], load)

    def _set_failed(self, entry: ModelEntry, reason: str) -> None:
        log.error("failed to load '%s': %s", entry.name, reason)
        if entry.versions and any(v.state == READY for v in entry.versions.values()):
            return   # a failed reload keeps the old model serving
        entry.state, entry.reason = UNAVAILABLE, reason
        entry.versions = {v: VersionState(v, UNAVAILABLE, reason) for v in entry.versions} \
            if entry.versions else {}
        entry.info = None
        self.changed([entry.key])

    async def _start_ensemble(self, entry: ModelEntry, cfg: Any, versions: list[int]) -> Any:
        """An ensemble has no instances: its composing models are loaded (those not loaded
        yet, as Triton does in explicit mode too), checked against its steps, and each of its
        versions gets an EnsembleQueue that runs the steps on their queues."""
        validate_ensemble(cfg)
        names = list(dict.fromkeys(step.model_name for step in cfg.ensemble_scheduling.step))
        available = self.scan()
        keys = {n: self.names.step_source(entry, n, available) for n in names}
        missing = [n for n in names if not keys[n]]   # (step order: Triton names the first)
        if missing:
            raise invalid_arg(missing_models_text(entry.key, missing))
        if entry.key in self._ensembles_loading:
            raise invalid_arg(f"circular dependency: ensemble '{entry.name}' contains itself")
        self._ensembles_loading.add(entry.key)
        try:
            for n in names:
                await self._ensure_loaded(keys[n])
            # Triton polls a step's name in every repository: the other repositories' models
            # of that name load too (their failures are theirs, not the ensemble's)
            for k in [k for k, s in available.items() if s.name in keys and k not in keys.values()]:
                with contextlib.suppress(TriremeError):
                    await self._ensure_loaded(k)
        finally:
            self._ensembles_loading.discard(entry.key)
        composing = {n: self.models[keys[n]].config for n in names}
        validate_steps(cfg, composing)
        entry.labels = ensemble_labels(cfg, entry.labels, {n: self.models[keys[n]].labels for n in names})
        # Triton: an ensemble with a decoupled step streams (its clients use a stream).
        cfg.model_transaction_policy.decoupled = is_decoupled(cfg, composing)
        if cfg.model_transaction_policy.decoupled and cfg.response_cache.enable:
            # (Triton checks it again once a decoupled step made the ensemble decoupled)
            raise invalid_arg(f"Response Cache does not currently support model {cfg.name} "
                              "with 'decoupled' transaction policy. Please disable the "
                              "response cache.")
        entry.composing = list(keys.values())
        if self.namespacing:   # (Triton's config shows where each step was found)
            for step in cfg.ensemble_scheduling.step:
                step.model_namespace = self.split_key(keys[step.model_name])[1]
        if cfg.ensemble_scheduling.max_inflight_requests > 0:   # (Triton's words: its QA greps them)
            log.info("Ensemble model '%s' configured with max_inflight_requests: %d", entry.name,
                     cfg.ensemble_scheduling.max_inflight_requests)
        for v in versions:
            entry.versions[v].queue = self.make_queue(entry.key, v, cfg)
        return cfg

    async def _ensure_loaded(self, key: str) -> None:
        """Load ``key`` unless it is loaded (a load in progress is waited for)."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            e = self.models.get(key)
            if e is None or e.config is None or not any(
                    v.state == READY for v in e.versions.values()):
                await self._load(key, None, {})

    async def _start_instances(self, entry: ModelEntry, cfg: Any, versions: list[int]) -> Any:
        plan: list[tuple[int, Any, int]] = []  # (version, group, index)
        for v in sorted(versions, reverse=True):
            for group in cfg.instance_group:
                for i in range(group.count):
                    plan.append((v, group, i))

        def make(v: int, group: Any, i: int) -> Instance:
            inst = Instance(f"w{_RUN}.{next(_worker_ids)}", f"{group.name}_{i}", entry.key, v,
                            *_placement(group, i), config=group)
            entry.instances.append(inst)
            return inst

        if self.limiter is not None:   # fail before starting workers the limiter would refuse
            self.limiter.check(entry.name, [(v, g, *_placement(g, i)) for v, g, i in plan])
        # The first instance completes the config from the model file (IO, max_batch_size).
        v0, g0, i0 = plan[0]
        first = make(v0, g0, i0)
        completed = await self.spawn_instance(first, cfg.SerializeToString(), str(entry.path),
                                              not self.disable_autocomplete)
        cfgmod.normalize(completed)
        cfgmod.validate(completed)
        limit_s = execution_limit(completed, self.execution_timeout_s)
        blob = completed.SerializeToString()
        if self.retirement.closing:   # shutdown began while the first instance loaded: start no more
            raise TriremeError(Code.UNAVAILABLE, f"failed to load '{entry.name}': server is shutting down")
        rest = [make(v, g, i) for v, g, i in plan[1:]]
        results = await asyncio.gather(
            *(self.spawn_instance(inst, blob, str(entry.path), False) for inst in rest),
            return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r if isinstance(r, TriremeError) else TriremeError(Code.INTERNAL, str(r))
        if self.limiter is not None:
            # Again, with no await before the registration (add_instance) below: another
            # model's instances may have registered while these workers started.
            self.limiter.check(entry.name, [(i.version, i.config, i.kind, i.device_id)
                                            for i in entry.instances])
        for v in versions:
            entry.versions[v].queue = self.make_queue(entry.key, v, completed)
        for inst in entry.instances:
            queue = entry.versions[inst.version].queue
            assert queue is not None        # set just above for every version
            queue.add_instance(inst)
        for vs in entry.versions.values():
            if vs.queue is not None:
                self.watchdog.watch(vs.queue, limit_s)
        return completed

    async def unload(self, name: str, dependents: bool = False) -> None:
        """Unload a model by key or by name (with namespacing: every model of that name).
        ``dependents`` (Triton's unload_dependents): an ensemble's composing models go too,
        each one no other loaded ensemble uses and nobody loaded by name, down its own
        steps in turn."""
        keys = [name]
        if self.namespacing and name not in self.models:
            keys = self.names.keys_of(name)
        while keys:
            key = keys.pop(0)
            self._explicit.discard(key)
            e = self.models.get(key)
            composing = list(e.composing) if e is not None and e.versions else []
            await self._unload(key)
            if dependents:
                keys += [k for k in composing if k not in keys and self._unused(k)]

    def _unused(self, key: str) -> bool:
        """Whether ``key`` was loaded only for ensembles, none of which is loaded now."""
        return key not in self._explicit and not any(
            key in e.composing for e in self.models.values() if e.versions and e.config is not None
            and any(v.state != UNAVAILABLE for v in e.versions.values()))

    async def _unload(self, key: str, reason: str = "unloaded") -> None:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            e = self.models.get(key)
            if e is None or not e.versions:
                return
            for vs in e.versions.values():
                vs.state = UNLOADING
            e.info = None
            self.changed([key])
            await self.retirement.retire(e, reason)
            for v in sorted(e.versions):
                log.info("successfully unloaded '%s' version %d", e.name, v)
            path = e.path if e.override_dir is None else None   # scan() finds the repository's
            self.models[key] = ModelEntry(e.name, path, namespace=e.namespace, versions={
                v: VersionState(v, UNAVAILABLE, reason) for v in e.versions})
            self.changed([key])

    async def poll(self) -> None:
        """One poll-mode pass: load new or changed models, unload removed ones.

        A failed reload keeps the old version serving (see _set_failed)."""
        sources = self.scan()
        for key, src in sorted(sources.items()):
            e = self.models.get(key)
            loaded = e is not None and (e.versions or e.state == UNAVAILABLE)
            if e is not None and loaded and e.fingerprint == repo.fingerprint(src.path):
                continue
            try:
                await self.load(key)
            except TriremeError as err:
                log.error("poll: '%s' failed to load: %s", key, err.message)
        for key in [k for k, e in self.models.items() if k not in sources and e.versions]:
            await self.unload(key)
            self.models.pop(key, None)
            self.changed([key])

    # ---------------------------------------------------------------- workers
    async def instance_exited(self, inst: Instance, code: int) -> None:
        """A loaded instance's worker exited on its own (InstanceRecovery.instance_exited)."""
        await self.recovery.instance_exited(inst, code)

    async def shutdown(self, grace_s: float = 0.0, drained: asyncio.Future | None = None) -> None:
        """Stop every worker, bounded (Retirement.shutdown)."""
        await self.retirement.shutdown(grace_s, drained)

    def find_instance(self, worker_id: str) -> tuple[ModelEntry, Instance] | None:
        for e in self.models.values():
            for inst in e.instances:
                if inst.worker_id == worker_id:
                    return e, inst
        return None

def _placement(group: Any, i: int) -> tuple[str, int]:
    """(kind, device) of the i-th instance of an instance group."""
    kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
    return kind, (group.gpus[i % len(group.gpus)] if group.gpus else 0)


def _write_override(name: str, files: dict[str, bytes]) -> Path:
    """The "file:<version>/<name>" load parameters as a model directory of their own
    (a temp dir, removed when the model is unloaded or fails to load)."""
    root = Path(tempfile.mkdtemp(prefix=f"trireme-{os.getpid()}-model-"))
    model_dir = root / name
    try:
        for key, data in files.items():
            rel = PurePosixPath(key.removeprefix("file:"))
            if rel.is_absolute() or not rel.parts or ".." in rel.parts:
                raise invalid_arg(f"failed to load '{name}': invalid file parameter '{key}'")
            dest = model_dir.joinpath(*rel.parts)
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
            except OSError as e:   # e.g. a name longer than NAME_MAX
                log.warning("load of '%s': cannot write '%s': %s", name, key, e.strerror)
                raise poll_failed(name) from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return model_dir
