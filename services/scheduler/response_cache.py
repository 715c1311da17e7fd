"""The response cache, Triton's (../shared/reference/protocol.md "Response cache"): a model whose config says
`response_cache { enable: true }` on a server started with a cache (--cache-config
local,size=N, or the deprecated --response-cache-byte-size N) answers a request it has
answered before from the cache, without a worker. Owned by the Scheduler (main.py), so
every frontend of a server sees the same entries.

    frontend: the request's key (its model, version, every input's name, datatype, shape
        and bytes, the outputs asked for: common/cache_key.py) ─▶ InferRequest.cache_key
    scheduler: lookup before the request is queued (awaited for Redis:
        response_cache_redis.py) ─▶ hit: the answer, from here
        (InferResult.cached), counted as a success without an execution
                                                  ─▶ miss: queued as any request
    frontend: the miss's final answer ─▶ CacheInsert (its outputs, or ok=False on an
        error: only successes are kept) ─▶ inserted here; the miss is counted then, its
        time the lookup's plus the insertion's, as Triton counts it

An ensemble's steps are looked up in their own models' caches as Triton's composing
models are (their key made here: step_key), when every input of the step travels in the
message; a step's answer is inserted from here (step_answered), when every output does.

Triton's key leaves datatype, shape and the requested outputs out, and then answers a
request with another request's outputs (its issue #4362); this one does not
(docs/compat.md). The local cache is one byte budget for every model, least recently used
entries evicted first; an entry larger than the whole cache is not kept (Triton's text,
logged). Requests that read or write client shared memory are not looked up.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from services.common import messages as m
from services.common.cache_key import cache_key
from services.scheduler.response_cache_redis import RedisCache, namespace

log = logging.getLogger("trireme.cache")

_MISSES_KEPT = 65536   # misses waiting for their CacheInsert (a frontend that died sends none)
_ENTRY_OVERHEAD = 64   # bytes an entry costs beyond its outputs' (names, shapes, bookkeeping)


class CacheConfigError(Exception):
    """A cache flag Triton refuses: the text, and whether Triton prints its usage first."""

    def __init__(self, text: str, usage: bool = False) -> None:
        super().__init__(text)
        self.usage = usage


def parse_cache_flags(cache_config: list[str], byte_size: int | None
                      ) -> tuple[str, dict[str, str]] | None:
    """(cache name, its settings) from --cache-config (repeatable: one setting each) and the
    deprecated --response-cache-byte-size; None: no cache. Raises CacheConfigError with
    Triton's texts."""
    if byte_size is not None:
        log.warning("'--response-cache-byte-size' has been deprecated! This will default to "
                    "the 'local' cache implementation with the provided byte size for its "
                    "config. Please use '--cache-config' instead. The equivalent "
                    "--cache-config CLI args would be: '--cache-config=local,size=%d'", byte_size)
        if cache_config:
            raise CacheConfigError("Error: Incompatible flags --response-cache-byte-size and "
                                   "--cache-config both provided. Please provide one or the other.",
                                   usage=True)
        return "local", {"size": str(byte_size)}
    caches: dict[str, dict[str, str]] = {}
    for arg in cache_config:
        name, comma, setting = arg.partition(",")
        if not comma:
            raise CacheConfigError("No cache specified. --cache-config option format is "
                                   f"<cache name>,<setting>=<value>. Got {arg}", usage=True)
        key, eq, value = setting.partition("=")
        if not eq:
            raise CacheConfigError("--cache-config option format is "
                                   f"'<cache name>,<setting>=<value>'. Got {arg}", usage=True)
        caches.setdefault(name, {})[key] = value
    if len(caches) > 1:
        raise CacheConfigError("error: creating server: Invalid argument - found multiple cache "
                               "configurations, but only a single cache is currently supported")
    return next(iter(caches.items()), None)


def make_cache(config: tuple[str, dict[str, str]] | None,
               repositories: Sequence[Any] = ()) -> LocalCache | RedisCache | None:
    """The server's cache from parse_cache_flags' answer (a Redis cache is pinged: Triton
    does not start without it); raises CacheConfigError."""
    if config is None:
        return None
    name, settings = config
    if name == "redis":
        try:
            return RedisCache.connect(settings, namespace(repositories))
        except ValueError as e:
            raise CacheConfigError(f"error: creating server: Invalid argument - {e}") from None
        except RuntimeError as e:
            raise CacheConfigError(f"error: creating server: Internal - {e}") from None
    if name != "local":
        raise CacheConfigError(f"error: creating server: Invalid argument - unable to find the "
                               f"'{name}' cache: this server has 'local' and 'redis'")
    return LocalCache.from_settings(settings)


@dataclass
class Entry:
    outputs: list[m.TensorRef]      # name, datatype, shape, nbytes; frame i is output i's
    frames: list[bytes]
    nbytes: int


