"""Sequence batching end to end: Triton's four sequence example clients (the requests they
send and the values they check, over HTTP, gRPC, a gRPC stream and a grpc.aio stream) on
Triton's simple_sequence / simple_dyna_sequence rebuilt here, implicit state, a Python
sequence model, Triton's checks, the backlog and idle expiry."""
from __future__ import annotations

import asyncio
import queue
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from models_sequence import accumulate_state, python_accumulate, simple_dyna_sequence, simple_sequence
from tritonclient.utils import InferenceServerException

VALUES = [11, 7, 5, 3, 2, 0, 1]          # the example clients' values


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("sequence") / "models"
    simple_sequence(repo / "simple_sequence")
    simple_dyna_sequence(repo / "simple_dyna_sequence")
    accumulate_state(repo / "accumulate")
    accumulate_state(repo / "one_slot", slots=1)
    accumulate_state(repo / "short_idle", idle_us=200_000)
    python_accumulate(repo)
    with start_server(repo) as srv:
        yield srv


def _inputs(mod, value: int, batched: bool = True):
    data = np.full([1, 1] if batched else [1], value, dtype=np.int32)
    inp = mod.InferInput("INPUT", list(data.shape), "INT32")
    inp.set_data_from_numpy(data)
    return [inp]


def _sync_sequence(client, mod, model: str, seq_id, values: list[int]) -> list[int]:
    """What simple_{http,grpc}_sequence_sync_infer_client's sync_send does."""
    out = []
    for i, v in enumerate(values):
        r = client.infer(model, _inputs(mod, v), outputs=[mod.InferRequestedOutput("OUTPUT")],
                         sequence_id=seq_id, sequence_start=i == 0,
                         sequence_end=i == len(values) - 1)
        out.append(int(r.as_numpy("OUTPUT")[0][0]))
    return out


def _expected(model: str) -> tuple[list[int], list[int], list[int]]:
    """The example clients' checks for their three sequences (non-dyna: simple_sequence)."""
    assert model == "simple_sequence"
    return ([1] + VALUES, [101] + [-v for v in VALUES], [21] + [-v for v in VALUES])


@pytest.mark.parametrize("mod,port", [(httpclient, "http_url"), (grpcclient, "grpc_url")])
def test_example_sync_clients(server, mod, port):
    client = mod.InferenceServerClient(getattr(server, port))
    got = (_sync_sequence(client, mod, "simple_sequence", 1000, [0] + VALUES),
           _sync_sequence(client, mod, "simple_sequence", 1001, [100] + [-v for v in VALUES]),
           _sync_sequence(client, mod, "simple_sequence", str(uuid.uuid4()),
                          [20] + [-v for v in VALUES]))
    assert got == _expected("simple_sequence")


def _stream_requests(seq_ids) -> list[tuple]:
    """The example stream clients' requests: three whole sequences, one after another."""
    reqs = []
    for seq_id, values in zip(seq_ids, ([0] + VALUES, [100] + [-v for v in VALUES],
                                        [20] + [-v for v in VALUES])):
        for i, v in enumerate(values):
            reqs.append((seq_id, i, v, len(values)))
    return reqs


def _by_sequence(pairs, seq_ids) -> tuple[list[int], ...]:
    out: dict[str, list[int]] = {str(s): [] for s in seq_ids}
    for rid, value in pairs:
        out[rid.split("_")[0]].append(value)
    return tuple(out[str(s)] for s in seq_ids)


def test_example_stream_client(server):
    seq_ids = (2000, 2001, str(uuid.uuid4()))
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for seq_id, i, v, n in _stream_requests(seq_ids):
            client.async_stream_infer("simple_sequence", _inputs(grpcclient, v),
                                      outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                                      request_id=f"{seq_id}_{i + 1}", sequence_id=seq_id,
                                      sequence_start=i == 0, sequence_end=i == n - 1)
        results = [got.get(timeout=30) for _ in range(3 * (len(VALUES) + 1))]
    finally:
        client.stop_stream()
    assert [e for _, e in results if e is not None] == []
    pairs = [(r.get_response().id, int(r.as_numpy("OUTPUT")[0][0])) for r, _ in results]
    assert _by_sequence(pairs, seq_ids) == _expected("simple_sequence")
    # Triton marks every stream response, asked or not (its backpressure QA test relies on it)
    assert all(r.get_response().parameters["triton_final_response"].bool_param for r, _ in results)


def test_example_aio_stream_client(server):
    seq_ids = (3000, 3001, str(uuid.uuid4()))

    async def run():
        async with aioclient.InferenceServerClient(server.grpc_url) as client:
            async def requests():
                for seq_id, i, v, n in _stream_requests(seq_ids):
                    yield {"model_name": "simple_sequence", "inputs": _inputs(aioclient, v),
                           "outputs": [aioclient.InferRequestedOutput("OUTPUT")],
                           "request_id": f"{seq_id}_{i + 1}", "sequence_id": seq_id,
                           "sequence_start": i == 0, "sequence_end": i == n - 1}
            pairs = []
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                pairs.append((result.get_response().id, int(result.as_numpy("OUTPUT")[0][0])))
                if len(pairs) == 3 * (len(VALUES) + 1):
                    break
            return pairs

    assert _by_sequence(asyncio.run(run()), seq_ids) == _expected("simple_sequence")


