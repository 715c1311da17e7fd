"""Dynamic batching end to end: batches seen through the statistics extension, Triton's
TRITONSERVER_DELAY_SCHEDULER hook, priorities, queue policies and preserve_ordering.

Two servers: one started with TRITONSERVER_DELAY_SCHEDULER=4 (every model's batcher holds
its first requests until four are queued, so batch formation and order do not depend on how
the client threads race), one without it for the queue-policy tests.
nv_inference_pending_request_count counts requests waiting to execute, not running ones.
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
    slow_model(root, "waiting", "dynamic_batching { }")
    slow_model(root, "ordered", "dynamic_batching { preserve_ordering: true }", width=256, count=2)
    slow_model(root, "unordered", "dynamic_batching { }", width=256, count=2)
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


def slow_infer(srv, model: str, rows: int, width: int = SLOW_WIDTH, protocol: str = "http",
               **kw) -> float:
    """One request of `rows` rows; returns the monotonic time its response arrived."""
    lib = httpclient if protocol == "http" else grpcclient
    url = srv.http_url if protocol == "http" else srv.grpc_url
    c = lib.InferenceServerClient(url, **({"network_timeout": 60} if protocol == "http" else {}))
    try:
        x = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
        inp = lib.InferInput("INPUT0", [rows, width], "FP32")
        inp.set_data_from_numpy(x)
        out = c.infer(model, [inp], **kw).as_numpy("OUTPUT0")
        done = time.monotonic()
        np.testing.assert_array_equal(out, x)
        return done
    finally:
        c.close()


def pending(srv, model: str) -> float:
    return metric(srv, "nv_inference_pending_request_count", model)


def wait_pending(srv, model: str, n: int, what: str) -> None:
    wait_until(lambda: pending(srv, model) == n, 30, what, interval=0.01)


def errors_of(futures) -> list[InferenceServerException]:
    """The exceptions the futures raised (InferenceServerException only)."""
    out = []
    for f in futures:
        try:
            f.result()
        except InferenceServerException as e:
            out.append(e)
    return out


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
# One instance, 64-row requests of ~0.4 s each: whichever of two arrives first runs, the
# other waits (nv_inference_pending_request_count counts waiting requests, not running ones).
def reject_one(srv, model: str, protocol: str, request_id: str = "") -> InferenceServerException:
    lib = httpclient if protocol == "http" else grpcclient
    c = lib.InferenceServerClient(srv.http_url if protocol == "http" else srv.grpc_url)
    inp = lib.InferInput("INPUT0", [1, SLOW_WIDTH], "FP32")
    inp.set_data_from_numpy(np.zeros((1, SLOW_WIDTH), np.float32))
    try:
        with pytest.raises(InferenceServerException) as e:
            c.infer("full", [inp], request_id=request_id)
        return e.value
    finally:
        c.close()


def test_full_queue_rejects_with_503(plain):
    """max_queue_size 2: one request runs, two wait; the next ones are refused at once, the
    message prefixed with the request's id when it has one (Triton's LogRequest())."""
    with cf.ThreadPoolExecutor(7) as pool:
        first = [pool.submit(slow_infer, plain, "full", 64) for _ in range(2)]
        wait_pending(plain, "full", 1, "one request running, one queued")
        last = pool.submit(slow_infer, plain, "full", 64)
        wait_pending(plain, "full", 2, "a full queue")
        # All four at once, while the running request still has most of its ~0.4 s to go.
        cases = [("http", ""), ("http", "abc"), ("grpc", ""), ("grpc", "id-7")]
        errors = list(pool.map(lambda case: reject_one(plain, "full", *case), cases))
        [f.result() for f in first + [last]]      # nothing else was lost
    assert [e.status() for e in errors] == ["503", "503", "StatusCode.UNAVAILABLE",
                                            "StatusCode.UNAVAILABLE"]
    assert [e.message() for e in errors] == [
        "Exceeds maximum queue size", "[request id: abc] Exceeds maximum queue size",
        "Exceeds maximum queue size", "[request id: id-7] Exceeds maximum queue size"]
    # A worker answers the client before it reports the batch to the scheduler.
    wait_until(lambda: stats(plain, "full")["inference_stats"]["success"]["count"] == 3, 10,
               "the statistics of the three executed requests")
    st = stats(plain, "full")
    assert st["inference_stats"]["fail"]["count"] == 4
    assert st["inference_stats"]["success"]["count"] == 3
    assert pending(plain, "full") == 0


def test_request_that_waits_past_its_timeout_is_rejected(plain):
    """Default timeout 50 ms: of two ~0.4 s requests, the one that waits is rejected. Triton
    does not prefix this error with the request id (a static Status in its batcher)."""
    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(slow_infer, plain, "expiring", 64, request_id="t-http"),
                   pool.submit(slow_infer, plain, "expiring", 64, protocol="grpc",
                               request_id="t-grpc")]
        errors = errors_of(futures)
    assert len(errors) == 1
    assert errors[0].status() in ("503", "StatusCode.UNAVAILABLE")
    assert errors[0].message() == "Request timeout expired"
    assert metric(plain, "nv_inference_request_failure", "expiring") >= 0
    assert stats(plain, "expiring")["inference_stats"]["fail"]["count"] == 1


def test_request_timeout_can_only_shorten_the_default(plain):
    """Default timeout 60 s, overridable: two requests asking for 20 ms and one asking for
    nothing. Whichever runs first, a 20 ms one waits past its timeout; the patient one
    always runs."""
    with cf.ThreadPoolExecutor(3) as pool:
        short = [pool.submit(slow_infer, plain, "override", 64, timeout=20000) for _ in range(2)]
        patient = pool.submit(slow_infer, plain, "override", 64)
        patient.result()
        errors = errors_of(short)
    assert errors and all(e.message() == "Request timeout expired" for e in errors)


# ---------------------------------------------------------------- pending request count
def test_pending_request_count_counts_waiting_not_running(hooked):
    """Triton's nv_inference_pending_request_count: up when a request is queued, down when
    an instance starts executing it. The hook holds three; the fourth releases all four as
    one ~0.4 s batch, during which the gauge is already 0."""
    with cf.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(slow_infer, hooked, "waiting", 16) for _ in range(3)]
        wait_pending(hooked, "waiting", 3, "three held requests")
        held.append(pool.submit(slow_infer, hooked, "waiting", 16))
        wait_pending(hooked, "waiting", 0, "the batch to start")
        executed_while_zero = metric(hooked, "nv_inference_exec_count", "waiting")
        [f.result() for f in held]
    assert executed_while_zero == 0               # the batch was still running
    assert_batches(hooked, "waiting", {64: 1})
    assert pending(hooked, "waiting") == 0


# ---------------------------------------------------------------- ordering
@pytest.mark.parametrize("model,ordered", [("ordered", True), ("unordered", False)])
def test_preserve_ordering_holds_later_responses(hooked, model, ordered):
    """Two instances; the hook queues a 64-row request (~0.1 s), then three 1-row ones, in
    that order, and releases them together: the big one runs on one instance, the three
    small ones as a batch of 3 (~2 ms) on the other. Without preserve_ordering the small
    responses arrive long before the big one; with it, they are held until it is sent."""
    with cf.ThreadPoolExecutor(4) as pool:
        big = pool.submit(slow_infer, hooked, model, 64, 256)
        wait_pending(hooked, model, 1, "the big request to be queued")
        small = [pool.submit(slow_infer, hooked, model, 1, 256)]
        wait_pending(hooked, model, 2, "a small request to be queued after it")
        small += [pool.submit(slow_infer, hooked, model, 1, 256) for _ in range(2)]
        t_big, t_small = big.result(), max(f.result() for f in small)
    early = t_big - t_small       # how long before the big response the small ones arrived
    if ordered:
        assert early < 0.03, early
    else:
        assert early > 0.03, early
    assert_batches(hooked, model, {64: 1, 3: 1})
