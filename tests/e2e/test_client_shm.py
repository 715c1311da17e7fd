"""Client system shared memory end to end (Triton's shared-memory extension), with the
official tritonclient and its shared_memory utilities: inputs read in place and outputs
written into the client's regions over HTTP and gRPC, every datatype and BYTES, offsets
(page 1023 of a 4 MiB object, every version of a model, direct and batched), an ensemble,
Triton's error texts, a region registered through one frontend and used through the other,
the flag off, and no mapping left behind."""
from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from conftest import start_server, wait_until
from models import ONNX_TYPES, add_sub, identity, scale, write_config
from models_python import IDENTITY, io_config, python_model
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

CLIENTS = [(httpclient, "http_url"), (grpcclient, "grpc_url")]
A = np.arange(16, dtype=np.int32).reshape(1, 16)
# Identity that holds each request until the file named by its GATE input exists (having
# created "<gate>.started"): a request kept in flight for as long as a test needs.
GATE = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            gate = pb_utils.get_input_tensor_by_name(r, "GATE").as_numpy()[0].decode()
            open(gate + ".started", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.005)
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
'''
B = np.ones((1, 16), dtype=np.int32)
PAGE = os.sysconf("SC_PAGE_SIZE")
LARGE = PAGE * 1023   # Triton's test_large_shm_register_offset: page 1023 of a 1024-page object
# layout: (bytes of each object, {tensor: (object, register offset, registered bytes,
# request offset)}); a region per (object, register offset)
LARGE_OFFSETS = {
    # Triton's test: an object of 1024 pages per tensor, each registered at page 1023
    "object_per_tensor": (PAGE * 1024, {t: (t, LARGE, 64, 0)
                                        for t in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")}),
    # one 9 MiB object: the inputs' region registered at 1 MiB, the outputs' at page 1023,
    # each tensor at its own request offset inside its region
    "one_object": (9 << 20, {"INPUT0": ("o", 1 << 20, 1 << 20, 0),
                             "INPUT1": ("o", 1 << 20, 1 << 20, (8 << 10) + 12),
                             "OUTPUT0": ("o", LARGE, 4 << 20, 0),
                             "OUTPUT1": ("o", LARGE, 4 << 20, (3 << 20) + 4)}),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("client_shm") / "models"
    add_sub(repo / "simple", dtype="int32")
    write_config(repo / "simple", 'name: "simple"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
                 'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    for dt in ONNX_TYPES:
        identity(repo / f"identity_{dt}", dt)
        write_config(repo / f"identity_{dt}", 'max_batch_size: 8\n'
                     'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    python_model(repo, "py_identity", IDENTITY, io_config(
        "py_identity", [("INPUT0", "TYPE_FP32", "[ -1 ]")], [("OUTPUT0", "TYPE_FP32", "[ -1 ]")],
        max_batch_size=8))
    python_model(repo, "py_strings", IDENTITY, io_config(
        "py_strings", [("INPUT0", "TYPE_STRING", "[ -1 ]")],
        [("OUTPUT0", "TYPE_STRING", "[ -1 ]")], max_batch_size=8))
    python_model(repo, "gate", GATE, io_config(
        "gate", [("INPUT0", "TYPE_INT32", "[ 16 ]"), ("GATE", "TYPE_STRING", "[ 1 ]")],
        [("OUTPUT0", "TYPE_INT32", "[ 16 ]")]))
    for name, extra in (("versions", ""), ("versions_batched", "dynamic_batching { }\n")):
        # Triton's gen_qa_models *_int32_int32_int32: versions 1-3, 2 and 3 swapped
        add_sub(repo / name, dtype="int32", versions=(1, 2, 3), swapped=(2, 3))
        write_config(repo / name, f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
                     'version_policy: { all { } }\n'
                     'instance_group [{ kind: KIND_CPU, count: 1 }]\n' + extra)
    scale(repo / "scale", ["batch", "n"], factor=2.0)
    write_config(repo / "scale", 'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU }]\n')
    (repo / "chain" / "1").mkdir(parents=True)
    write_config(repo / "chain", '''name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "py_identity" model_version: -1
    input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "scale" model_version: -1
    input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "Y" } } ] }
