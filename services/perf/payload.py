"""Requests made once, sent many times: tritonclient InferInput lists for every prepared
tensor set (inline, or pointing into a system shared-memory region that holds them all),
the requested outputs (inline, or into an output region from a pool), and reading the
outputs of a result (the "receive" part of the client's time).

--shared-memory=system (perf_analyzer's): the process writes every request's input bytes
once into one region it registers; each request in flight gets its own output region of
`output_shm_size` bytes per output (the exact size where the output's shape is fixed).
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from services.perf.inputs import Sample, np_dtype
from services.perf.model import Tensor
from services.perf.worker_core import WorkerSpec


def _module(protocol: str) -> Any:
    if protocol == "http":
        import tritonclient.http as mod  # type: ignore[import-untyped]
    else:
        import tritonclient.grpc as mod  # type: ignore[import-untyped]
    return mod


def _nbytes(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        from tritonclient.utils import serialize_byte_tensor  # type: ignore[import-untyped]
        return serialize_byte_tensor(arr).tobytes()
    if datatype == "BF16":   # (tritonclient takes BF16 as FP32: its top half)
        return (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype(
            np.uint16).tobytes()
    return np.ascontiguousarray(arr).tobytes()


class Payload:
    """The prepared inputs and outputs of one load process (and its shared memory)."""

    def __init__(self, spec: WorkerSpec, control: Any = None) -> None:
        self.spec = spec
        self.mod = _module(spec.protocol)
        self.control = control           # a clients.Control: registers the regions
        self.dtypes = {t.name: t.datatype for t in spec.inputs}
        flat = spec.requests if spec.sequence is None else \
            [s for stream in spec.streams for s in stream]
        self._regions: list[tuple[str, Any]] = []
        self._free_outputs: list[list[Any]] = []
        self._out_bytes: list[int] = []
        self._tag = f"perf-{os.getpid()}"
        if spec.shared_memory == "system":
            self.inputs = self._shm_inputs(flat)
            self._out_bytes = [self._output_size(t) for t in spec.outputs]
        else:
            self.inputs = [self._inline_inputs(s) for s in flat]
        self.outputs = self._plain_outputs()

    # ---- inputs
    def _inline_inputs(self, sample: Sample) -> list[Any]:
        out = []
        for name, arr in sample.items():
            t = self.mod.InferInput(name, list(arr.shape), self.dtypes[name])
            if self.spec.protocol == "http":
                t.set_data_from_numpy(arr, binary_data=not self.spec.input_json)
            else:
                t.set_data_from_numpy(arr)
            out.append(t)
        return out

    def _region(self, name: str, size: int) -> Any:
        import tritonclient.utils.shared_memory as shm  # type: ignore[import-untyped]
        key = f"/{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        self._regions.append((name, handle))
        self.control.register_system_shm(name, key, size)
        return handle

    def _shm_inputs(self, flat: list[Sample]) -> list[list[Any]]:
        import tritonclient.utils.shared_memory as shm
        blobs = [[(name, arr, _nbytes(arr, self.dtypes[name])) for name, arr in s.items()]
                 for s in flat]
        size = sum(len(b) for s in blobs for _, _, b in s)
        name = f"{self._tag}-inputs"
        handle = self._region(name, max(size, 1))
        out, offset = [], 0
        for s in blobs:
            req = []
            for tname, arr, raw in s:
                shm.set_shared_memory_region(handle, [np.frombuffer(raw, np.uint8)], offset)
                t = self.mod.InferInput(tname, list(arr.shape), self.dtypes[tname])
                t.set_shared_memory(name, len(raw), offset)
                req.append(t)
                offset += len(raw)
            out.append(req)
        return out

    # ---- outputs
    def _output_size(self, t: Tensor) -> int:
        if t.datatype == "BYTES" or any(d < 0 for d in t.dims):
            return self.spec.output_shm_size * max(1, self.spec.batch_size)
        n = math.prod(t.dims) * (self.spec.batch_size if self.spec.batched else 1)
        return n * np.dtype(np_dtype(t.datatype)).itemsize

    def _plain_outputs(self) -> list[Any] | None:
        if self.spec.protocol == "http" and self.spec.output_json:
            return [self.mod.InferRequestedOutput(t.name, binary_data=False)
                    for t in self.spec.outputs]
        return None   # (all outputs; HTTP: binary)

    def take_outputs(self) -> tuple[list[Any] | None, Any]:
        """The requested outputs of one request in flight, and what `give_outputs` needs
        back; with shared memory a region of the pool (a new one when all are taken)."""
        if self.spec.shared_memory != "system":
            return self.outputs, None
        if self._free_outputs:
            entry = self._free_outputs.pop()
        else:
            n = len(self._regions)
            name = f"{self._tag}-outputs-{n}"
            handle = self._region(name, max(1, sum(self._out_bytes)))
            outs, offset, where = [], 0, {}
            for t, size in zip(self.spec.outputs, self._out_bytes):
                o = (self.mod.InferRequestedOutput(t.name) if self.spec.protocol == "grpc"
                     else self.mod.InferRequestedOutput(t.name, binary_data=True))
                o.set_shared_memory(name, size, offset)
                where[t.name] = offset
                outs.append(o)
                offset += size
            entry = [outs, handle, where]
        return entry[0], entry

    def give_outputs(self, entry: Any) -> None:
        if entry is not None:
            self._free_outputs.append(entry)

    def read(self, result: Any, entry: Any) -> None:
        """Decode every output of a result (from the response, or from its region)."""
        if entry is None:
            for t in self.spec.outputs:
                result.as_numpy(t.name)
            return
        import tritonclient.utils.shared_memory as shm
        _, handle, where = entry
        for t in self.spec.outputs:
            out = result.get_output(t.name)
            if out is None:
                continue
            shape = out["shape"] if isinstance(out, dict) else list(out.shape)
            shm.get_contents_as_numpy(handle, np_dtype(t.datatype), [int(d) for d in shape],
                                      where[t.name])

    def close(self) -> None:
        """Unregister and unlink every region (at exit: the server may be gone already)."""
        import tritonclient.utils.shared_memory as shm
        for name, handle in self._regions:
            try:
                self.control.unregister_system_shm(name)
            except Exception:   # noqa: BLE001  (the server may already be gone)
                pass
            try:
                shm.destroy_shared_memory_region(handle)
            except Exception:   # noqa: BLE001
                pass
        self._regions = []
