"""The response cache (--cache-config local,size=N), as a Triton user sees it: a model whose
config enables it answers a request it answered before without executing, counts it as
Triton does (statistics cache_hit / cache_miss, the nv_cache_* metrics), never keeps an
error, keys on shapes and requested outputs too, shares its entries between frontends,
evicts the least recently used entry when full, and refuses bad flags with Triton's texts.

Servers on one repository (explicit model control):
  cached   --cache-config local,size=1048576, two frontends
  tiny     --cache-config local,size=300: one add_sub entry fits, two do not
  none     no cache: a model that enables it is served uncached
Models (Python, one CPU instance each):
  add_sub   Triton's example, FP32 [4], response_cache enabled
  plain     add_sub without the cache
  matrix    OUT = 2 * IN, FP32 [-1, -1], response_cache enabled
  failer    raises in execute(), response_cache enabled
  scale     OUT = 2 * IN, FP32 [4]
  ens       ensemble add_sub -> scale, response_cache enabled on the ensemble only
"""
from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, start_server, wait_until
from tritonclient.utils import InferenceServerException

from tests.models_python import ADD_SUB, SCALE, io_config, python_model

CACHED = "response_cache { enable: true }"
F4 = ("TYPE_FP32", "[ 4 ]")

FAILER = '''
class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("this model always fails")
'''

ENSEMBLE = '''name: "ens"
platform: "ensemble"
max_batch_size: 0
response_cache { enable: true }
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SCALED" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "plain" model_version: -1 input_map { key: "INPUT0" value: "A" }
    input_map { key: "INPUT1" value: "B" } output_map { key: "OUTPUT0" value: "sum" } },
  { model_name: "scale" model_version: -1 input_map { key: "IN" value: "sum" }
    output_map { key: "OUT" value: "SCALED" } } ] }
'''


