"""Request cancellation end to end, with the real server and the official client.

A client that goes away (async_infer(...).cancel(), a client_timeout, a cancelled stream)
cancels its request: still queued, it never runs (it leaves the pending count at once), is
answered CANCELLED inside the server (failure metric reason CANCELED, statistics fail count;
on the direct path, which the "stream" server takes for these models, once its instance
reaches it) and its shared-memory input is freed; running in a Python model, the model's
is_cancelled() turns True, in a sync execute() (Triton's execute_cancel example) and in a
decoupled model's own thread.

The models hold while a file named "hold" exists in their folder and log what they do to
files there, so every wait below is a poll with a deadline on the server's own state.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import queue
import urllib.request
from functools import partial

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from conftest import shm_segments, start_server, wait_until
from models_python import io_config, python_model
from tritonclient.utils import InferenceServerException

# Each request carries DATA above half of the frontend's 64 MiB arena segment: an input
# block that is never freed makes the next pair of requests open a new segment.
DATA = 10 << 20            # FP32 elements (40 MiB)
WAIT_S = 30

GATE = '''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Logs each request it runs (calls), then holds while the file "hold" exists,
    polling is_cancelled() as Triton's execute_cancel model does: a request cancelled
    meanwhile is logged (cancelled) and answered with None."""

    def initialize(self, args):
        self.dir = args["model_repository"]

    def log(self, name, tag):
        with open(os.path.join(self.dir, name), "a") as f:
            f.write(f"{tag}\\n")

    def execute(self, requests):
        responses = []
        for request in requests:
            tag = int(pb_utils.get_input_tensor_by_name(request, "TAG").as_numpy()[0])
            self.log("calls", tag)
            while os.path.exists(os.path.join(self.dir, "hold")) and not request.is_cancelled():
                time.sleep(0.005)
            if request.is_cancelled():
                self.log("cancelled", tag)
                responses.append(None)
                continue
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([tag], dtype=np.int32))]))
        return responses
'''

TICKER = '''
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: a thread streams a response every 5 ms until its response sender says
    the request was cancelled, then logs how many it sent and ends the request with a
    CANCELLED error, as Triton's python_backend documentation shows."""

    def initialize(self, args):
        self.dir = args["model_repository"]

    def execute(self, requests):
        for request in requests:
            tag = int(pb_utils.get_input_tensor_by_name(request, "TAG").as_numpy()[0])
            threading.Thread(target=self.tick, args=(tag, request.get_response_sender()),
                             daemon=True).start()
        return None

    def tick(self, tag, sender):
        sent = 0
        while not sender.is_cancelled() and sent < 20000:
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([sent], dtype=np.int32))]))
            sent += 1
            time.sleep(0.005)
        with open(os.path.join(self.dir, "stopped"), "a") as f:
            f.write(f"{tag} {sent} {sender.is_cancelled()}\\n")
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "request cancelled", pb_utils.TritonError.CANCELLED)),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