def test_dyna_sequence_sees_end_and_corrid(server):
    """simple_dyna_sequence: OUTPUT = INPUT + START + END * CORRID (oldest strategy)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = _sync_sequence(client, grpcclient, "simple_dyna_sequence", 4000, [0] + VALUES)
    assert got == [1] + VALUES[:-1] + [VALUES[-1] + 4000]


def test_implicit_state_accumulates_per_sequence_interleaved(server):
    client = httpclient.InferenceServerClient(server.http_url)

    def step(seq_id, v, start=False, end=False):
        r = client.infer("accumulate", _inputs(httpclient, v), sequence_id=seq_id,
                         sequence_start=start, sequence_end=end)
        return int(r.as_numpy("OUTPUT")[0][0])

    assert [step(1, 1, start=True), step(2, 10, start=True), step(1, 2), step(2, 20),
            step(1, 3, end=True), step(2, 30, end=True)] == [1, 10, 3, 30, 6, 60]
    assert step(1, 5, start=True, end=True) == 5      # a new sequence starts from zero


def test_python_sequence_model_with_string_ids_over_a_stream(server):
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for i in range(20):                            # pipelined: order must hold
            for seq in ("alpha", "beta"):
                client.async_stream_infer("py_accumulate", _inputs(grpcclient, i + 1, batched=False),
                                          request_id=f"{seq}_{i}", sequence_id=seq,
                                          sequence_start=i == 0, sequence_end=i == 19)
        results = [got.get(timeout=30) for _ in range(40)]
    finally:
        client.stop_stream()
    sums: dict[str, list[int]] = {"alpha": [], "beta": []}
    for r, e in results:
        assert e is None, e.message()
        sums[r.get_response().id.split("_")[0]].append(int(r.as_numpy("OUTPUT")[0]))
    expected = [sum(range(1, n + 2)) for n in range(20)]
    assert sums == {"alpha": expected, "beta": expected}


def test_triton_checks(server):
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple_sequence", _inputs(httpclient, 1))
    assert e.value.status() == "400"
    assert e.value.message() == ("inference request to model 'simple_sequence' must specify a "
                                 "non-zero or non-empty correlation ID")
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple_sequence", _inputs(httpclient, 1), sequence_id=77)
    assert e.value.message() == ("inference request for sequence 77 to model 'simple_sequence' "
                                 "must specify the START flag on the first request of the sequence")
    grpc_client = grpcclient.InferenceServerClient(server.grpc_url)
    two = np.zeros([2, 1], np.int32)
    inp = grpcclient.InferInput("INPUT", [2, 1], "INT32")
    inp.set_data_from_numpy(two)
    with pytest.raises(InferenceServerException) as e:
        grpc_client.infer("simple_sequence", [inp], sequence_id=78, sequence_start=True)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == ("inference request to model 'simple_sequence' must specify "
                                 "batch-size 1 due to requirements of sequence batcher")


def test_backlog_runs_a_sequence_once_a_slot_is_free(server):
    """one_slot has one slot: a second sequence waits (its request pending) until the
    first one's END has run."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.infer("one_slot", _inputs(grpcclient, 1), sequence_id=50, sequence_start=True)
    done: queue.Queue = queue.Queue()
    client.async_infer("one_slot", _inputs(grpcclient, 7), lambda result, error: done.put((result, error)),
                       sequence_id=51, sequence_start=True)
    stats = httpclient.InferenceServerClient(server.http_url)
    wait_until(lambda: b'nv_inference_pending_request_count{model="one_slot",version="1"} 1'
               in _metrics(server), 30, "sequence 51 to wait in the backlog")
    assert done.empty()
    r = client.infer("one_slot", _inputs(grpcclient, 2), sequence_id=50, sequence_end=True)
    assert int(r.as_numpy("OUTPUT")[0][0]) == 3
    result, error = done.get(timeout=30)
    assert error is None and int(result.as_numpy("OUTPUT")[0][0]) == 7
    stats.close()


def _metrics(server) -> bytes:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        return r.read()


def test_idle_sequence_is_released(server):
    """short_idle: max_sequence_idle_microseconds 200 ms; once released, a request that
    continues the sequence is refused as one without START."""
    client = httpclient.InferenceServerClient(server.http_url)
    client.infer("short_idle", _inputs(httpclient, 1), sequence_id=60, sequence_start=True)

    def released() -> bool:
        try:
            client.infer("short_idle", _inputs(httpclient, 1), sequence_id=61, sequence_start=True,
                         sequence_end=True)
            client.infer("short_idle", _inputs(httpclient, 0), sequence_id=60)
            return False
        except InferenceServerException as e:
            assert "must specify the START flag" in e.message(), e.message()
            return True

    # Until it is released a continuation succeeds (and keeps it alive); poll less often
    # than the idle time so that it can expire.
    wait_until(released, 30, "the idle sequence to be released", interval=0.5)


def test_server_metadata_lists_the_sequence_extension(server):
    meta = httpclient.InferenceServerClient(server.http_url).get_server_metadata()
    assert "sequence" in meta["extensions"]
