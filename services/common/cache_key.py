"""A request's response-cache key (scheduler/response_cache.py looks it up): the model, the
version, and every input's name, datatype, shape and bytes, and the outputs asked for.
Triton's key has the names and bytes only, so two requests whose bytes agree but whose
shapes, datatypes or requested outputs differ share an answer there (its issue #4362); here
they do not (docs/compat.md)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any


def cache_key(model: str, version: int, inputs: Iterable[Any], outputs: Iterable[str]) -> bytes:
    """``inputs``: InputTensors with their bytes (``data``); ``outputs``: names ([]: all)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{len(model)}:{model}:{version}".encode())
    for t in sorted(inputs, key=lambda t: t.name):
        data = t.data
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        h.update(f"|{len(t.name)}:{t.name}:{t.datatype}:{list(t.shape)}:{n}:".encode())
        h.update(data)
    for name in sorted(outputs):
        h.update(f"|o{len(name)}:{name}".encode())
    return h.digest()
