"""gRPC: Triton's shared-memory RPCs (SystemSharedMemory*, CudaSharedMemory*) over a fake
data plane, on both servers (native and grpc.aio), and the raw output entry an output
written into shared memory keeps in ModelInferResponse.

Triton's gRPC layer (src/grpc/grpc_server.cc) checks no field itself: what reaches the
registry is the request as sent, and the registry's errors come back with their codes.
Imports only our generated protos (never tritonclient's).
"""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from protos import grpc_service_pb2 as pb
from services.common.errors import Code, TriremeError
from services.dataplane.types import CoreResponse, OutputTensor
from services.frontend.grpc import codec
from services.frontend.grpc.methods import start_grpc
from services.frontend.grpc.shm_methods import cuda_status_to_proto, system_status_to_proto
from services.frontend.restricted import Restrictions
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_shm_routes import DISABLED, HANDLE, ShmDataPlane

IMPLS = ["native", "aio"]


def run_with_server(body, dp: ShmDataPlane, impl: str, **settings: Any) -> None:
    async def main():
        server = await start_grpc(dp, FrontendSettings(
            scheduler_addr="", host="127.0.0.1", grpc_port=0, grpc_impl=impl, **settings))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
                await asyncio.wait_for(body(ch), 20)
        finally:
            await server.stop(None)
    asyncio.run(main())


def rpc(ch, name: str):
    req, resp = getattr(pb, f"{name}Request"), getattr(pb, f"{name}Response")
    return ch.unary_unary(f"/inference.GRPCInferenceService/{name}",
                          request_serializer=req.SerializeToString,
                          response_deserializer=resp.FromString)