class LocalCache:
    """Triton's local cache: one budget of ``size`` bytes, LRU (a lookup or an insert makes
    an entry the most recent)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self.entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.lookups = self.hits = self.misses = self.evictions = 0
        self.lookup_ns = self.insertion_ns = 0
        self.evicted: list[bytes] = []   # keys evicted since the frontends were last told

    @classmethod
    def from_settings(cls, settings: dict[str, str]) -> LocalCache:
        if "size" not in settings:
            raise CacheConfigError("error: creating server: Invalid argument - Failed to "
                                   "initialize LocalCache: config didn't contain a valid 'size' "
                                   "field.")
        try:
            size = int(settings["size"])
            if size < 0:
                raise ValueError
        except ValueError:
            raise CacheConfigError("error: creating server: Internal - Failed to initialize "
                                   "LocalCache: stoull") from None
        return cls(size)

    def lookup(self, key: bytes) -> Entry | None:
        t0 = time.perf_counter_ns()
        self.lookups += 1
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self.entries.move_to_end(key)
        self.lookup_ns += time.perf_counter_ns() - t0
        return entry

    def touch(self, key: bytes) -> None:
        """A hit a frontend answered from its copy: counted as a lookup here, and the entry
        made the most recent, as if it had been looked up here."""
        self.lookups += 1
        self.hits += 1
        if key in self.entries:
            self.entries.move_to_end(key)

    def insert(self, key: bytes, entry: Entry) -> str | None:
        """Keep ``entry``, evicting the least recently used until it fits (their keys are
        added to ``evicted``); the error text when it cannot be kept."""
        t0 = time.perf_counter_ns()
        try:
            if key in self.entries:
                self.entries.move_to_end(key)
                return f"key '{key.hex()}' already exists"
            if entry.nbytes > self.size:
                return (f"Requested byte_size: {entry.nbytes} is greater than total cache "
                        f"size: {self.size}")
            while self.used + entry.nbytes > self.size:
                gone, old = self.entries.popitem(last=False)
                self.used -= old.nbytes
                self.evictions += 1
                self.evicted.append(gone)
            self.entries[key] = entry
            self.used += entry.nbytes
            return None
        finally:
            self.insertion_ns += time.perf_counter_ns() - t0

    def gauges(self) -> list[tuple[str, str, float]]:
        """(family, help, value) of Triton's cache gauges, in its order."""
        return [
            ("nv_cache_num_entries", "Number of responses stored in response cache",
             len(self.entries)),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", self.lookups),
            ("nv_cache_num_hits", "Number of cache hits in response cache", self.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", self.misses),
            ("nv_cache_num_evictions", "Number of cache evictions in response cache",
             self.evictions),
            ("nv_cache_lookup_duration",
             "Total cache lookup duration (hit and miss), in microseconds", self.lookup_ns // 1000),
            ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds",
             self.insertion_ns // 1000),
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]",
             self.used / self.size if self.size else 0.0),
        ]


class _Tensor(NamedTuple):
    name: str
    datatype: str
    shape: list[int]
    data: Any


def step_key(entry: Any, req: m.InferRequest, frames: list[Any]) -> bytes:
    """The key of an ensemble step's request to ``entry``'s model: b"" unless the version
    it runs on looks requests up and every input is in the message (a step's input in
    shared memory, or a region of the client's, is not hashed: not looked up)."""
    vs = entry.ready_version(req.version)
    if vs is None or vs.queue is None or vs.queue.stats is None or not vs.queue.stats.cached:
        return b""
    if req.out_regions or any(t.frame < 0 or t.region for t in req.inputs):
        return b""
    return cache_key(entry.name, vs.version,
                     [_Tensor(t.name, t.datatype, t.shape, frames[t.frame]) for t in req.inputs],
                     req.outputs)


