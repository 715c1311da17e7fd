"""The client shared-memory registry (Triton's SharedMemoryManager texts and codes) and a
worker's RegionMap, on real POSIX shared-memory objects."""
from __future__ import annotations

import mmap
import os
import uuid

import pytest

from services.common import messages as m
from services.common.client_shm import RegionMap
from services.common.errors import Code, TriremeError
from services.scheduler.shm_regions import Registry

PAGE = mmap.ALLOCATIONGRANULARITY


@pytest.fixture
def key():
    name = f"tt_unit_{uuid.uuid4().hex[:10]}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.truncate(4 * PAGE)
    yield "/" + name
    os.unlink(path)


def reg(name: str, key: str, offset: int = 0, size: int = PAGE, kind: str = "system"):
    return m.ShmRegister(1, kind, name, key, offset, size)


def err(fn, *args) -> tuple[Code, str]:
    with pytest.raises(TriremeError) as e:
        fn(*args)
    return e.value.code, e.value.message


def test_disabled_refuses_register_and_unregister_but_answers_status(key):
    r = Registry(allowed=False)
    text = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
    assert err(r.register, reg("a", key)) == (Code.UNSUPPORTED, text)
    assert err(r.unregister, m.ShmUnregister(1, "system")) == (Code.UNSUPPORTED, text)
    assert r.status(m.ShmStatus(1, "system")) == []


def test_register_status_unregister(key):
    r = Registry(allowed=True)
    r.register(reg("a", key, PAGE, 2 * PAGE))
    assert r.status(m.ShmStatus(1, "system", "a")) == [
        {"name": "a", "key": key, "offset": PAGE, "byte_size": 2 * PAGE}]
    assert err(r.register, reg("a", key)) == (
        Code.ALREADY_EXISTS, "shared memory region 'a' already in manager")
    r.register(reg("b", key))                      # the same object under another name
    assert r.unregister(m.ShmUnregister(1, "system", "a")) == []     # still mapped for "b"
    assert r.unregister(m.ShmUnregister(1, "system", "missing")) == []  # no error (Triton)
    assert r.unregister(m.ShmUnregister(1, "system")) == [key]
    assert err(r.status, m.ShmStatus(1, "system", "a")) == (
        Code.NOT_FOUND, "Unable to find system shared memory region: 'a'")
    assert err(r.status, m.ShmStatus(1, "cuda", "a")) == (
        Code.NOT_FOUND, "Unable to find cuda shared memory region: 'a'")


def test_register_checks_in_tritons_order(key):
    r = Registry(allowed=True)
    assert err(r.register, reg("", key)) == (
        Code.INVALID_ARG, "'region name' is necessary to register system shared memory region")
    assert err(r.register, reg("c", "", kind="cuda")) == (
        Code.INVALID_ARG, "failed to register CUDA shared memory region: 'c', GPUs not supported")
    assert err(r.register, reg("k", "///")) == (
        Code.INVALID_ARG, "cannot register shared memory region 'k' - invalid shm key '///'")
    assert err(r.register, reg("k", "/trireme-1-in-0"))[1].endswith(
        "as the key contains the reserved prefix 'trireme-'")
    assert err(r.register, reg("k", "/no_such_object_here")) == (
        Code.INTERNAL, "Unable to open shared memory region: '/no_such_object_here'")
    assert err(r.register, reg("k", "/a/../b")) == (
        Code.INTERNAL, "Unable to open shared memory region: '/a/../b'")
    assert err(r.register, reg("k", key, 0, 5 * PAGE)) == (
        Code.INVALID_ARG, "failed to register shared memory region 'k': invalid args")
    assert err(r.register, reg("k", key, 7, PAGE))[1] == (
        "failed to register shared memory region 'k': unable to process address "
        "spaceInvalid argument")


def test_resolve_turns_regions_into_keys_and_offsets(key):
    r = Registry(allowed=True)
    r.register(reg("a", key, PAGE, 128))
    req = m.InferRequest(1, "", "m", 0, [m.TensorRef("X", "FP32", [4], 16, offset=32, region="a")],
                         out_regions={"Y": m.OutputRegion("a", 64, 64)})
    r.resolve(req)
    x = req.inputs[0]
    assert (x.region, x.key, x.offset) == ("", key, PAGE + 32)
    y = req.out_regions["Y"]
    assert (y.region, y.key, y.offset, y.nbytes) == ("", key, PAGE + 64, 64)


@pytest.mark.parametrize("offset,nbytes,text", [
    (128, 4, "Invalid offset for shared memory region: 'a'"),
    (-1, 4, "Invalid offset for shared memory region: 'a'"),
    (100, 64, "Invalid offset + byte size for shared memory region: 'a'"),
])
def test_resolve_checks_bounds(key, offset, nbytes, text):
    r = Registry(allowed=True)
    r.register(reg("a", key, 0, 128))
    req = m.InferRequest(1, "", "m", 0, [m.TensorRef("X", "FP32", [1], nbytes, offset=offset,
                                                      region="a")])
    assert err(r.resolve, req) == (Code.INVALID_ARG, text)
    req.inputs[0].region = "b"
    assert err(r.resolve, req) == (Code.NOT_FOUND, "Unable to find shared memory region: 'b'")


def test_region_map_reads_writes_and_forgets(key):
    regions = RegionMap()
    v = regions.view(key, PAGE, 4)
    v[:] = b"abcd"
    with open("/dev/shm/" + key.lstrip("/"), "rb") as f:
        f.seek(PAGE)
        assert f.read(4) == b"abcd"
    assert len(regions) == 1
    del v
    regions.forget([key])
    assert len(regions) == 0
    with pytest.raises(TriremeError, match="fewer than the"):
        regions.view(key, 4 * PAGE, 1)
    regions.close()


def test_unregister_waits_for_requests_holding_the_region(key):
    r = Registry(allowed=True)
    r.register(reg("a", key, 0, 128))
    def request():
        return m.InferRequest(1, "", "m", 0, [m.TensorRef("X", "FP32", [1], 4, region="a")])
    first, second = r.resolve(request()), r.resolve(request())
    assert first == second == ("a",)
    assert r.unregister(m.ShmUnregister(1, "system", "a")) == []       # held: kept, listed
    assert [s["name"] for s in r.status(m.ShmStatus(1, "system"))] == ["a"]
    third = r.resolve(request())                                         # and still usable
    assert r.release(first) == [] and r.release(second) == []
    assert r.release(third) == [key]                                      # the last one: gone
    assert r.status(m.ShmStatus(1, "system")) == []
    r.register(reg("a", key, 0, 128))
    assert r.release(r.resolve(request())) == []                          # not unregistered


def test_offset_plus_size_overflow(key):
    r = Registry(allowed=True)
    r.register(reg("a", key, 0, 64))
    req = m.InferRequest(1, "", "m", 0, [m.TensorRef("X", "FP32", [1], 2**64 - 32, offset=32,
                                                      region="a")])
    assert err(r.resolve, req) == (Code.INVALID_ARG, (
        "Integer overflow detected: byte_size (18446744073709551584) + offset (32) exceeds "
        "maximum value (18446744073709551615) for region 'a'"))
