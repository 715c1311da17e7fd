"""Dynamic batching end to end: batches seen through the statistics extension, Triton's
TRITONSERVER_DELAY_SCHEDULER hook, priorities, queue policies and preserve_ordering.

Two servers: one started with TRITONSERVER_DELAY_SCHEDULER=4 (every model's batcher holds
its first requests until four are queued, so batch formation does not depend on how the
client threads race), one without it for the queue-policy and ordering tests.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server, wait_until

ONE_CPU = ('instance_group [{ kind: KIND_CPU, count: 1 }]\n'
           'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n')
SLOW_WIDTH = 512
SLOW_LAYERS = 1200  # width 512: about 25 ms for 1 row and 0.4 s for 64 rows on one thread


def slow_model(root, name: str, config: str, width: int = SLOW_WIDTH, count: int = 1,
               max_batch_size: int = 64) -> None:
    models.slow(root / name, width, layers=SLOW_LAYERS)
    models.write_config(root / name, (
        f'max_batch_size: {max_batch_size}\n{config}\n'
        f'instance_group [{{ kind: KIND_CPU, count: {count} }}]\n'
        'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
        f'input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [{width}] }}]\n'
        f'output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [{width}] }}]\n'))


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching") / "models"
    for name, preferred in (("pref4", "[4]"), ("pref2", "[2]")):
        models.add_sub(root / name)
        models.write_config(root / name, f"max_batch_size: 8\n{ONE_CPU}"
                            f"dynamic_batching {{ preferred_batch_size: {preferred} }}\n")
    models.identity(root / "shapes", "fp32")
    models.write_config(root / "shapes", f"max_batch_size: 8\n{ONE_CPU}dynamic_batching {{ }}\n")
    slow_model(root, "prio", "dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
               max_batch_size=1)
    models.lookup(root / "lookup")
    models.write_config(root / "lookup", f"max_batch_size: 8\n{ONE_CPU}dynamic_batching {{ }}\n")
    with start_server(root, env={"TRITONSERVER_DELAY_SCHEDULER": "4"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies") / "models"
    slow_model(root, "full", "dynamic_batching { default_queue_policy { max_queue_size: 2 } }")
    slow_model(root, "expiring", "dynamic_batching { default_queue_policy { "
                                 "default_timeout_microseconds: 50000 } }")
    slow_model(root, "override", "dynamic_batching { default_queue_policy { "
                                 "default_timeout_microseconds: 60000000 allow_timeout_override: true } }")
    slow_model(root, "ordered", "dynamic_batching { preserve_ordering: true }", width=256, count=2)
    slow_model(root, "unordered", "dynamic_batching { }", width=256, count=2)
    with start_server(root) as srv:
        yield srv


def stats(srv, model: str) -> dict:
    c = httpclient.InferenceServerClient(srv.http_url)
    try:
        return c.get_inference_statistics(model)["model_stats"][0]
    finally:
        c.close()


def batch_counts(st: dict) -> dict[int, int]:
    return {b["batch_size"]: int(b["compute_infer"]["count"]) for b in st.get("batch_stats", [])}


def assert_batches(srv, model: str, want: dict[int, int]) -> None:
    """A worker answers the requests before it reports the batch to the scheduler (as
    Triton's backends do), so a client can see its response a moment before the batch
    shows in the statistics: wait for it."""
    try:
        wait_until(lambda: batch_counts(stats(srv, model)) == want, 10, f"batches {want}")
    except TimeoutError:
        assert batch_counts(stats(srv, model)) == want


def add_sub_inputs(i: int):
    a = np.full((1, 16), i, np.float32)
    b = np.ones((1, 16), np.float32)
    ins = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    return ins, a + b


def infer_add_sub(srv, model: str, i: int) -> None:
    c = httpclient.InferenceServerClient(srv.http_url, network_timeout=60)
    try:
        ins, want = add_sub_inputs(i)
        np.testing.assert_array_equal(c.infer(model, ins).as_numpy("OUTPUT0"), want)
    finally:
        c.close()


def metric(srv, family: str, model: str) -> float:
    with urllib.request.urlopen(srv.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'{family}{{model="{model}",'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def slow_infer(srv, model: str, rows: int, width: int = SLOW_WIDTH, **kw) -> float:
    """One request of `rows` rows; returns the monotonic time its response arrived."""
    c = httpclient.InferenceServerClient(srv.http_url, network_timeout=60)
    try:
        x = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
        inp = httpclient.InferInput("INPUT0", [rows, width], "FP32")
        inp.set_data_from_numpy(x)
        out = c.infer(model, [inp], **kw).as_numpy("OUTPUT0")
        done = time.monotonic()
        np.testing.assert_array_equal(out, x)
        return done
    finally:
        c.close()


# ---------------------------------------------------------------- batch formation
@pytest.mark.parametrize("model,want", [("pref4", {4: 1}), ("pref2", {2: 2})])
def test_delay_hook_forms_preferred_batches(hooked, model, want):
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: infer_add_sub(hooked, model, i), range(4)))
    st = stats(hooked, model)
    assert st["inference_count"] == 4
    assert st["execution_count"] == sum(want.values())
    assert batch_counts(st) == want
    s = st["inference_stats"]
    assert s["success"]["count"] == 4 and s["queue"]["count"] == 4
    assert int(s["compute_infer"]["ns"]) > 0 and int(s["queue"]["ns"]) > 0
    # The same figures on /metrics, plus the executed batch-size histogram.
    assert metric(hooked, "nv_inference_exec_count", model) == sum(want.values())
    assert metric(hooked, "nv_inference_batch_size_count", model) == sum(want.values())
    assert metric(hooked, "nv_inference_batch_size_sum", model) == 4


def test_different_shapes_are_not_batched_together(hooked):
    """Requests arrive in order over one gRPC stream: [3], [3], [5], [5] -> two batches of 2."""
    c = grpcclient.InferenceServerClient(hooked.grpc_url)
    c.get_model_metadata("shapes")    # the frontend caches the model before the stream starts
    results = []
    c.start_stream(callback=lambda result, error: results.append((result, error)))
    sent = []
    for i, n in enumerate([3, 3, 5, 5]):
        x = np.full((1, n), i, np.float32)
        inp = grpcclient.InferInput("INPUT0", [1, n], "FP32")
        inp.set_data_from_numpy(x)
        c.async_stream_infer("shapes", [inp], request_id=str(i))
        sent.append(x)
    wait_until(lambda: len(results) == 4, 30, "4 stream responses")
    c.stop_stream()
    c.close()
    for r, e in results:
        assert e is None, e
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), sent[int(r.get_response().id)])
    assert_batches(hooked, "shapes", {2: 2})


def test_higher_priority_runs_first(hooked):
    """Four requests held by the hook: the one with priority 1 (default level is 2) runs
    before the three queued ahead of it; one request per execution (max_batch_size 1)."""
    with cf.ThreadPoolExecutor(4) as pool:
        low = [pool.submit(slow_infer, hooked, "prio", 1) for _ in range(3)]
        wait_until(lambda: metric(hooked, "nv_inference_pending_request_count", "prio") == 3,
                   30, "three queued requests")
        high = pool.submit(slow_infer, hooked, "prio", 1, priority=1)
        done_high = high.result()
        assert all(f.result() > done_high for f in low)
    assert_batches(hooked, "prio", {1: 4})


def lookup_infer(srv, index: int) -> np.ndarray:
    c = httpclient.InferenceServerClient(srv.http_url, network_timeout=60)
    try:
        inp = httpclient.InferInput("INDEX", [1, 1], "INT64")
        inp.set_data_from_numpy(np.array([[index]], np.int64))
        return c.infer("lookup", [inp]).as_numpy("OUTPUT0")
    finally:
        c.close()


def test_execution_error_fails_its_batch_only(hooked):
    """The hook gathers four requests into one batch; one index is outside the table, so the
    run fails: all four get that error (once each), and the next batch is served."""
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(lookup_infer, hooked, i) for i in (0, 1, 2, 99)]
        errors = []
        for f in futures:
            with pytest.raises(InferenceServerException) as e:
                f.result()
            errors.append(e.value)
    assert {e.status() for e in errors} == {"500"}
    # The backend's own error, the same for every request of the failed batch.
    assert len({e.message() for e in errors}) == 1
    assert "idx=99" in errors[0].message(), errors[0].message()
    np.testing.assert_array_equal(lookup_infer(hooked, 3), [[3.0]])
    st = stats(hooked, "lookup")
    assert st["inference_stats"]["fail"]["count"] == 4
    assert st["inference_stats"]["success"]["count"] == 1
    assert batch_counts(st) == {4: 1, 1: 1}
    assert metric(hooked, "nv_inference_request_success", "lookup") == 1
    with urllib.request.urlopen(hooked.metrics_url, timeout=5) as r:
        text = r.read().decode()
    assert 'nv_inference_request_failure{model="lookup",version="1",reason="BACKEND"} 4' in text


# ---------------------------------------------------------------- queue policies
def test_full_queue_rejects_with_503(plain):
    with cf.ThreadPoolExecutor(3) as pool:
        running = pool.submit(slow_infer, plain, "full", 64)
        wait_until(lambda: metric(plain, "nv_inference_pending_request_count", "full") == 1,
                   30, "the first request to run")
        queued = [pool.submit(slow_infer, plain, "full", 1) for _ in range(2)]
        wait_until(lambda: metric(plain, "nv_inference_pending_request_count", "full") == 3,
                   30, "two queued requests")
        c = httpclient.InferenceServerClient(plain.http_url)
        inp = httpclient.InferInput("INPUT0", [1, SLOW_WIDTH], "FP32")
        inp.set_data_from_numpy(np.zeros((1, SLOW_WIDTH), np.float32))
        with pytest.raises(InferenceServerException) as e:
            c.infer("full", [inp])
        assert e.value.status() == "503"
        assert e.value.message() == "Exceeds maximum queue size"
        c.close()
        running.result()
        [f.result() for f in queued]      # nothing else was lost
    # A worker answers the client before it reports the batch to the scheduler.
    wait_until(lambda: stats(plain, "full")["inference_stats"]["success"]["count"] == 3, 10,
               "the statistics of the three executed requests")
    st = stats(plain, "full")
    assert st["inference_stats"]["fail"]["count"] == 1
    assert st["inference_stats"]["success"]["count"] == 3
    assert metric(plain, "nv_inference_pending_request_count", "full") == 0


def test_request_that_waits_past_its_timeout_is_rejected(plain):
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(slow_infer, plain, "expiring", 64)   # ~0.4 s
        wait_until(lambda: metric(plain, "nv_inference_pending_request_count", "expiring") == 1,
                   30, "the first request to run")
        late = pool.submit(slow_infer, plain, "expiring", 1)      # 50 ms default timeout
        running.result()
        with pytest.raises(InferenceServerException) as e:
            late.result()
    assert e.value.status() == "503"
    assert e.value.message() == "Request timeout expired"
    assert metric(plain, "nv_inference_request_failure", "expiring") >= 0
    assert stats(plain, "expiring")["inference_stats"]["fail"]["count"] == 1


def test_request_timeout_can_only_shorten_the_default(plain):
    with cf.ThreadPoolExecutor(3) as pool:
        running = pool.submit(slow_infer, plain, "override", 64)
        wait_until(lambda: metric(plain, "nv_inference_pending_request_count", "override") == 1,
                   30, "the first request to run")
        short = pool.submit(slow_infer, plain, "override", 1, timeout=20000)     # 20 ms
        patient = pool.submit(slow_infer, plain, "override", 1)
        running.result()
        patient.result()
        with pytest.raises(InferenceServerException, match="Request timeout expired"):
            short.result()


# ---------------------------------------------------------------- ordering
@pytest.mark.parametrize("model,ordered", [("ordered", True), ("unordered", False)])
def test_preserve_ordering_holds_later_responses(plain, model, ordered):
    """Two instances: a 64-row request (~0.1 s), then a 1-row one (~2 ms) on the other
    instance. Without preserve_ordering the small response arrives long before the big one;
    with it, the small response is held and both leave together (the two client threads
    may then see them in either order, so the check is on the gap, not the order)."""
    with cf.ThreadPoolExecutor(2) as pool:
        big = pool.submit(slow_infer, plain, model, 64, 256)
        wait_until(lambda: metric(plain, "nv_inference_pending_request_count", model) == 1,
                   30, "the big request to run")
        small = pool.submit(slow_infer, plain, model, 1, 256)
        t_big, t_small = big.result(), small.result()
    early = t_big - t_small       # how long before the big response the small one arrived
    if ordered:
        assert early < 0.03, early
    else:
        assert early > 0.03, early
    assert_batches(plain, model, {1: 1, 64: 1})
