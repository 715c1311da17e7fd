"""Business Logic Scripting: a Python model's requests to other models.

A worker that runs BLS holds the scheduler's client: a DataPlane (the same code the HTTP
and gRPC frontends use: validation, shared-memory inputs, results pushed straight from the
target's worker) on an event loop in a background thread. The model's thread
blocks on a future for exec(); async_exec() awaits the same future from the model's loop.
The scheduler treats it as one more frontend, so batching, priorities and statistics of
the target model apply to BLS requests as to any other.

Outputs are copied out of the target worker's memory and its blocks handed back at once:
the model may keep a response as long as it likes without pinning another worker's arena.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from services.common import transport
from services.common.datatypes import deserialize_bytes_tensor, numpy_dtype, serialize_bytes_tensor
from services.common.errors import Code, TriremeError
from services.dataplane.client import DataPlane
from services.dataplane.settings import DataPlaneSettings
from services.dataplane.types import CoreRequest, CoreResponse, InputTensor, RequestedOutput
from services.workers.python import pb_utils

START_TIMEOUT_S = 30.0
_END = object()


def _core_request(req: pb_utils.InferenceRequest) -> CoreRequest:
    inputs = []
    for t in req.inputs():
        arr = t._numpy()
        datatype = t.datatype()
        if datatype == "BYTES":
            data: Any = serialize_bytes_tensor(arr)
        else:
            data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        inputs.append(InputTensor(t.name(), datatype, list(arr.shape), data))
    params = dict(req._parameters)
    if req.correlation_id():
        params["sequence_id"] = req.correlation_id()
    if req.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
        params["sequence_start"] = True
    if req.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
        params["sequence_end"] = True
    if req.timeout():
        params["timeout"] = req.timeout()
    version = req.model_version()
    return CoreRequest(req.model_name(), "" if version < 0 else str(version), req.request_id(),
                       inputs, [RequestedOutput(n) for n in req.requested_output_names()] or None,
                       params)


def _response(resp: CoreResponse) -> pb_utils.InferenceResponse:
    tensors = []
    for out in resp.outputs:
        if out.datatype == "BYTES":
            arr = deserialize_bytes_tensor(out.data).reshape(out.shape)
        else:
            arr = np.frombuffer(out.data, dtype=numpy_dtype(out.datatype)).reshape(out.shape).copy()
        tensors.append(pb_utils.Tensor(out.name, arr))
    return pb_utils.InferenceResponse(tensors, parameters=resp.parameters)


class BlsClient:
    def __init__(self, scheduler_addr: str, inline_threshold: int, use_shm: bool) -> None:
        if not scheduler_addr:
            raise pb_utils.TritonModelException(
                "BLS is not available: this worker was not given the scheduler's address")
        settings = DataPlaneSettings(
            scheduler_addr=scheduler_addr,
            result_addr=transport.result_address(scheduler_addr, "bls"),
            inline_threshold=inline_threshold, use_shm=use_shm)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trireme-bls", daemon=True)
        self.thread.start()
        self.dp = DataPlane(settings)
        self._call(self.dp.start(), START_TIMEOUT_S)

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def stop() -> None:
            self.dp.close()
        try:
            self._call(stop(), 5.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5.0)

    # -- inference ------------------------------------------------------------------------
    async def _failed(self, req: pb_utils.InferenceRequest, e: TriremeError) -> pb_utils.InferenceResponse:
        """The error as the model sees it: Triton's BLS text when the target is not ready
        (checked only now, so a call that succeeds costs no readiness round trip)."""
        if not await self.dp.model_ready(req.model_name(), _version(req)):
            e = TriremeError(Code.INTERNAL, "Failed for execute the inference request. "
                                            f"Model '{req.model_name()}' is not ready.")
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message, int(e.code)))

    async def _infer(self, req: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        try:
            resp = await self.dp.infer(_core_request(req), "BLS")
        except TriremeError as e:
            return await self._failed(req, e)
        try:
            return _response(resp)
        finally:
            self.dp.release(resp)

    async def _stream(self, req: pb_utils.InferenceRequest, sink: Any) -> None:
        """Every response of a decoupled model, each handed to ``sink`` as it arrives."""
        try:
            async for resp in self.dp.infer_stream(_core_request(req)):
                try:
                    sink(_response(resp))
                finally:
                    self.dp.release(resp)
        except TriremeError as e:
            sink(await self._failed(req, e))
        finally:
            sink(_END)

    def exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        if not decoupled:
            return self._call(self._infer(req))
        q: queue.SimpleQueue = queue.SimpleQueue()
        asyncio.run_coroutine_threadsafe(self._stream(req, q.put), self.loop)
        return _drain(q)

    async def async_exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        if not decoupled:
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._infer(req), self.loop))
        got: list[Any] = []
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._stream(req, got.append), self.loop))
        return iter(got[:-1])

    # -- model repository -----------------------------------------------------------------
    def control(self, action: str, model: str, *args: Any) -> Any:
        async def run() -> Any:
            if action == "ready":
                return await self.dp.model_ready(model, args[0])
            if action == "load":
                config, files = args
                params = {"config": config} if config else {}
                params.update({k: v for k, v in files.items()})
                return await self.dp.load_model(model, params)
            return await self.dp.unload_model(model, {"unload_dependents": args[0]})
        try:
            return self._call(run())
        except TriremeError as e:
            raise pb_utils.TritonModelException(e.message) from None


def _version(req: pb_utils.InferenceRequest) -> str:
    return "" if req.model_version() < 0 else str(req.model_version())


def _drain(q: queue.SimpleQueue) -> Iterator[pb_utils.InferenceResponse]:
    while (item := q.get()) is not _END:
        yield item
