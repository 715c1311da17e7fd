"""Triton's qa/L0_initializer_as_input: an ONNX initializer that is also a graph input may be
declared as an optional input; a request without it gets the model's stored value, one
with it overrides it."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server
from models import add_with_initializer, write_config


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("initializer") / "models"
    add_with_initializer(repo / "add_with_initializer")
    write_config(repo / "add_with_initializer", '''platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 5, 5 ] },
        { name: "INITIALIZER" data_type: TYPE_FP32 dims: [ 5, 5 ] optional: true } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 5, 5 ] } ]
''')
    with start_server(repo) as srv:
        yield srv


@pytest.mark.parametrize("mod", [httpclient, grpcclient])
def test_optional_initializer_input(server, mod):
    c = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    x = np.arange(25, dtype=np.float32).reshape(5, 5)
    inp = mod.InferInput("INPUT", [5, 5], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("add_with_initializer", [inp]).as_numpy("OUTPUT"), x + 1)
    init = mod.InferInput("INITIALIZER", [5, 5], "FP32")
    init.set_data_from_numpy(x)
    np.testing.assert_array_equal(
        c.infer("add_with_initializer", [inp, init]).as_numpy("OUTPUT"), x + x)
    c.close()
