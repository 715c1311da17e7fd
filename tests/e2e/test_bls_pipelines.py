"""BLS reaches the scheduler's other queue kinds: a Python model calls an ensemble, and
runs a sequence on a sequence model with correlation_id and START/END flags."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from conftest import start_server
from models_python import io_config, python_model
from models_sequence import accumulate_state
from test_ensemble import repository

BLS_PIPELINES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """MODE 0: the 'chain' ensemble on A, B; MODE 1: a sequence of three requests on
    'accumulate' (correlation id 99) with A[0], A[1], A[2]; OUT is what came back."""

    def execute(self, requests):
        responses = []
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            if mode == 0:
                r = pb_utils.InferenceRequest(
                    model_name="chain", requested_output_names=["SCALED"],
                    inputs=[pb_utils.Tensor("A", a.reshape(1, 4)),
                            pb_utils.Tensor("B", np.ones((1, 4), np.float32))]).exec()
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
                out = pb_utils.get_output_tensor_by_name(r, "SCALED").as_numpy().reshape(4)
            else:
                sums = []
                for i in range(3):
                    flags = ((pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if i == 0 else 0)
                             | (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if i == 2 else 0))
                    r = pb_utils.InferenceRequest(
                        model_name="accumulate", requested_output_names=["OUTPUT"],
                        inputs=[pb_utils.Tensor("INPUT", np.array([[int(a[i])]], np.int32))],
                        correlation_id=99, flags=flags).exec()
                    if r.has_error():
                        raise pb_utils.TritonModelException(r.error().message())
                    sums.append(float(pb_utils.get_output_tensor_by_name(r, "OUTPUT").as_numpy()[0][0]))
                out = np.array(sums + [0.0], np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
'''


@pytest.fixture(scope="module", params=["frontend-process", "in-process-frontend"])
def server(tmp_path_factory, request):
    """Both ways: BLS requests enter at the scheduler's socket also when the frontend runs
    on the scheduler's loop (--in-process-frontend)."""
    root = repository(tmp_path_factory.mktemp("bls_pipelines") / "models")
    accumulate_state(root / "accumulate")
    python_model(root, "bls_pipelines", BLS_PIPELINES, io_config(
        "bls_pipelines", [("MODE", "TYPE_INT32", "[ 1 ]"), ("A", "TYPE_FP32", "[ 4 ]")],
        [("OUT", "TYPE_FP32", "[ 4 ]")]))
    extra = ["--in-process-frontend"] if request.param == "in-process-frontend" else []
    with start_server(root, *extra, "--exit-on-error", "false", ready=False) as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        from conftest import wait_until
        wait_until(lambda: client.is_model_ready("bls_pipelines") and client.is_model_ready("chain")
                   and client.is_model_ready("accumulate"), 60, "the models")
        yield client


def _run(client, mode: int, a: list[float]) -> list[float]:
    inputs = [httpclient.InferInput("MODE", [1], "INT32"), httpclient.InferInput("A", [4], "FP32")]
    inputs[0].set_data_from_numpy(np.array([mode], np.int32))
    inputs[1].set_data_from_numpy(np.array(a, np.float32))
    return client.infer("bls_pipelines", inputs).as_numpy("OUT").tolist()


def test_bls_calls_an_ensemble(server):
    assert _run(server, 0, [0, 1, 2, 3]) == [2.0, 4.0, 6.0, 8.0]      # (A + 1) * 2


def test_bls_runs_a_sequence(server):
    assert _run(server, 1, [5, 6, 7, 0]) == [5.0, 11.0, 18.0, 0.0]
    assert _run(server, 1, [1, 1, 1, 0]) == [1.0, 2.0, 3.0, 0.0]     # START: from zero again