@pytest.fixture(scope="module", params=["stream", "zmq"])
def srv(request, tmp_path_factory):
    """A server per transport: the cancel channel is a connection of each kind."""
    repo = tmp_path_factory.mktemp("cancel") / "models"
    python_model(repo, "gate", GATE, io_config(
        "gate", [("TAG", "TYPE_INT32", "[ 1 ]"), ("DATA", "TYPE_FP32", "[ -1 ]")],
        [("OUT", "TYPE_INT32", "[ 1 ]")]))
    python_model(repo, "ticker", TICKER, io_config(
        "ticker", [("TAG", "TYPE_INT32", "[ 1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    with start_server(repo, "--transport", request.param) as s:
        yield s


@pytest.fixture
def gate(srv):
    """The gate model's folder, held (its "hold" file exists) until the test ends."""
    d = srv.repo / "gate"
    for name in ("calls", "cancelled"):
        (d / name).unlink(missing_ok=True)
    (d / "hold").touch()
    yield d
    (d / "hold").unlink(missing_ok=True)


def logged(d, name: str) -> list[int]:
    p = d / name
    return [int(x) for x in p.read_text().split()] if p.exists() else []


def gate_inputs(tag: int, rows: int = DATA):
    tag_in = grpcclient.InferInput("TAG", [1], "INT32")
    tag_in.set_data_from_numpy(np.array([tag], dtype=np.int32))
    data = grpcclient.InferInput("DATA", [rows], "FP32")
    data.set_data_from_numpy(np.zeros(rows, dtype=np.float32))
    return [tag_in, data]


def metric(srv, family: str, model: str, reason: str = "") -> float:
    with urllib.request.urlopen(srv.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if (line.startswith(f'{family}{{model="{model}",')
                    and (not reason or f'reason="{reason}"' in line)):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def cancelled_count(srv, model: str) -> float:
    return metric(srv, "nv_inference_request_failure", model, "CANCELED")


def stats(client, model: str) -> dict:
    return client.get_inference_statistics(model, as_json=True)["model_stats"][0]


def count(st: dict, what: str) -> int:
    """A statistics count (protobuf JSON leaves zeros out)."""
    if what == "execution_count":
        return int(st.get(what, 0))
    return int(st["inference_stats"].get(what, {}).get("count", 0))


def frontend_segments(srv) -> list[str]:
    pids = set()
    for pid in srv.family():
        with contextlib.suppress(psutil.NoSuchProcess):
            if "trireme frontend" in " ".join(psutil.Process(pid).cmdline()):
                pids.add(pid)
    assert pids, "no frontend process"
    return sorted(shm_segments(pids))


class Calls:
    """async_infer callbacks, collected."""

    def __init__(self) -> None:
        self.results: queue.SimpleQueue = queue.SimpleQueue()

    def callback(self, tag, result, error):
        self.results.put((tag, result, error))

    def get(self):
        return self.results.get(timeout=WAIT_S)


def start(client, calls: Calls, tag: int):
    return client.async_infer("gate", gate_inputs(tag), partial(calls.callback, tag))


def test_queued_request_cancelled_never_runs_and_frees_its_input(srv, gate):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    before = stats(client, "gate")
    cancels = cancelled_count(srv, "gate")
    calls = Calls()
    start(client, calls, 1)
    wait_until(lambda: logged(gate, "calls") == [1], WAIT_S, "request 1 to run")
    queued = start(client, calls, 2)               # the only instance is busy: it waits
    wait_until(lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 1,
               WAIT_S, "request 2 to be queued")  # (the running one is not pending)
    queued.cancel()
    tag, result, error = calls.get()
    assert (tag, result) == (2, None) and error.status() == str(grpc.StatusCode.CANCELLED)
    wait_until(lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 0,
               WAIT_S, "the cancel to reach the server")   # (still queued: it will not run)
    (gate / "hold").unlink()
    assert calls.get()[0] == 1
    wait_until(lambda: cancelled_count(srv, "gate") == cancels + 1, WAIT_S,
               "the CANCELED failure metric")
    assert metric(srv, "nv_inference_pending_request_count", "gate") == 0
    # The next request runs; the cancelled one never did.
    out = client.infer("gate", gate_inputs(3)).as_numpy("OUT")
    assert out.tolist() == [3] and logged(gate, "calls") == [1, 3]
    after = stats(client, "gate")
    assert count(after, "execution_count") - count(before, "execution_count") == 2
    assert count(after, "fail") - count(before, "fail") == 1
    # Two requests at once fit the two segments the two held inputs opened: none leaked.
    segments = frontend_segments(srv)
    (gate / "hold").touch()
    for tag in (4, 5):
        start(client, calls, tag)
    wait_until(lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 1,
               WAIT_S, "two requests held (one running, one queued)")
    assert frontend_segments(srv) == segments
    (gate / "hold").unlink()
    assert sorted(calls.get()[0] for _ in range(2)) == [4, 5]
    client.close()


def test_many_queued_requests_cancelled_at_once(srv, gate):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    cancels = cancelled_count(srv, "gate")
    calls = Calls()
    client.async_infer("gate", gate_inputs(1, rows=4), partial(calls.callback, 1))
    wait_until(lambda: logged(gate, "calls") == [1], WAIT_S, "request 1 to run")
    queued = [client.async_infer("gate", gate_inputs(tag, rows=4), partial(calls.callback, tag))
              for tag in range(100, 140)]
    wait_until(lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 40,
               WAIT_S, "40 requests to be queued")
    for q in queued:
        q.cancel()
    wait_until(lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 0,
               WAIT_S, "the cancel to reach the server")   # (still queued: it will not run)
    (gate / "hold").unlink()
    assert sorted(calls.get()[0] for _ in range(41)) == [1, *range(100, 140)]
    wait_until(lambda: cancelled_count(srv, "gate") == cancels + 40, WAIT_S,
               "40 CANCELED failures")
    assert client.infer("gate", gate_inputs(2, rows=4)).as_numpy("OUT").tolist() == [2]
    assert logged(gate, "calls") == [1, 2]
    client.close()


def test_client_timeout_cancels_a_queued_request(srv, gate):
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    cancels = cancelled_count(srv, "gate")
    calls = Calls()
    start(client, calls, 1)
    wait_until(lambda: logged(gate, "calls") == [1], WAIT_S, "request 1 to run")
    with pytest.raises(InferenceServerException) as e:
        client.infer("gate", gate_inputs(2, rows=4), client_timeout=1.0)
    assert e.value.status() == str(grpc.StatusCode.DEADLINE_EXCEEDED)
    wait_until(lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 0,
               WAIT_S, "the cancel to reach the server")   # (still queued: it will not run)
    (gate / "hold").unlink()
    assert calls.get()[0] == 1
    wait_until(lambda: cancelled_count(srv, "gate") == cancels + 1, WAIT_S,
               "the CANCELED failure metric")
    assert client.infer("gate", gate_inputs(3, rows=4)).as_numpy("OUT").tolist() == [3]
    assert logged(gate, "calls") == [1, 3]
    client.close()


def test_cancel_reaches_a_running_sync_execute(srv, gate):
    """The worker's main thread is inside execute(); the cancel still gets through."""
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    executions = count(stats(client, "gate"), "execution_count")
    calls = Calls()
    running = start(client, calls, 7)
    wait_until(lambda: logged(gate, "calls") == [7], WAIT_S, "request 7 to run")
    running.cancel()
    assert calls.get()[0] == 7
    wait_until(lambda: logged(gate, "cancelled") == [7], WAIT_S,
               "the model to see is_cancelled()")
    assert (gate / "hold").exists()                # it stopped early, not released
    wait_until(lambda: count(stats(client, "gate"), "execution_count") == executions + 1,
               WAIT_S, "the request to finish")
    (gate / "hold").unlink()
    assert client.infer("gate", gate_inputs(8, rows=4)).as_numpy("OUT").tolist() == [8]
    client.close()


def test_aio_task_cancel_cancels_a_queued_request(srv, gate):
    import asyncio

    import tritonclient.grpc.aio as aioclient

    cancels = cancelled_count(srv, "gate")

    async def run():
        client = aioclient.InferenceServerClient(srv.grpc_url)
        first = asyncio.ensure_future(client.infer("gate", gate_inputs(1, rows=4)))
        await asyncio.to_thread(wait_until, lambda: logged(gate, "calls") == [1], WAIT_S,
                                "request 1 to run")
        queued = asyncio.ensure_future(client.infer("gate", gate_inputs(2, rows=4)))
        await asyncio.to_thread(
            wait_until, lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 1,
            WAIT_S, "request 2 to be queued")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        await asyncio.to_thread(
            wait_until, lambda: metric(srv, "nv_inference_pending_request_count", "gate") == 0,
            WAIT_S, "the cancel to reach the server")
        (gate / "hold").unlink()
        assert (await first).as_numpy("OUT").tolist() == [1]
        await asyncio.to_thread(wait_until, lambda: cancelled_count(srv, "gate") == cancels + 1,
                                WAIT_S, "the CANCELED failure metric")
        await client.close()

    asyncio.run(run())
    assert logged(gate, "calls") == [1]


def test_http_client_disconnect_cancels_a_running_request(srv, gate):
    """Triton's http_cancellation_test: the client closes its connection mid-request."""
    conn = http.client.HTTPConnection(srv.http_url.split(":")[0], srv.http_port, timeout=WAIT_S)
    body = json.dumps({"inputs": [
        {"name": "TAG", "shape": [1], "datatype": "INT32", "data": [11]},
        {"name": "DATA", "shape": [4], "datatype": "FP32", "data": [0, 0, 0, 0]}]})
    conn.request("POST", "/v2/models/gate/infer", body=body,
                 headers={"Content-Type": "application/json"})
    wait_until(lambda: logged(gate, "calls") == [11], WAIT_S, "request 11 to run")
    conn.close()
    wait_until(lambda: logged(gate, "cancelled") == [11], WAIT_S,
               "the model to see is_cancelled()")


def stream_ticker(client, tag: int, responses: int) -> None:
    """Start a stream, take ``responses`` responses, then cancel the stream."""
    got: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inp = grpcclient.InferInput("TAG", [1], "INT32")
    inp.set_data_from_numpy(np.array([tag], dtype=np.int32))
    client.async_stream_infer("ticker", [inp])
    for _ in range(responses):
        result, error = got.get(timeout=WAIT_S)
        assert error is None
    client.stop_stream(cancel_requests=True)


def test_decoupled_model_stops_when_its_stream_is_cancelled(srv):
    d = srv.repo / "ticker"
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    for n, tag in enumerate((9, 10), 1):           # and the next stream works as well
        stream_ticker(client, tag, 3)
        wait_until(lambda n=n: len((d / "stopped").read_text().splitlines()) == n
                   if (d / "stopped").exists() else False, WAIT_S, f"stream {tag} to stop")
        logged_tag, sent, cancelled = (d / "stopped").read_text().splitlines()[-1].split()
        assert (logged_tag, cancelled) == (str(tag), "True") and 3 <= int(sent) < 20000
    client.close()


def test_server_log_is_clean(srv):
    log = srv.log()
    assert "Traceback" not in log, log[-4000:]
