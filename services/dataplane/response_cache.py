"""The response cache as a frontend sees it (FrontendCache, owned by DataPlane,
client.py): the key of each request it looks up (cache_key.py), the answer of a miss sent
for the scheduler's cache to keep (CacheInsert), and copies of the cache's hits, so that a
request the cache holds is answered where it arrived, without the round trip to the
scheduler that holds the cache.

    a request whose key the scheduler answered from its cache (InferResult.cached)
        ─▶ keep: its outputs copied here, under the model's name
    the same key again ─▶ get: answered at once; a CacheHit tells the scheduler after the
        answer, which counts the hit as its own (statistics, nv_cache_* metrics) and makes
        the entry the most recent in its LRU order
    the scheduler evicts an entry (CacheEvicted), the model changes (RepositoryChanged)
        or the scheduler is lost ─▶ the copies go

Only the local cache's hits are copied (ModelInfo.cache_bytes is its size, 0 for Redis,
whose evictions nobody is told of), and only hits, never a miss's answer the cache may
refuse: a copy exists only while its entry does, so every frontend answers what the
scheduler's cache holds, and the copies of one frontend hold at most what that cache does.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from services.common import messages as m
from services.common.cache_key import cache_key
from services.dataplane.regions import uses_regions
from services.dataplane.types import CoreRequest


class Copy:
    __slots__ = ("frames", "model", "nbytes", "outputs")

    def __init__(self, model: str, outputs: list[m.TensorRef], frames: list[bytes]) -> None:
        self.model = model
        self.outputs = outputs
        self.frames = frames
        self.nbytes = sum(len(f) for f in frames)


class RecentHits:
    def __init__(self) -> None:
        self.size = 0          # bytes (the scheduler's word: ModelInfo.cache_bytes)
        self.used = 0
        self._copies: collections.OrderedDict[bytes, Copy] = collections.OrderedDict()

    def get(self, key: bytes) -> Copy | None:
        c = self._copies.get(key)
        if c is not None:
            self._copies.move_to_end(key)
        return c

    def keep(self, model: str, key: bytes, msg: m.InferResult, frames: list[Any]) -> None:
        """A hit the scheduler answered: its outputs (all in frames) copied."""
        if key in self._copies or any(o.frame < 0 for o in msg.outputs):
            return
        data = [bytes(frames[o.frame]) for o in msg.outputs]
        outputs = [m.TensorRef(o.name, o.datatype, o.shape, o.nbytes, frame=i)
                   for i, o in enumerate(msg.outputs)]
        c = Copy(model, outputs, data)
        if c.nbytes > self.size:
            return
        while self.used + c.nbytes > self.size:
            _, old = self._copies.popitem(last=False)
            self.used -= old.nbytes
        self._copies[key] = c
        self.used += c.nbytes

    def evicted(self, keys: list[bytes]) -> None:
        for key in keys:
            self._drop(key)

    def changed(self, models: list[str]) -> None:
        """Models that changed ([]: any may have): their copies go."""
        if not models:
            self.clear()
            return
        names = set(models)
        for key in [k for k, c in self._copies.items() if c.model in names]:
            self._drop(key)

    def clear(self) -> None:
        self._copies.clear()
        self.used = 0

    def _drop(self, key: bytes) -> None:
        c = self._copies.pop(key, None)
        if c is not None:
            self.used -= c.nbytes


class FrontendCache:
    def __init__(self, send: Callable[..., None], view: Callable[[str, int, int], Any]) -> None:
        self._send = send              # to the scheduler
        self._view = view              # (segment, offset, nbytes) -> a worker's output bytes
        self.keys: dict[int, tuple[bytes, str]] = {}   # req_id -> (key, model) until answered
        self.copies = RecentHits()

    def key(self, req: CoreRequest, info: m.ModelInfo, version: int) -> bytes:
        """The request's key; b"" when it is not looked up (client shared memory)."""
        return b"" if uses_regions(req) else cache_key(
            info.name, version, req.inputs, [o.name for o in req.outputs or ()])

    def copy(self, key: bytes, info: m.ModelInfo) -> Copy | None:
        if not info.cache_bytes:
            return None
        self.copies.size = info.cache_bytes
        return self.copies.get(key)

    def looked_up(self, req_id: int, key: bytes, model: str) -> None:
        self.keys[req_id] = (key, model)

    def answered(self, msg: m.InferResult, frames: list[Any]) -> None:
        """A looked-up request's final answer: a hit's outputs copied, a miss's sent for the
        scheduler's cache to keep (a success) or forget (an error)."""
        looked_up = self.keys.pop(msg.req_id, None)
        if looked_up is None:
            return
        key, model = looked_up
        if msg.cached:
            self.copies.keep(model, key, msg, frames)
        elif msg.error is not None:
            self._send(m.CacheInsert(msg.req_id, key, ok=False))
        else:
            data = [frames[o.frame] if o.frame >= 0 else self._view(o.segment, o.offset, o.nbytes)
                    for o in msg.outputs]
            self._send(m.CacheInsert(msg.req_id, key, [
                m.TensorRef(o.name, o.datatype, o.shape, o.nbytes, frame=i)
                for i, o in enumerate(msg.outputs)]), data)

    def clear(self) -> None:
        """The scheduler is lost: no answer comes for what was looked up, copies go."""
        self.keys.clear()
        self.copies.clear()