''')
    with start_server(repo, "--allow-client-shm=true", frontends=2) as srv:
        yield srv


def _key() -> str:
    return f"/tt_shm_{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def region(client, nbytes: int, name: str | None = None, register: bool = True):
    """A client region of ``nbytes``, registered with the server while in use."""
    name = name or f"r{uuid.uuid4().hex[:8]}"
    key = _key()
    handle = shm.create_shared_memory_region(name, key, nbytes)
    try:
        if register:
            client.register_system_shared_memory(name, key, nbytes)
        yield name, key, handle
    finally:
        if register:
            with contextlib.suppress(InferenceServerException):
                client.unregister_system_shared_memory(name)
        shm.destroy_shared_memory_region(handle)


def _client(srv, mod):
    return mod.InferenceServerClient(getattr(srv, "grpc_url" if mod is grpcclient else "http_url"))


def _in(mod, name: str, arr: np.ndarray, region_name: str, offset: int = 0):
    t = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_shared_memory(region_name, arr.nbytes if arr.dtype != np.object_ else
                        _bytes_size(arr), offset)
    return t


def _out(mod, name: str, region_name: str, nbytes: int, offset: int = 0):
    o = mod.InferRequestedOutput(name)
    o.set_shared_memory(region_name, nbytes, offset)
    return o


def _put(handle, arr: np.ndarray) -> None:
    """Write ``arr`` into a region as Triton's clients do (BYTES serialized first)."""
    if arr.dtype == np.object_:
        from tritonclient.utils import serialize_byte_tensor
        arr = serialize_byte_tensor(arr)
    shm.set_shared_memory_region(handle, [arr])


def _bytes_size(arr: np.ndarray) -> int:
    from tritonclient.utils import serialize_byte_tensor, serialized_byte_size
    return serialized_byte_size(serialize_byte_tensor(arr))


def _no_bytes(r, mod, name: str) -> bool:
    """The response names ``name`` but carries none of its bytes (they are in the region):
    over HTTP no "data" and no binary part, over gRPC an empty raw_output_contents entry."""
    resp = r.get_response()
    if mod is httpclient:
        out = next(o for o in resp["outputs"] if o["name"] == name)
        return "data" not in out and "binary_data_size" not in out.get("parameters", {})
    i = [o.name for o in resp.outputs].index(name)
    return resp.raw_output_contents[i] == b""


def _maps(srv, key: str) -> list[int]:
    """The server's processes that map the object ``key``."""
    path = "/dev/shm/" + key.lstrip("/")
    out = []
    for pid in srv.family():
        with contextlib.suppress(OSError):
            if path in Path(f"/proc/{pid}/maps").read_text():
                out.append(pid)
    return out


# ---------------------------------------------------------------- inputs and outputs
@pytest.mark.parametrize("mod,_", CLIENTS)
def test_simple_inputs_and_outputs_in_shared_memory(server, mod, _):
    """Triton's simple_{http,grpc}_shm_client: both inputs in one region, both outputs in
    another; the response carries no tensor bytes."""
    c = _client(server, mod)
    with region(c, 128) as (rin, _, hin), region(c, 128) as (rout, _, hout):
        shm.set_shared_memory_region(hin, [A])
        shm.set_shared_memory_region(hin, [B], offset=64)
        r = c.infer("simple", [_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", B, rin, 64)],
                    outputs=[_out(mod, "OUTPUT0", rout, 64), _out(mod, "OUTPUT1", rout, 64, 64)])
        out0 = r.get_output("OUTPUT0")
        assert (out0["shape"] if mod is httpclient else list(out0.shape)) == [1, 16]
        assert _no_bytes(r, mod, "OUTPUT0") and _no_bytes(r, mod, "OUTPUT1")
        np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.int32, [1, 16]), A + B)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(hout, np.int32, [1, 16], offset=64), A - B)
    c.close()


@pytest.mark.parametrize("mod,_", CLIENTS)
def test_mixed_shared_memory_and_wire(server, mod, _):
    """Input in shared memory with the output on the wire, and the other way round."""
    c = _client(server, mod)
    with region(c, 64) as (rin, _, hin):
        shm.set_shared_memory_region(hin, [A])
        i1 = mod.InferInput("INPUT1", [1, 16], "INT32")
        i1.set_data_from_numpy(B)
        r = c.infer("simple", [_in(mod, "INPUT0", A, rin), i1])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)
    with region(c, 64) as (rout, _, hout):
        i0, i1 = mod.InferInput("INPUT0", [1, 16], "INT32"), mod.InferInput("INPUT1", [1, 16], "INT32")
        i0.set_data_from_numpy(A)
        i1.set_data_from_numpy(B)
        r = c.infer("simple", [i0, i1], outputs=[_out(mod, "OUTPUT1", rout, 64),
                                                 mod.InferRequestedOutput("OUTPUT0")])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
        assert _no_bytes(r, mod, "OUTPUT1")
        np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.int32, [1, 16]), A - B)
    c.close()


@pytest.mark.parametrize("dt", sorted(ONNX_TYPES))
def test_every_datatype(server, dt):
    c = _client(server, grpcclient if dt in ("fp16", "bytes") else httpclient)
    mod = grpcclient if dt in ("fp16", "bytes") else httpclient
    triton_dt = {"bool": "BOOL", "bytes": "BYTES"}.get(dt, dt.upper())
    np_dt = triton_to_np_dtype(triton_dt)
    if dt == "bytes":
        x = np.array([[b"a", b"", "ünï".encode(), b"x" * 300]], dtype=np.object_)
    elif dt == "bool":
        x = np.array([[True, False, True]])
    else:
        x = (np.arange(12) % 7).astype(np_dt).reshape(2, 6)
    size = _bytes_size(x) if dt == "bytes" else x.nbytes
    with region(c, size) as (rin, _, hin), region(c, size) as (rout, _, hout):
        _put(hin, x)
        t = mod.InferInput("INPUT0", list(x.shape), triton_dt)
        t.set_shared_memory(rin, size)
        c.infer(f"identity_{dt}", [t], outputs=[_out(mod, "OUTPUT0", rout, size)])
        got = shm.get_contents_as_numpy(hout, np_dt, list(x.shape))
        np.testing.assert_array_equal(got, x)
    c.close()


@pytest.mark.parametrize("mod,_", CLIENTS)
def test_python_model_bytes_in_shared_memory(server, mod, _):
    """Triton's simple_*_shm_string_client path: BYTES through a Python model."""
    c = _client(server, mod)
    x = np.array([[b"1", b"22", b"333", "ß".encode()]], dtype=np.object_)
    size = _bytes_size(x)
    with region(c, size) as (rin, _, hin), region(c, size + 16) as (rout, _, hout):
        _put(hin, x)
        c.infer("py_strings", [_in(mod, "INPUT0", x, rin)],
                outputs=[_out(mod, "OUTPUT0", rout, size + 16)])
        np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.object_, [1, 4]), x)
    c.close()


def test_ensemble_reads_and_writes_client_memory(server):
    """An ensemble's input from a region goes to its first step by reference, and the
    output the client wants in its region is written there by the step that makes it."""
    c = _client(server, grpcclient)
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with region(c, 32) as (rin, _, hin), region(c, 32) as (rout, _, hout):
        shm.set_shared_memory_region(hin, [x])
        r = c.infer("chain", [_in(grpcclient, "X", x, rin)],
                    outputs=[_out(grpcclient, "Y", rout, 32)])
        assert _no_bytes(r, grpcclient, "Y")
        np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.float32, [1, 8]), x * 2)
    c.close()


def test_large_tensor_round_trip(server):
    """64 MiB in and out through client memory, twice through the same regions."""
    c = _client(server, httpclient)
    x = np.random.default_rng(0).random((1, 16 << 20), dtype=np.float32)
    with region(c, x.nbytes) as (rin, _, hin), region(c, x.nbytes) as (rout, _, hout):
        shm.set_shared_memory_region(hin, [x])
        for _ in range(2):
            c.infer("py_identity", [_in(httpclient, "INPUT0", x, rin)],
                    outputs=[_out(httpclient, "OUTPUT0", rout, x.nbytes)])
            np.testing.assert_array_equal(
                shm.get_contents_as_numpy(hout, np.float32, list(x.shape)), x)
    c.close()


@pytest.mark.parametrize("layout", sorted(LARGE_OFFSETS))
@pytest.mark.parametrize("model", ["versions", "versions_batched"])
@pytest.mark.parametrize("mod,_", CLIENTS)
def test_large_offsets_every_version(server, mod, _, model, layout):
    """Regions far into objects over 4 MiB (Triton's test_large_shm_register_offset), on the
    direct path and through the dynamic batcher, every version asked for: each answer's
    exact bytes land at register offset + request offset, nothing else in the objects is
    touched, and the default version is the latest (3, whose outputs are swapped)."""
    size, spec = LARGE_OFFSETS[layout]
    c = _client(server, mod)
    with contextlib.ExitStack() as stack:
        keys: dict[str, tuple[str, object]] = {}
        names: dict[tuple[str, int], str] = {}
        for obj, roff, nbytes, _q in spec.values():
            if obj not in keys:
                key = _key()
                keys[obj] = (key, shm.create_shared_memory_region(f"o_{obj}", key, size))
                stack.callback(shm.destroy_shared_memory_region, keys[obj][1])
            if (obj, roff) not in names:
                names[obj, roff] = f"r{uuid.uuid4().hex[:8]}"
                c.register_system_shared_memory(names[obj, roff], keys[obj][0], nbytes, roff)
                stack.callback(c.unregister_system_shared_memory, names[obj, roff])

        def where(t):   # (region name, request offset, handle, offset in the object)
            obj, roff, _n, q = spec[t]
            return names[obj, roff], q, keys[obj][1], roff + q
        for t, x in (("INPUT0", A), ("INPUT1", B)):
            shm.set_shared_memory_region(where(t)[2], [x], offset=where(t)[3])
        for version, served in (("1", "1"), ("2", "2"), ("3", "3"), ("", "3")):
            for t in ("OUTPUT0", "OUTPUT1"):   # a request that writes nothing shows
                shm.set_shared_memory_region(where(t)[2], [np.full(16, 0x5A5A5A5A, np.int32)],
                                             offset=where(t)[3])
            r = c.infer(model, [_in(mod, t, x, where(t)[0], where(t)[1])
                                for t, x in (("INPUT0", A), ("INPUT1", B))],
                        model_version=version,
                        outputs=[_out(mod, t, where(t)[0], 64, where(t)[1])
                                 for t in ("OUTPUT0", "OUTPUT1")])
            resp = r.get_response()
            assert (resp["model_version"] if mod is httpclient else resp.model_version) == served
            assert _no_bytes(r, mod, "OUTPUT0") and _no_bytes(r, mod, "OUTPUT1")
            want = (A + B, A - B) if served == "1" else (A - B, A + B)
            for t, w in zip(("OUTPUT0", "OUTPUT1"), want):
                got = shm.get_contents_as_numpy(where(t)[2], np.int32, [1, 16], offset=where(t)[3])
                assert got.tolist() == w.tolist(), (t, version)
            for obj, (_k, h) in keys.items():   # every other byte of the objects still zero
                rest = shm.get_contents_as_numpy(h, np.uint8, [size]).copy()
                for t in spec:
                    if spec[t][0] == obj:
                        rest[where(t)[3]:where(t)[3] + 64] = 0
                assert not rest.any(), (obj, version, np.flatnonzero(rest)[:8])
    c.close()


# ---------------------------------------------------------------- registry
@pytest.mark.parametrize("mod,_", CLIENTS)
def test_status_register_unregister(server, mod, _):
    c = _client(server, mod)
    key = _key()
    h = shm.create_shared_memory_region("s1", key, 8192)
    try:
        c.register_system_shared_memory("s1", key, 4096, offset=4096)
        status = c.get_system_shared_memory_status("s1")
        if mod is httpclient:
            assert status == [{"name": "s1", "key": key, "offset": 4096, "byte_size": 4096}]
        else:
            r = status.regions["s1"]
            assert (r.name, r.key, r.offset, r.byte_size) == ("s1", key, 4096, 4096)
        with pytest.raises(InferenceServerException, match="shared memory region 's1' already "
                           "in manager"):
            c.register_system_shared_memory("s1", key, 4096)
        c.unregister_system_shared_memory("s1")
        with pytest.raises(InferenceServerException, match="Unable to find system shared "
                           "memory region: 's1'"):
            c.get_system_shared_memory_status("s1")
        c.unregister_system_shared_memory("s1")            # unknown: no error (Triton)
    finally:
        shm.destroy_shared_memory_region(h)
    c.close()


def test_registration_errors(server):
    c = _client(server, httpclient)
    with pytest.raises(InferenceServerException, match="Unable to open shared memory region: "
                       "'/tt_no_such_key'"):
        c.register_system_shared_memory("nope", "/tt_no_such_key", 64)
    key = _key()
    h = shm.create_shared_memory_region("small", key, 64)
    try:
        with pytest.raises(InferenceServerException,
                           match="failed to register shared memory region 'small': invalid args"):
            c.register_system_shared_memory("small", key, 128)
    finally:
        shm.destroy_shared_memory_region(h)
    for key, prefix in (("/trireme-1-in-0", "trireme-"),
                        ("triton_python_backend_shm_region_x", "triton_python_backend_shm_region_")):
        with pytest.raises(InferenceServerException, match=f"as the key contains the reserved "
                           f"prefix '{prefix}'"):
            c.register_system_shared_memory("reserved", key, 64)
    with pytest.raises(InferenceServerException, match="Unable to open shared memory region: "
                       "'/../etc/passwd'"):
        c.register_system_shared_memory("escape", "/../etc/passwd", 64)
    assert c.get_system_shared_memory_status() == []
    c.close()


@pytest.mark.parametrize("mod,_", CLIENTS)
def test_request_errors(server, mod, _):
    """Triton's texts for a region nobody registered, bounds outside the region, and an
    output region too small (that request fails; the next one is served)."""
    c = _client(server, mod)
    with region(c, 64) as (rin, _, hin), region(c, 32) as (small, _, _h):
        shm.set_shared_memory_region(hin, [A])
        i1 = _in(mod, "INPUT1", B, "unregistered")
        with pytest.raises(InferenceServerException,
                           match="Unable to find shared memory region: 'unregistered'"):
            c.infer("simple", [_in(mod, "INPUT0", A, rin), i1])
        with pytest.raises(InferenceServerException,
                           match=f"Invalid offset for shared memory region: '{rin}'"):
            c.infer("simple", [_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", B, rin, 64)])
        bad = mod.InferInput("INPUT1", [1, 16], "INT32")
        bad.set_shared_memory(rin, 64, 32)
        with pytest.raises(InferenceServerException,
                           match=f"Invalid offset \\+ byte size for shared memory region: '{rin}'"):
            c.infer("simple", [_in(mod, "INPUT0", A, rin), bad])
        with pytest.raises(InferenceServerException, match="shared memory size specified with "
                           "the request for output 'OUTPUT0' \\(32 bytes\\) should be at least "
                           "64 bytes to hold the results"):
            c.infer("simple", [_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", A, rin)],
                    outputs=[_out(mod, "OUTPUT0", small, 32)])
        for inputs, outputs in (([_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", B, "")], None),
                                ([_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", A, rin)],
                                 [_out(mod, "OUTPUT0", "", 64)])):
            with pytest.raises(InferenceServerException) as e:   # a region named "": Triton's 404
                c.infer("simple", inputs, outputs=outputs)
            assert e.value.message() == "Unable to find shared memory region: ''"
            assert e.value.status() in ("404", "StatusCode.NOT_FOUND"), e.value
        r = c.infer("simple", [_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", A, rin)])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + A)
    c.close()


def test_region_unlinked_before_use(server):
    """The client removed the object after registering it: a clear error, no crash, and
    the server keeps serving."""
    c = _client(server, httpclient)
    key = _key()
    h = shm.create_shared_memory_region("gone", key, 64)
    c.register_system_shared_memory("gone", key, 64)
    shm.destroy_shared_memory_region(h)
    with pytest.raises(InferenceServerException,
                       match=f"Unable to open shared memory region: '{key}'"):
        c.infer("simple", [_in(httpclient, "INPUT0", A, "gone"),
                           _in(httpclient, "INPUT1", B, "gone")])
    c.unregister_system_shared_memory("gone")
    i0 = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    i1 = httpclient.InferInput("INPUT1", [1, 16], "INT32")
    i0.set_data_from_numpy(A)
    i1.set_data_from_numpy(B)
    np.testing.assert_array_equal(c.infer("simple", [i0, i1]).as_numpy("OUTPUT0"), A + B)
    c.close()


def test_any_frontend_sees_every_region(server):
    """Registered through one connection, used and listed through fresh connections that
    the two frontends (SO_REUSEPORT) share between them."""
    owner = _client(server, httpclient)
    with region(owner, 128) as (rin, key, hin):
        shm.set_shared_memory_region(hin, [A])
        shm.set_shared_memory_region(hin, [B], offset=64)
        for i in range(12):
            mod = grpcclient if i % 2 else httpclient
            c = _client(server, mod)
            r = c.infer("simple", [_in(mod, "INPUT0", A, rin), _in(mod, "INPUT1", B, rin, 64)])
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
            if mod is httpclient:
                assert [s["key"] for s in c.get_system_shared_memory_status()] == [key]
            c.close()
    owner.close()


def test_no_mapping_left_after_unregister(server):
    """100 register / infer / unregister cycles: after each unregister no server process
    maps the object, and the client's unlink leaves nothing in /dev/shm."""
    c = _client(server, grpcclient)
    keys = []
    for i in range(100):
        with region(c, 128) as (rin, key, hin):
            keys.append(key)
            shm.set_shared_memory_region(hin, [A])
            shm.set_shared_memory_region(hin, [B], offset=64)
            r = c.infer("simple", [_in(grpcclient, "INPUT0", A, rin),
                                   _in(grpcclient, "INPUT1", B, rin, 64)])
            np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)
            if i == 0:
                assert _maps(server, key), "the worker maps the region while registered"
        wait_until(lambda: not _maps(server, key), 10, "the worker to unmap the region")
    assert not [k for k in keys if os.path.exists("/dev/shm/" + k.lstrip("/"))]
    assert c.get_system_shared_memory_status().regions == {}
    c.close()


# ---------------------------------------------------------------- the flag off
@pytest.mark.parametrize("mod,_", CLIENTS)
def test_disabled_without_the_flag(tmp_path, mod, _):
    repo = tmp_path / "models"
    add_sub(repo / "simple", dtype="int32")
    write_config(repo / "simple", 'max_batch_size: 8\n')
    with start_server(repo) as srv:
        c = _client(srv, mod)
        key = _key()
        h = shm.create_shared_memory_region("r", key, 64)
        try:
            text = ("Client shared memory is disabled. Start the server with "
                    "'--allow-client-shm=true' to enable.")
            with pytest.raises(InferenceServerException, match=text.replace(".", "\\.")):
                c.register_system_shared_memory("r", key, 64)
            with pytest.raises(InferenceServerException, match="Client shared memory is disabled"):
                c.unregister_system_shared_memory()
            status = c.get_system_shared_memory_status()
            assert status == [] if mod is httpclient else status.regions == {}
            with pytest.raises(InferenceServerException,
                               match="Unable to find shared memory region: 'r'"):
                c.infer("simple", [_in(mod, "INPUT0", A, "r"), _in(mod, "INPUT1", B, "r")])
        finally:
            shm.destroy_shared_memory_region(h)
        c.close()


def test_unregister_waits_for_requests_in_flight(server, tmp_path):
    """Triton's awaiting_unregister: a region a running request uses stays registered (and
    usable) after unregister until that request is answered, then goes, unmapped."""
    c = _client(server, httpclient)
    runner = _client(server, httpclient)     # its one connection holds the request
    gate = str(tmp_path / "gate")
    x = np.arange(16, dtype=np.int32)
    with region(c, 64) as (rin, key, hin):
        shm.set_shared_memory_region(hin, [x])
        g = httpclient.InferInput("GATE", [1], "BYTES")
        g.set_data_from_numpy(np.array([gate.encode()], dtype=np.object_))
        pending = runner.async_infer("gate", [_in(httpclient, "INPUT0", x, rin), g])
        wait_until(lambda: os.path.exists(gate + ".started"), 30, "the request to start")
        c.unregister_system_shared_memory(rin)
        assert [r["name"] for r in c.get_system_shared_memory_status()] == [rin]
        open(gate, "w").close()
        np.testing.assert_array_equal(pending.get_result(timeout=30).as_numpy("OUTPUT0"), x)
        wait_until(lambda: c.get_system_shared_memory_status() == [], 10, "the region to go")
        wait_until(lambda: not _maps(server, key), 10, "the worker to unmap the region")
    c.close()
    runner.close()


def test_integer_overflow_of_offset_and_size(server):
    """Triton's text when offset + byte_size does not fit in 64 bits."""
    c = _client(server, httpclient)
    with region(c, 64) as (rin, _, hin), region(c, 64) as (rout, _, _h):
        shm.set_shared_memory_region(hin, [A])
        with pytest.raises(InferenceServerException, match=re.escape(
                f"Integer overflow detected: byte_size (18446744073709551584) + offset (32) "
                f"exceeds maximum value (18446744073709551615) for region '{rout}'")):
            c.infer("simple", [_in(httpclient, "INPUT0", A, rin), _in(httpclient, "INPUT1", A, rin)],
                    outputs=[_out(httpclient, "OUTPUT0", rout, 2**64 - 32, 32)])
    c.close()
