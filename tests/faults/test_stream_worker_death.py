"""A decoupled model answers from its own thread after execute() returned; its worker dies
before the final response. The scheduler no longer holds that request's batch, so the
worker listed it as still streaming (BatchDone.streaming): the stream still gets its one
final answer, an error naming the instance, and the instance is back for the next one."""
from __future__ import annotations

import os
import queue
import signal

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import start_server, wait_until
from models_python import io_config, python_model

STALL = '''
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: answers IN from a thread, then the final flag; IN = 0 stalls after its
    first response (the test kills the worker there)."""

    def execute(self, requests):
        for request in requests:
            v = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            threading.Thread(target=self.respond, args=(v, request.get_response_sender()),
                             daemon=True).start()
        return None

    def respond(self, v, sender):
        sender.send(pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.array([v, __import__("os").getpid()], dtype=np.int32))]))
        while v == 0:
            time.sleep(1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_death") / "models"
    python_model(root, "stall", STALL, io_config(
        "stall", [("IN", "TYPE_INT32", "[ 1 ]")], [("OUT", "TYPE_INT32", "[ 2 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    with start_server(root) as srv:
        yield srv


def stream(server, value: int, kill_after_first: bool = False) -> list:
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    inp = grpcclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([value], np.int32))
    before = _executions(c)
    try:
        c.async_stream_infer("stall", [inp], enable_empty_final_response=True)
        seen = [got.get(timeout=30)]
        if kill_after_first:
            # Once the scheduler has counted the execution, the batch is done for it: only
            # the worker's word (BatchDone.streaming) says the request is still open.
            wait_until(lambda: _executions(c) > before, 30, "the batch to be done")
            os.kill(int(seen[0][0].as_numpy("OUT")[1]), signal.SIGKILL)
        while True:
            result, error = got.get(timeout=30)   # no hang: the final answer comes
            seen.append((result, error))
            if error is not None or result.get_response().parameters[
                    "triton_final_response"].bool_param:
                return seen
    finally:
        c.stop_stream()
        c.close()


def _executions(client) -> int:
    stats = client.get_inference_statistics("stall").model_stats
    return stats[0].execution_count if stats else 0


def test_a_stream_whose_worker_dies_after_execute_gets_its_final_answer(server):
    seen = stream(server, 0, kill_after_first=True)
    assert seen[0][1] is None and seen[0][0].as_numpy("OUT")[0] == 0
    error = seen[-1][1]
    assert error is not None and len(seen) == 2
    assert error.message() == ("model instance 'stall_0_0' of model 'stall' exited (exit code -9) "
                               "before the final response; the request was not completed")
    # The instance comes back; a stream that ends normally is not touched.
    wait_until(lambda: _served(server), 30, "the instance to restart")


def _served(server) -> bool:
    seen = stream(server, 5)
    return seen[-1][1] is None and seen[0][0].as_numpy("OUT")[0] == 5