async def fails(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(request)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("impl", IMPLS)
def test_system_rpcs(impl):
    dp = ShmDataPlane()

    async def body(ch):
        status, register = rpc(ch, "SystemSharedMemoryStatus"), rpc(ch, "SystemSharedMemoryRegister")
        unregister = rpc(ch, "SystemSharedMemoryUnregister")
        assert dict((await status(pb.SystemSharedMemoryStatusRequest())).regions) == {}
        await register(pb.SystemSharedMemoryRegisterRequest(name="r0", key="/k0", offset=4096,
                                                            byte_size=64))
        await register(pb.SystemSharedMemoryRegisterRequest(name="r1", key="/k1", byte_size=8))
        assert dp.calls[1:] == [("register", "system", "r0", "/k0", 4096, 64, 0, b""),
                                ("register", "system", "r1", "/k1", 0, 8, 0, b"")]
        regions = (await status(pb.SystemSharedMemoryStatusRequest())).regions
        assert sorted(regions) == ["r0", "r1"]
        r0 = regions["r0"]
        assert (r0.name, r0.key, r0.offset, r0.byte_size) == ("r0", "/k0", 4096, 64)
        one = (await status(pb.SystemSharedMemoryStatusRequest(name="r1"))).regions
        assert list(one) == ["r1"] and one["r1"].byte_size == 8
        assert await fails(status, pb.SystemSharedMemoryStatusRequest(name="x")) == (
            grpc.StatusCode.NOT_FOUND, "Unable to find system shared memory region: 'x'")
        assert await fails(register, pb.SystemSharedMemoryRegisterRequest(
            name="r0", key="/k0", byte_size=64)) == (
            grpc.StatusCode.ALREADY_EXISTS, "shared memory region 'r0' already in manager")
        await unregister(pb.SystemSharedMemoryUnregisterRequest(name="r0"))
        await unregister(pb.SystemSharedMemoryUnregisterRequest())              # all
        assert dp.calls[-2:] == [("unregister", "system", "r0"), ("unregister", "system", "")]
        assert dict((await status(pb.SystemSharedMemoryStatusRequest())).regions) == {}
    run_with_server(body, dp, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_rpcs(impl):
    dp = ShmDataPlane()

    async def body(ch):
        status, register = rpc(ch, "CudaSharedMemoryStatus"), rpc(ch, "CudaSharedMemoryRegister")
        unregister = rpc(ch, "CudaSharedMemoryUnregister")
        await register(pb.CudaSharedMemoryRegisterRequest(name="g", raw_handle=HANDLE,
                                                          device_id=1, byte_size=128))
        assert dp.calls == [("register", "cuda", "g", "", 0, 128, 1, HANDLE)]
        regions = (await status(pb.CudaSharedMemoryStatusRequest())).regions
        assert list(regions) == ["g"]
        assert (regions["g"].name, regions["g"].device_id, regions["g"].byte_size) == (
            "g", 1, 128)
        # Triton's gRPC checks neither the handle's size nor the device: the registry does
        await register(pb.CudaSharedMemoryRegisterRequest(name="h", raw_handle=b"abc",
                                                          device_id=-1, byte_size=0))
        assert dp.calls[-1] == ("register", "cuda", "h", "", 0, 0, -1, b"abc")
        assert await fails(status, pb.CudaSharedMemoryStatusRequest(name="x")) == (
            grpc.StatusCode.NOT_FOUND, "Unable to find cuda shared memory region: 'x'")
        await unregister(pb.CudaSharedMemoryUnregisterRequest())
        assert dp.calls[-1] == ("unregister", "cuda", "")
        assert dict((await status(pb.CudaSharedMemoryStatusRequest())).regions) == {}
    run_with_server(body, dp, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_disabled_server(impl):
    """Triton's L0_shared_memory test_client_shm_disabled_by_default: status answers (no
    regions), register and unregister are UNIMPLEMENTED with the "--allow-client-shm" text."""
    dp = ShmDataPlane(allowed=False)

    async def body(ch):
        assert dict((await rpc(ch, "SystemSharedMemoryStatus")(
            pb.SystemSharedMemoryStatusRequest())).regions) == {}
        refused = (grpc.StatusCode.UNIMPLEMENTED, DISABLED)
        assert await fails(rpc(ch, "SystemSharedMemoryRegister"),
                           pb.SystemSharedMemoryRegisterRequest(name="r", key="/k",
                                                                byte_size=8)) == refused
        assert await fails(rpc(ch, "SystemSharedMemoryUnregister"),
                           pb.SystemSharedMemoryUnregisterRequest(name="r")) == refused
        assert await fails(rpc(ch, "CudaSharedMemoryRegister"),
                           pb.CudaSharedMemoryRegisterRequest(name="g", raw_handle=HANDLE)) == \
            refused
        assert await fails(rpc(ch, "CudaSharedMemoryUnregister"),
                           pb.CudaSharedMemoryUnregisterRequest()) == refused
    run_with_server(body, dp, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_region_name_goes_to_the_registry_as_it_is(impl):
    dp = ShmDataPlane()

    async def body(ch):
        code, _ = await fails(rpc(ch, "SystemSharedMemoryRegister"),
                              pb.SystemSharedMemoryRegisterRequest(key="/k", byte_size=8))
        assert code == grpc.StatusCode.INVALID_ARGUMENT        # the fake registry's answer
        assert dp.calls == [("register", "system", "", "/k", 0, 8, 0, b"")]
    run_with_server(body, dp, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_restricted_shared_memory(impl):
    dp = ShmDataPlane()
    restricted = Restrictions.parse([], ["shared-memory:k=v"])

    async def body(ch):
        status = rpc(ch, "CudaSharedMemoryStatus")
        assert await fails(status, pb.CudaSharedMemoryStatusRequest()) == (
            grpc.StatusCode.UNAVAILABLE,
            "This protocol is restricted, expecting header 'triton-grpc-protocol-k'")
        assert dp.calls == []
        assert dict((await status(pb.CudaSharedMemoryStatusRequest(),
                                  metadata=(("triton-grpc-protocol-k", "v"),))).regions) == {}
    run_with_server(body, dp, impl, restricted=restricted)


def test_status_map_is_keyed_as_triton_keys_it():
    """The map key is Triton's ``const char*`` of the name (cut at a NUL); the name inside
    is whole; the fields are taken by name, whatever the dict's order."""
    resp = system_status_to_proto([
        {"byte_size": 8, "offset": 0, "key": "/k", "name": "a\0b"},
        {"name": "c", "key": "/c", "offset": 4096, "byte_size": 1}])
    assert sorted(resp.regions) == ["a", "c"]
    assert resp.regions["a"].name == "a\0b" and resp.regions["c"].offset == 4096
    resp2 = cuda_status_to_proto([{"name": "g", "device_id": 3, "byte_size": 2**64 - 1}])
    assert (resp2.regions["g"].device_id, resp2.regions["g"].byte_size) == (3, 2**64 - 1)


@pytest.mark.parametrize("small", [True, False])
def test_output_in_shared_memory_keeps_an_empty_raw_entry(small, monkeypatch):
    """infer_handler.cc ResponseAllocatorHelper adds a raw_output_contents entry for every
    output, one written into shared memory included (empty): the client pairs them by
    position."""
    if not small:
        monkeypatch.setattr(codec, "SMALL_MESSAGE", 0)      # the zero-copy path
    resp = CoreResponse("m", "1", outputs=[
        OutputTensor("A", "INT32", [1], b"\x01\0\0\0"),
        OutputTensor("S", "FP32", [2, 2], b""),            # in the client's region
        OutputTensor("B", "INT32", [1], memoryview(b"\x02\0\0\0"))])
    for data in (codec.encode_infer_response(resp),
                 pb.ModelStreamInferResponse.FromString(
                     codec.encode_stream_response(resp)).infer_response.SerializeToString()):
        msg = pb.ModelInferResponse.FromString(data)
        assert [(o.name, o.datatype, list(o.shape)) for o in msg.outputs] == [
            ("A", "INT32", [1]), ("S", "FP32", [2, 2]), ("B", "INT32", [1])]
        assert list(msg.raw_output_contents) == [b"\x01\0\0\0", b"", b"\x02\0\0\0"]


def test_errors_keep_their_codes():
    """The registry's codes go through methods._STATUS, as every other error."""
    from services.frontend.grpc.methods import grpc_status
    assert grpc_status(TriremeError(Code.UNSUPPORTED, DISABLED).code) == \
        grpc.StatusCode.UNIMPLEMENTED
    assert grpc_status(Code.ALREADY_EXISTS) == grpc.StatusCode.ALREADY_EXISTS