class ResponseCache:
    def __init__(self, cache: LocalCache | RedisCache | None,
                 send_frontend: Callable[[bytes, Any, list[Any]], None],
                 frontends: Callable[[], Any] = list) -> None:
        self.cache = cache
        self._send_frontend = send_frontend
        self._frontends = frontends     # () -> the frontends' identities (CacheEvicted)
        # (frontend, req_id) -> (the version's stats, lookup ns, key): misses whose answer
        # is due
        self._misses: collections.OrderedDict[tuple[bytes, int], tuple[Any, int, bytes]] = \
            collections.OrderedDict()
        self._warned: set[str] = set()

    def enabled(self, model: str, config: Any) -> bool:
        """Whether requests to a model with this config are looked up (Triton serves one
        that enables the cache on a server without one uncached; said once per model)."""
        if not config.response_cache.enable:
            return False
        if self.cache is None and model not in self._warned:
            self._warned.add(model)
            log.info("model '%s' enables the response cache, but the server has none "
                     "(--cache-config): its responses are not cached", model)
        return self.cache is not None

    @property
    def frontend_bytes(self) -> int:
        """How many bytes of hits a frontend may keep copies of (ModelInfo.cache_bytes):
        those of the local cache, which tells the frontends what it evicts (CacheEvicted),
        so a copy never outlives its entry and the cache's LRU order stays its own; none of
        Redis's, whose evictions nobody is told of."""
        return self.cache.size if isinstance(self.cache, LocalCache) else 0

    def frontend_hit(self, msg: m.CacheHit, stats: Any) -> None:
        """A hit a frontend answered from its copy (CacheHit): counted as Triton counts a
        hit (no queue time: it was answered where it arrived)."""
        stats.cache_hit(0, msg.lookup_ns)
        if isinstance(self.cache, LocalCache):
            self.cache.touch(msg.key)

    def lookup(self, identity: bytes, req: m.InferRequest, stats: Any, arrival_ns: int,
               missed: Callable[[], None]) -> bool:
        """Answer ``req`` (read at ``arrival_ns``) from the cache if it can; True: answered,
        or (a cache awaited, Redis) taken: ``missed()`` queues it if it is not there."""
        cache = self.cache
        assert cache is not None   # (a key is sent only for a model enabled() said yes to)
        if isinstance(cache, RedisCache):
            asyncio.get_running_loop().create_task(
                self._lookup_redis(cache, identity, req, stats, arrival_ns, missed))
            return True
        t0 = time.monotonic_ns()
        entry = cache.lookup(req.cache_key)
        took = time.monotonic_ns() - t0
        if entry is None:
            self._missed(identity, req, stats, took)
            return False
        self._hit(identity, req, stats, t0 - arrival_ns, took, entry.outputs, entry.frames)
        return True

    async def _lookup_redis(self, cache: RedisCache, identity: bytes, req: m.InferRequest,
                            stats: Any, arrival_ns: int, missed: Callable[[], None]) -> None:
        t0 = time.monotonic_ns()
        found = await cache.lookup(req.cache_key)
        took = time.monotonic_ns() - t0
        if found is None:
            self._missed(identity, req, stats, took)
            missed()
        else:
            self._hit(identity, req, stats, t0 - arrival_ns, took, *found)

    def _missed(self, identity: bytes, req: m.InferRequest, stats: Any, lookup_ns: int) -> None:
        self._misses[(identity, req.req_id)] = (stats, lookup_ns, req.cache_key)
        if len(self._misses) > _MISSES_KEPT:
            self._misses.popitem(last=False)

    def _hit(self, identity: bytes, req: m.InferRequest, stats: Any, queue_ns: int,
             lookup_ns: int, outputs: list[m.TensorRef], frames: list[bytes]) -> None:
        stats.cache_hit(queue_ns, lookup_ns)
        self._send_frontend(identity, m.InferResult(req.req_id, req.version, list(outputs),
                                                    cached=True), frames)

    def on_insert(self, identity: bytes, msg: m.CacheInsert, frames: list[Any]) -> None:
        """A miss's answer: its outputs kept (a success) and the miss counted."""
        waiting = self._misses.pop((identity, msg.req_id), None)
        if waiting is None or self.cache is None:
            return
        stats, lookup_ns, _ = waiting
        if not msg.ok:
            return
        data = [bytes(frames[o.frame]) for o in msg.outputs]
        outputs = [m.TensorRef(o.name, o.datatype, o.shape, o.nbytes, frame=i)
                   for i, o in enumerate(msg.outputs)]
        if isinstance(self.cache, RedisCache):
            asyncio.get_running_loop().create_task(
                self._insert_redis(self.cache, msg.key, outputs, data, stats, lookup_ns))
            return
        nbytes = sum(len(d) for d in data) + _ENTRY_OVERHEAD * (len(outputs) + 1)
        t0 = time.monotonic_ns()
        error = self.cache.insert(msg.key, Entry(outputs, data, nbytes))
        self._inserted(msg.key, error, stats, lookup_ns + time.monotonic_ns() - t0)
        if self.cache.evicted:
            evicted = m.CacheEvicted(self.cache.evicted)
            self.cache.evicted = []
            for frontend in self._frontends():
                self._send_frontend(frontend, evicted, [])

    async def _insert_redis(self, cache: RedisCache, key: bytes, outputs: list[m.TensorRef],
                            data: list[bytes], stats: Any, lookup_ns: int) -> None:
        t0 = time.monotonic_ns()
        error = await cache.insert(key, outputs, data)
        self._inserted(key, error, stats, lookup_ns + time.monotonic_ns() - t0)

    def _inserted(self, key: bytes, error: str | None, stats: Any, miss_ns: int) -> None:
        if error is not None:
            log.warning("Failed to insert key [%s] into response cache: %s", key.hex(), error)
        stats.cache_miss(miss_ns)

    def step_answered(self, identity: bytes, result: m.InferResult, frames: list[Any]) -> None:
        """An ensemble step's final answer, if its lookup missed: kept as a frontend's
        CacheInsert would keep it (only a success whose outputs are all in the message)."""
        waiting = self._misses.get((identity, result.req_id))
        if waiting is None or result.cached:
            return
        inline = result.error is None and all(o.frame >= 0 for o in result.outputs)
        self.on_insert(identity, m.CacheInsert(result.req_id, waiting[2], list(result.outputs),
                                               ok=inline), frames)

    def frontend_lost(self, identity: bytes) -> None:
        for key in [k for k in self._misses if k[0] == identity]:
            del self._misses[key]