# The same steps, the first one a model with a cache, the ensemble without one
STEPS_CACHED = ENSEMBLE.replace('name: "ens"', 'name: "ens_steps"').replace(
    "response_cache { enable: true }\n", "").replace('model_name: "plain"', 'model_name: "add_sub"')


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache") / "models"
    add_sub_io = ([("INPUT0", *F4), ("INPUT1", *F4)], [("OUTPUT0", *F4), ("OUTPUT1", *F4)])
    python_model(root, "add_sub", ADD_SUB, io_config("add_sub", *add_sub_io, extra=CACHED))
    python_model(root, "plain", ADD_SUB, io_config("plain", *add_sub_io))
    python_model(root, "matrix", SCALE, io_config(
        "matrix", [("IN", "TYPE_FP32", "[ -1, -1 ]")], [("OUT", "TYPE_FP32", "[ -1, -1 ]")],
        extra=CACHED))
    python_model(root, "failer", FAILER, io_config(
        "failer", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")], extra=CACHED))
    python_model(root, "scale", SCALE, io_config("scale", [("IN", *F4)], [("OUT", *F4)]))
    (root / "ens" / "1").mkdir(parents=True)
    (root / "ens" / "config.pbtxt").write_text(ENSEMBLE)
    (root / "ens_steps" / "1").mkdir(parents=True)
    (root / "ens_steps" / "config.pbtxt").write_text(STEPS_CACHED)
    return root


def _loads(*names: str) -> list[str]:
    return ["--model-control-mode", "explicit", *(a for n in names for a in ("--load-model", n))]


@pytest.fixture(scope="module")
def cached(repo):
    with start_server(repo, "--cache-config", "local,size=1048576",
                      *_loads("add_sub", "matrix", "failer", "ens", "ens_steps"), frontends=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny(repo):
    with start_server(repo, "--cache-config", "local,size=300", *_loads("add_sub", "matrix")) as srv:
        yield srv


@pytest.fixture(scope="module")
def none(repo):
    with start_server(repo, *_loads("add_sub")) as srv:
        yield srv


# ---- helpers ------------------------------------------------------------------------------

def add_sub(server, seed: float = 0.0, outputs: list[str] | None = None, module=httpclient) -> dict:
    """One add_sub request on a new connection (so either frontend may take it); its
    outputs checked exactly and returned by name."""
    url = server.http_url if module is httpclient else server.grpc_url
    c = module.InferenceServerClient(url)
    try:
        a = np.arange(4, dtype=np.float32) + seed
        b = np.full(4, 0.5, np.float32)
        inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        asked = [module.InferRequestedOutput(n) for n in outputs] if outputs else None
        res = c.infer("add_sub", inputs, outputs=asked)
        got = {n: res.as_numpy(n) for n in ("OUTPUT0", "OUTPUT1") if res.as_numpy(n) is not None}
        want = {"OUTPUT0": a + b, "OUTPUT1": a - b}
        assert sorted(got) == sorted(outputs or want), got
        for n, v in got.items():
            np.testing.assert_array_equal(v, want[n])
        return got
    finally:
        c.close()


def stat(server, model: str) -> dict:
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        (s,) = c.get_inference_statistics(model)["model_stats"]
    finally:
        c.close()
    inf = s["inference_stats"]
    return {"exec": int(s.get("execution_count", 0)), "inferences": int(s.get("inference_count", 0)),
            **{k: (int(inf[k].get("count", 0)), int(inf[k].get("ns", 0)))
               for k in ("success", "fail", "queue", "cache_hit", "cache_miss")}}


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("nv_")}


def frontend_requests(server) -> int:
    """trireme_frontend_requests: the requests the frontends passed to the scheduler."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in r.read().decode().splitlines()
                   if line.startswith("trireme_frontend_requests{"))


def counts(server, model: str) -> tuple[int, int, int]:
    """(executions, cache hits, cache misses) of ``model``."""
    s = stat(server, model)
    return s["exec"], s["cache_hit"][0], s["cache_miss"][0]


# ---- hits, misses and their accounting ----------------------------------------------------

def test_a_repeated_request_is_answered_without_executing(cached):
    before = stat(cached, "add_sub")
    m0 = metrics(cached)
    for i in range(6):   # new connections: both frontends answer some, from one cache
        add_sub(cached, seed=100.0, module=httpclient if i % 2 else grpcclient)
    # the miss is counted when its answer is inserted, right after it was sent
    wait_until(lambda: stat(cached, "add_sub")["cache_miss"][0] == before["cache_miss"][0] + 1,
               10, "the miss's insertion")
    after = stat(cached, "add_sub")
    d = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) if isinstance(after[k], tuple)
         else after[k] - before[k] for k in after}
    assert (d["exec"], d["inferences"]) == (1, 1), d        # executed once
    assert d["success"][0] == 6 and d["queue"][0] == 6, d    # hits are successes
    assert d["cache_hit"][0] == 5 and d["cache_hit"][1] > 0, d
    assert d["cache_miss"][0] == 1 and d["cache_miss"][1] > 0, d
    assert d["fail"] == (0, 0), d

    m1 = metrics(cached)
    key = 'model="add_sub",version="1"'
    for family, n in (("nv_cache_num_hits_per_model", 5), ("nv_cache_num_misses_per_model", 1),
                      ("nv_inference_exec_count", 1), ("nv_inference_request_success", 6)):
        assert m1[f"{family}{{{key}}}"] - m0.get(f"{family}{{{key}}}", 0) == n, family
    assert m1["nv_cache_num_hits"] - m0.get("nv_cache_num_hits", 0) == 5
    assert m1["nv_cache_num_lookups"] - m0.get("nv_cache_num_lookups", 0) == 6
    assert m1["nv_cache_num_entries"] >= 1 and 0 < m1["nv_cache_util"] < 1
    # the models without the cache (the ensemble's steps) have no cache series
    assert not [k for k in m1 if k.startswith("nv_cache_num_hits_per_model{") and
                ('model="plain"' in k or 'model="scale"' in k)], m1

    add_sub(cached, seed=200.0)   # other inputs: a miss, executed
    wait_until(lambda: counts(cached, "add_sub")[2] == after["cache_miss"][0] + 1, 10, "a miss")
    assert counts(cached, "add_sub")[0] == after["exec"] + 1


def test_the_key_includes_shapes_and_requested_outputs(cached):
    e0 = counts(cached, "add_sub")[0]
    # the same inputs, OUTPUT0 alone, then both: Triton's key would answer the second with
    # the first's one output (its issue #4362); each is answered right here
    assert list(add_sub(cached, seed=300.0, outputs=["OUTPUT0"])) == ["OUTPUT0"]
    assert sorted(add_sub(cached, seed=300.0)) == ["OUTPUT0", "OUTPUT1"]
    assert list(add_sub(cached, seed=300.0, outputs=["OUTPUT0"])) == ["OUTPUT0"]   # a hit
    wait_until(lambda: counts(cached, "add_sub")[0] == e0 + 2, 10, "two executions")

    c = httpclient.InferenceServerClient(cached.http_url)
    try:
        x = np.arange(4, dtype=np.float32)
        for shape in ([1, 4], [2, 2], [1, 4]):   # the same bytes, two shapes
            inp = httpclient.InferInput("IN", shape, "FP32")
            inp.set_data_from_numpy(x.reshape(shape))
            out = c.infer("matrix", [inp]).as_numpy("OUT")
            np.testing.assert_array_equal(out, 2 * x.reshape(shape))
    finally:
        c.close()
    executed, hits, _ = counts(cached, "matrix")
    assert (executed, hits) == (2, 1)


def test_errors_are_not_kept(cached):
    c = httpclient.InferenceServerClient(cached.http_url)
    try:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([7], np.int32))
        for _ in range(3):
            with pytest.raises(InferenceServerException) as e:
                c.infer("failer", [x])
            assert "this model always fails" in e.value.message()
    finally:
        c.close()
    s = stat(cached, "failer")
    assert (s["exec"], s["fail"][0], s["cache_hit"][0]) == (3, 3, 0), s


def test_an_ensemble_hit_skips_every_step(cached):
    c = httpclient.InferenceServerClient(cached.http_url)
    try:
        a, b = np.arange(4, dtype=np.float32), np.full(4, 3, np.float32)
        inputs = [httpclient.InferInput("A", [4], "FP32"), httpclient.InferInput("B", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        before = {m: stat(cached, m)["exec"] for m in ("plain", "scale")}
        for _ in range(3):
            np.testing.assert_array_equal(c.infer("ens", inputs).as_numpy("SCALED"), 2 * (a + b))
    finally:
        c.close()
    assert {m: stat(cached, m)["exec"] - before[m] for m in before} == {"plain": 1, "scale": 1}
    s = stat(cached, "ens")
    assert (s["success"][0], s["cache_hit"][0]) == (3, 2), s


def test_an_ensembles_steps_use_their_models_caches(cached):
    """An ensemble without a cache whose first step's model has one: that step is looked up
    in its model's cache (Triton's composing models keep their own caches), the other
    step runs every time."""
    c = httpclient.InferenceServerClient(cached.http_url)
    try:
        a, b = np.full(4, 7, np.float32), np.arange(4, dtype=np.float32)
        inputs = [httpclient.InferInput("A", [4], "FP32"), httpclient.InferInput("B", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        before = {m: stat(cached, m) for m in ("add_sub", "scale")}
        for _ in range(3):
            np.testing.assert_array_equal(c.infer("ens_steps", inputs).as_numpy("SCALED"),
                                          2 * (a + b))
    finally:
        c.close()
    wait_until(lambda: stat(cached, "add_sub")["cache_miss"][0] - before["add_sub"]["cache_miss"][0]
               == 1, 10, "the step's miss to be inserted")
    after = {m: stat(cached, m) for m in ("add_sub", "scale")}
    assert after["add_sub"]["exec"] - before["add_sub"]["exec"] == 1
    assert after["add_sub"]["cache_hit"][0] - before["add_sub"]["cache_hit"][0] == 2
    assert after["scale"]["exec"] - before["scale"]["exec"] == 3
    s = stat(cached, "ens_steps")
    assert (s["success"][0], s["cache_hit"][0], s["cache_miss"][0]) == (3, 0, 0), s


# ---- a full cache, an entry too large, no cache -------------------------------------------

def test_the_least_recently_used_entry_is_evicted(tiny):
    for seed in (1.0, 2.0, 1.0):   # each entry evicts the other: three executions
        add_sub(tiny, seed=seed)
    add_sub(tiny, seed=1.0)        # the last one kept: a hit
    wait_until(lambda: counts(tiny, "add_sub")[2] == 3, 10, "three misses")
    assert counts(tiny, "add_sub")[:2] == (3, 1)
    m = metrics(tiny)
    assert (m["nv_cache_num_evictions"], m["nv_cache_num_entries"]) == (2, 1)

    c = httpclient.InferenceServerClient(tiny.http_url)
    try:   # 400 bytes of output: larger than the whole cache, never kept
        x = np.zeros((1, 100), np.float32)
        inp = httpclient.InferInput("IN", [1, 100], "FP32")
        inp.set_data_from_numpy(x)
        for _ in range(2):
            c.infer("matrix", [inp])
    finally:
        c.close()
    wait_until(lambda: counts(tiny, "matrix")[2] == 2, 10, "two misses")
    assert counts(tiny, "matrix")[:2] == (2, 0)
    log = tiny.log_path.read_text()
    assert "Failed to insert key [" in log and \
        "into response cache: Requested byte_size: 528 is greater than total cache size: 300" in log


def test_a_frontends_copy_of_a_hit_counts_and_goes_with_its_entry(repo):
    """The second identical request is a hit the frontend then keeps a copy of; the third
    is answered from that copy and counted by the scheduler as a hit (statistics, gauges)
    and as a use of the entry: the other entry is the least recently used one and goes
    when a third is inserted; the copy of an entry the cache evicted goes with it, so that
    entry's next request executes again."""
    # (an add_sub entry takes 224 bytes: 500 hold two)
    with start_server(repo, "--cache-config", "local,size=500", *_loads("add_sub")) as srv:
        for seed in (1.0, 2.0, 1.0, 1.0):    # miss, miss, hit (copied), hit (the copy)
            add_sub(srv, seed=seed)
        wait_until(lambda: counts(srv, "add_sub") == (2, 2, 2), 10, "2 executions, 2 hits")
        m = metrics(srv)
        assert (m["nv_cache_num_hits"], m["nv_cache_num_lookups"]) == (2, 4)
        assert frontend_requests(srv) == 3, "the fourth was answered by the frontend"
        add_sub(srv, seed=3.0)   # evicts 2.0, the least recently used: 1.0 was used since
        add_sub(srv, seed=2.0)   # executed again, and evicts 1.0 (its copy goes with it)
        add_sub(srv, seed=1.0)   # executed again: the copy did not outlive its entry
        wait_until(lambda: counts(srv, "add_sub") == (5, 2, 5), 10, "5 executions, 2 hits")
        assert metrics(srv)["nv_cache_num_evictions"] == 3


def test_a_model_that_enables_the_cache_on_a_server_without_one_is_served_uncached(none):
    for _ in range(3):
        add_sub(none, seed=5.0)
    s = stat(none, "add_sub")
    assert (s["exec"], s["cache_hit"][0], s["cache_miss"][0]) == (3, 0, 0), s
    assert not any(k.startswith("nv_cache") for k in metrics(none))
    assert none.log_path.read_text().count(
        "model 'add_sub' enables the response cache, but the server has none") == 1


# ---- flags --------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, text", [
    (["--cache-config", "local"],
     "No cache specified. --cache-config option format is <cache name>,<setting>=<value>. "
     "Got local"),
    (["--cache-config", "local,size"],
     "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size"),
    (["--cache-config", "local,size=100", "--response-cache-byte-size", "100"],
     "Error: Incompatible flags --response-cache-byte-size and --cache-config both provided. "
     "Please provide one or the other."),
    (["--cache-config", "local,size=100", "--cache-config", "redis,host=localhost"],
     "error: creating server: Invalid argument - found multiple cache configurations, but "
     "only a single cache is currently supported"),
    (["--cache-config", "local,bytes=100"],
     "error: creating server: Invalid argument - Failed to initialize LocalCache: config "
     "didn't contain a valid 'size' field."),
])
def test_bad_cache_flags_stop_the_server_with_tritons_text(tmp_path, flags, text):
    (tmp_path / "models").mkdir()
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model-repository",
                        str(tmp_path / "models"), "--http-port", "0", *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r
    assert r.stderr.rstrip("\n").splitlines()[-1] == text, r.stderr


