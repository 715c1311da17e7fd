"""Triton's shared-memory RPCs: SystemSharedMemory{Status,Register,Unregister} and
CudaSharedMemory{Status,Register,Unregister}.

Triton's gRPC layer checks nothing of the request itself (src/grpc/grpc_server.cc,
CommonHandler::Register{System,Cuda}SharedMemory*): each field goes to the manager as it
is, and the registry (the scheduler's, behind ``dp``) answers with the manager's texts and
codes. What is left here is the status message: map<string, RegionStatus>, keyed by the
region name as Triton keys it (its ``const char*``, cut at a NUL), the name in full inside.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from protos import grpc_service_pb2 as pb
from services.dataplane.api import DataPlaneAPI

__all__ = ["SharedMemoryRpcs", "cuda_status_to_proto", "system_status_to_proto"]


def system_status_to_proto(regions: Iterable[Mapping[str, Any]]
                           ) -> pb.SystemSharedMemoryStatusResponse:
    resp = pb.SystemSharedMemoryStatusResponse()
    for r in regions:
        name = r["name"]
        resp.regions[name.partition("\0")[0]].CopyFrom(
            pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=name, key=r["key"], offset=int(r["offset"]),
                byte_size=int(r["byte_size"])))
    return resp


def cuda_status_to_proto(regions: Iterable[Mapping[str, Any]]
                         ) -> pb.CudaSharedMemoryStatusResponse:
    resp = pb.CudaSharedMemoryStatusResponse()
    for r in regions:
        name = r["name"]
        resp.regions[name.partition("\0")[0]].CopyFrom(
            pb.CudaSharedMemoryStatusResponse.RegionStatus(
                name=name, device_id=int(r["device_id"]), byte_size=int(r["byte_size"])))
    return resp


class SharedMemoryRpcs:
    """The six RPCs over the data plane ``dp`` (methods.GrpcService owns one)."""

    __slots__ = ("_dp",)

    def __init__(self, dp: DataPlaneAPI) -> None:
        self._dp = dp

    def handlers(self) -> dict[str, Callable[[Any, Any], Awaitable[Any]]]:
        """RPC name -> handler, for the service's method table."""
        return {
            "SystemSharedMemoryStatus": self.SystemSharedMemoryStatus,
            "SystemSharedMemoryRegister": self.SystemSharedMemoryRegister,
            "SystemSharedMemoryUnregister": self.SystemSharedMemoryUnregister,
            "CudaSharedMemoryStatus": self.CudaSharedMemoryStatus,
            "CudaSharedMemoryRegister": self.CudaSharedMemoryRegister,
            "CudaSharedMemoryUnregister": self.CudaSharedMemoryUnregister,
        }

    # -- system (POSIX) shared memory ----------------------------------------------------
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Any) -> pb.SystemSharedMemoryStatusResponse:
        return system_status_to_proto(await self._dp.shm_status("system", request.name))

    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Any) -> pb.SystemSharedMemoryRegisterResponse:
        await self._dp.shm_register("system", request.name, key=request.key,
                                    offset=request.offset, byte_size=request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
            self, request: pb.SystemSharedMemoryUnregisterRequest,
            context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._dp.shm_unregister("system", request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # -- CUDA shared memory ---------------------------------------------------------------
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Any) -> pb.CudaSharedMemoryStatusResponse:
        return cuda_status_to_proto(await self._dp.shm_status("cuda", request.name))

    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context: Any) -> pb.CudaSharedMemoryRegisterResponse:
        await self._dp.shm_register("cuda", request.name, byte_size=request.byte_size,
                                    device_id=request.device_id,
                                    raw_handle=request.raw_handle)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        await self._dp.shm_unregister("cuda", request.name)
        return pb.CudaSharedMemoryUnregisterResponse()
