"""A sequence model's CORRID control of TYPE_UINT64 given a string sequence ID: Triton 2.51
answers 200 and hands the model the string's first bytes as a BYTES element (4-byte length,
then the text) read as a uint64; asked of real Triton, "sess-a" arrives as
8319104481279082502 and "12" as 55186034786306. An integer ID arrives as itself."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server

MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(
            r, "CORRID").as_numpy().reshape([1]).astype(np.uint64))]) for r in requests]
'''
CONFIG = '''name: "seq"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT64 dims: [ 1 ] } ]
sequence_batching {
  control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] } ]
}
instance_group [ { kind: KIND_CPU count: 1 } ]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("corrid") / "models"
    (repo / "seq" / "1").mkdir(parents=True)
    (repo / "seq" / "config.pbtxt").write_text(CONFIG)
    (repo / "seq" / "1" / "model.py").write_text(MODEL)
    with start_server(repo) as srv:
        yield srv


@pytest.mark.parametrize("module", [httpclient, grpcclient])
@pytest.mark.parametrize("sequence_id, seen", [("sess-a", 8319104481279082502),
                                               ("12", 55186034786306), (7, 7)])
def test_the_model_sees_what_triton_gives_it(server, module, sequence_id, seen):
    c = module.InferenceServerClient(server.http_url if module is httpclient else server.grpc_url)
    try:
        x = module.InferInput("IN", [1], "FP32")
        x.set_data_from_numpy(np.ones(1, np.float32))
        res = c.infer("seq", [x], sequence_id=sequence_id, sequence_start=True, sequence_end=True)
        assert res.as_numpy("OUT").tolist() == [seen]
    finally:
        c.close()
