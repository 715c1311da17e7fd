"""Triton's identity backend end to end: `backend: "identity"` models with empty version
folders (no model file), served by `trireme serve`, checked over HTTP and gRPC with
tritonclient: OUTPUTn is exactly INPUTn for INT32, FP32 and BYTES, zero-sized tensors,
large tensors (through shared memory), a dynamic batch, an absent optional input."""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import start_server, wait_until

IO = (("INPUT0", "OUTPUT0", "TYPE_INT32", "INT32"), ("INPUT1", "OUTPUT1", "TYPE_FP32", "FP32"),
      ("INPUT2", "OUTPUT2", "TYPE_STRING", "BYTES"))


def identity_model(root: Path, name: str, max_batch_size: int, extra: str = "",
                   optional: str = "") -> None:
    d = root / name
    (d / "1").mkdir(parents=True)   # Triton's create_nop_version_dir: an empty version
    io = "".join(f'input [{{ name: "{i}" data_type: {t} dims: [-1] }}]\n'
                 f'output [{{ name: "{o}" data_type: {t} dims: [-1] }}]\n' for i, o, t, _ in IO)
    (d / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "identity"\nmax_batch_size: {max_batch_size}\n'
        f'instance_group [{{ kind: KIND_CPU }}]\n{extra}\n{io}{optional}')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity") / "models"
    identity_model(root, "identity", 8, "dynamic_batching { }")
    identity_model(root, "identity_nobatch", 0)
    # four requests of one row make one batch: the queue waits (up to 60 s) for them
    identity_model(root, "identity_batched", 8, "dynamic_batching { preferred_batch_size: [4] "
                   "max_queue_delay_microseconds: 60000000 }")
    identity_model(root, "identity_optional", 8, "dynamic_batching { }",
                   'input [{ name: "INPUT3" data_type: TYPE_BOOL dims: [2] optional: true }]\n'
                   'output [{ name: "OUTPUT3" data_type: TYPE_BOOL dims: [2] }]\n')
    with start_server(root) as srv:
        yield srv


@pytest.fixture(scope="module", params=["http", "grpc"])
def client(request, server):
    if request.param == "http":
        c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    else:
        c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def _mod(client):
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def tensors(rows: int, width: int) -> list[np.ndarray]:
    ints = np.arange(rows * width, dtype=np.int32).reshape(rows, width) - 7
    floats = (np.linspace(-1, 1, rows * width, dtype=np.float32).reshape(rows, width)
              if rows * width else np.zeros((rows, width), np.float32))
    texts = np.array([[f"r{r}c{c}".encode() if c % 3 else b"\xff\x00raw" if c % 2 else b""
                       for c in range(width)] for r in range(rows)], dtype=object)
    return [ints, floats, texts.reshape(rows, width)]


def infer(client, model: str, arrays: list[np.ndarray], outputs: list[str] | None = None):
    mod = _mod(client)
    inputs = []
    for (name, _, _, datatype), arr in zip(IO, arrays):
        i = mod.InferInput(name, list(arr.shape), datatype)
        i.set_data_from_numpy(arr)
        inputs.append(i)
    wanted = [mod.InferRequestedOutput(n) for n in outputs] if outputs else None
    return client.infer(model, inputs, outputs=wanted)


def assert_identity(result, arrays: list[np.ndarray]) -> None:
    for (_, out, _, datatype), arr in zip(IO, arrays):
        got = result.as_numpy(out)
        assert got.shape == arr.shape, out
        if datatype == "BYTES":
            assert got.tolist() == arr.tolist()
        else:
            assert got.dtype == arr.dtype
            np.testing.assert_array_equal(got, arr)


def test_config_served_without_a_model_file(server):
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        cfg = c.get_model_config("identity")
        assert cfg["backend"] == "identity" and cfg["max_batch_size"] == 8
        assert [i["name"] for i in cfg["input"]] == ["INPUT0", "INPUT1", "INPUT2"]
    finally:
        c.close()


@pytest.mark.parametrize("rows,width", [(1, 1), (3, 5), (8, 16)])
def test_outputs_are_the_inputs(client, rows, width):
    arrays = tensors(rows, width)
    assert_identity(infer(client, "identity", arrays), arrays)


def test_only_the_requested_outputs(client):
    arrays = tensors(2, 3)
    r = infer(client, "identity", arrays, outputs=["OUTPUT2", "OUTPUT0"])
    assert r.as_numpy("OUTPUT1") is None
    assert r.as_numpy("OUTPUT0").tolist() == arrays[0].tolist()
    assert r.as_numpy("OUTPUT2").tolist() == arrays[2].tolist()


@pytest.mark.parametrize("model,shape", [("identity", (2, 0)), ("identity", (1, 0)),
                                         ("identity_nobatch", (0,))])
def test_zero_sized_tensors(client, model, shape):
    arrays = [np.zeros(shape, np.int32), np.zeros(shape, np.float32), np.empty(shape, dtype=object)]
    assert_identity(infer(client, model, arrays), arrays)


def test_large_tensors_through_shared_memory(client):
    arrays = tensors(8, 1 << 15)   # 1 MiB each of INT32 and FP32
    assert_identity(infer(client, "identity", arrays), arrays)


def test_absent_optional_input_gives_zeros(client):
    arrays = tensors(3, 2)
    r = infer(client, "identity_optional", arrays)
    assert_identity(r, arrays)
    assert r.as_numpy("OUTPUT3").tolist() == [[False, False]] * 3


def test_a_dynamic_batch_answers_each_request_with_its_own_tensors(server):
    def stats() -> dict:
        c = httpclient.InferenceServerClient(server.http_url)
        try:
            return c.get_inference_statistics("identity_batched")["model_stats"][0]
        finally:
            c.close()

    # same shapes (a batch needs them), different contents
    sent = [[a + k if a.dtype != object else a * (k + 1) for a in tensors(1, 4)]
            for k in range(4)]
    c4 = httpclient.InferenceServerClient(server.http_url, concurrency=4, network_timeout=90)
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda arrays: infer(c4, "identity_batched", arrays), sent))
    finally:
        c4.close()
    for r, arrays in zip(results, sent):
        assert_identity(r, arrays)
    # the worker answers before it reports the batch: wait for the statistics to show it
    st = wait_until(lambda: (s := stats()).get("batch_stats") and s, 10, "batch statistics")
    assert st["inference_count"] == 4 and st["execution_count"] == 1
    assert [b["batch_size"] for b in st["batch_stats"]] == [4]