def test_an_ensemble_made_decoupled_by_a_step_refuses_the_cache(tmp_path):
    """Triton checks the cache rule again once a decoupled step made the ensemble decoupled
    (its qa/L0_response_cache): the load fails with its text."""
    from tests.models_python import REPEAT
    root = tmp_path / "models"
    python_model(root, "repeat", REPEAT, io_config(
        "repeat", [("IN", "TYPE_INT32", "[ -1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    (root / "streams" / "1").mkdir(parents=True)
    (root / "streams" / "config.pbtxt").write_text(
        'name: "streams"\nplatform: "ensemble"\nmax_batch_size: 0\n' + CACHED + "\n"
        'input [ { name: "VALUES" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "ONE" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "repeat" model_version: -1 '
        'input_map { key: "IN" value: "VALUES" } output_map { key: "OUT" value: "ONE" } } ] }\n')
    with start_server(root, "--cache-config", "local,size=4096", "--model-control-mode",
                      "explicit") as srv:
        c = httpclient.InferenceServerClient(srv.http_url)
        try:
            with pytest.raises(InferenceServerException) as e:
                c.load_model("streams")
            assert "Response Cache does not currently support model streams with 'decoupled' " \
                "transaction policy. Please disable the response cache." in e.value.message()
        finally:
            c.close()


def test_cache_summaries_with_summary_latencies(repo):
    """--metrics-config summary_latencies=true: Triton's nv_cache_hit_summary_per_model and
    nv_cache_miss_summary_per_model for a model with a cache (a hit's queue time in the
    queue summary), and no request summary for it (Triton leaves that out, its hits would
    mislead)."""
    with start_server(repo, "--cache-config", "local,size=1048576", "--metrics-config",
                      "summary_latencies=true", *_loads("add_sub")) as srv:
        for _ in range(3):
            add_sub(srv, seed=7.0)
        labels = 'model="add_sub",version="1"'
        m = wait_until(lambda: (lambda got: got if got.get(
            f"nv_cache_miss_summary_per_model_count{{{labels}}}") == 1 else None)(metrics(srv)),
                       10, "the miss's insert to be counted")
        assert m[f"nv_cache_hit_summary_per_model_count{{{labels}}}"] == 2
        assert m[f"nv_cache_hit_summary_per_model_sum{{{labels}}}"] >= 0
        assert f'nv_cache_hit_summary_per_model{{{labels},quantile="0.5"}}' in m
        assert f'nv_cache_miss_summary_per_model{{{labels},quantile="0.99"}}' in m
        assert m[f"nv_inference_queue_summary_us_count{{{labels}}}"] == 3   # 2 hits + 1 executed
        assert not [k for k in m if k.startswith("nv_inference_request_summary_us")], m
