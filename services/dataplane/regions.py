"""A request's client shared-memory regions as the data plane passes them on: named, not
read (the scheduler resolves them: scheduler/shm_regions.py)."""
from __future__ import annotations

from typing import Any

from services.common import messages as m
from services.common.client_shm import unknown_region
from services.dataplane.types import CoreRequest


def region_ref(t: Any) -> m.TensorRef:
    """An input in the client's shared memory: the region as named (the scheduler finds
    it; the adapters checked the parameters' types). A region named "" can never be
    registered: Triton's "not found" at once."""
    p = t.parameters
    if not p["shared_memory_region"]:
        raise unknown_region("")
    return m.TensorRef(t.name, t.datatype, list(t.shape), p.get("shared_memory_byte_size", 0),
                       offset=p.get("shared_memory_offset", 0),
                       region=p["shared_memory_region"])


def uses_regions(req: CoreRequest) -> bool:
    """Whether a request reads or writes client shared memory."""
    return (any(t.data is None for t in req.inputs)
            or any("shared_memory_region" in o.parameters for o in req.outputs or ()))


def output_region(p: dict[str, Any]) -> m.OutputRegion:
    """An output to be written into the client's shared memory: where."""
    if not p["shared_memory_region"]:
        raise unknown_region("")
    return m.OutputRegion(p["shared_memory_region"], p.get("shared_memory_offset", 0),
                          p.get("shared_memory_byte_size", 0))
