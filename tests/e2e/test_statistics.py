"""Statistics extension end to end: GET /v2/models[/{m}[/versions/{v}]]/stats and the gRPC
ModelStatistics RPC, read with the official, unmodified tritonclient (HTTP, gRPC, aio).

One server of its own (explicit control mode) so that every request it sees is sent here:
  add_sub        versions 1 and 2 (version_policy all), max_batch_size 8, no dynamic
                 batching: each request is one execution of its own batch size
  identity_fp32  loaded, never used
  identity_int32 in the repository but not loaded (not ready)
Counts are still checked as deltas against a snapshot, so the tests do not depend on
their order. Imports tritonclient's protos only (never ours), like tests/e2e/test_grpc_api.py.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from conftest import start_server, wait_until
from tritonclient.utils import InferenceServerException

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")
BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")
NOT_AVAILABLE = "requested model 'nope' is not available"
NO_VERSION = "requested model version is not available for model 'add_sub'"
ONE_CPU = ('instance_group [{ kind: KIND_CPU, count: 1 }]\n'
           'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n')


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats") / "models"
    models.add_sub(root / "add_sub", versions=(1, 2), offset_per_version=True)
    models.write_config(root / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\n'
                        f'max_batch_size: 8\nversion_policy {{ all {{ }} }}\n{ONE_CPU}')
    for dt in ("fp32", "int32"):
        models.identity(root / f"identity_{dt}", dt)
        models.write_config(root / f"identity_{dt}", f"max_batch_size: 8\n{ONE_CPU}")
    with start_server(root, "--model-control-mode", "explicit", "--load-model", "add_sub",
                      "--load-model", "identity_fp32") as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    c = httpclient.InferenceServerClient(srv.http_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_(srv):
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


# ---- helpers ------------------------------------------------------------------------------

def canon(stat: dict) -> dict:
    """One model_stats entry in one form, whether it comes from the HTTP JSON or from the gRPC
    client's as_json (MessageToJson: uint64 values are strings, zeros are left out)."""
    def num(d: dict, key: str) -> int:
        return int(d.get(key, 0))

    def dur(d: dict) -> tuple[int, int]:
        return num(d, "count"), num(d, "ns")

    infer = stat.get("inference_stats", {})
    return {"name": stat["name"], "version": stat["version"],
            "last_inference": num(stat, "last_inference"),
            "inference_count": num(stat, "inference_count"),
            "execution_count": num(stat, "execution_count"),
            **{k: dur(infer.get(k, {})) for k in DURATIONS},
            "batch_stats": {num(b, "batch_size"): {k: dur(b.get(k, {})) for k in BATCH_DURATIONS}
                            for b in stat.get("batch_stats", [])}}


def http_stats(client, model: str = "", version: str = "") -> list[dict]:
    return [canon(s) for s in client.get_inference_statistics(model, version)["model_stats"]]


def grpc_stats(client, model: str = "", version: str = "") -> list[dict]:
    got = client.get_inference_statistics(model, version, as_json=True)
    return [canon(s) for s in got.get("model_stats", [])]


def one(stats: list[dict]) -> dict:
    assert len(stats) == 1, stats
    return stats[0]


def delta(before: dict, after: dict) -> dict:
    """after - before for every counter; batch_stats as {batch_size: executions}."""
    out = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    for k in DURATIONS:
        out[k] = (after[k][0] - before[k][0], after[k][1] - before[k][1])
    sizes = set(after["batch_stats"]) | set(before["batch_stats"])
    out["batch_stats"] = {
        bs: after["batch_stats"].get(bs, {}).get("compute_infer", (0, 0))[0]
        - before["batch_stats"].get(bs, {}).get("compute_infer", (0, 0))[0] for bs in sizes}
    out["batch_stats"] = {bs: n for bs, n in out["batch_stats"].items() if n}
    return out


def infer(client, module, batch: int, version: str = "") -> np.ndarray:
    """add_sub with `batch` rows over either client module; returns OUTPUT0."""
    rng = np.random.default_rng(batch)
    a = rng.random((batch, 16), dtype=np.float32)
    inputs = [module.InferInput("INPUT0", [batch, 16], "FP32"),
              module.InferInput("INPUT1", [batch, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    executions = _executions(client, version)
    out = client.infer("add_sub", inputs, model_version=version).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, 2 * a + (int(version or 2) - 1), rtol=1e-6)
    # A worker answers before it reports the batch to the scheduler (as Triton's backends
    # do), so the response can arrive a moment before the statistics count it.
    wait_until(lambda: _executions(client, version) == executions + 1, 10,
               "the execution in the statistics")
    return out


def _executions(client, version: str) -> int:
    st = client.get_inference_statistics("add_sub", version or "2")
    if not isinstance(st, dict):   # gRPC: the protobuf message
        return st.model_stats[0].execution_count
    return int(st["model_stats"][0]["execution_count"])


def raw_get(srv, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(f"http://{srv.http_url}{path}", method=method,
                                 data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# ---- tests --------------------------------------------------------------------------------

def test_extension_is_advertised(http, grpc_):
    assert "statistics" in http.get_server_metadata()["extensions"]
    assert "statistics" in grpc_.get_server_metadata().extensions


def test_counts_durations_and_batch_sizes(http, grpc_):
    """Sequential requests of batch 1, 3, 3, 8 (HTTP) and 2 (gRPC) on version 1: each is one
    execution of its own size; inference_count counts rows, success counts requests."""
    before, untouched = http_stats(http, "add_sub", "1"), http_stats(http, "add_sub", "2")
    t0_ms = time.time_ns() // 1_000_000
    for batch in (1, 3, 3, 8):
        infer(http, httpclient, batch, "1")
    infer(grpc_, grpcclient, 2, "1")
    t1_ms = time.time_ns() // 1_000_000
    after = one(http_stats(http, "add_sub", "1"))
    d = delta(one(before), after)
    assert (d["inference_count"], d["execution_count"]) == (17, 5)
    for k in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert d[k][0] == 5, (k, d[k])
        assert d[k][1] > 0, (k, d[k])
    for k in ("fail", "cache_hit", "cache_miss"):
        assert d[k] == (0, 0), (k, d[k])
    # The time a request spent in the server covers its queueing and its compute.
    assert d["success"][1] >= d["queue"][1] + d["compute_infer"][1]
    assert d["batch_stats"] == {1: 1, 2: 1, 3: 2, 8: 1}
    for bs in (1, 2, 3, 8):
        for k in BATCH_DURATIONS:
            assert after["batch_stats"][bs][k][1] > 0, (bs, k)
    # Wall-clock ms, read by another process: allow a little skew (this VM's clock is
    # stepped now and then), but it must be this test's inferences, not an old one.
    assert t0_ms - 1000 <= after["last_inference"] <= t1_ms + 1000
    assert after["last_inference"] >= one(before)["last_inference"]
    assert http_stats(http, "add_sub", "2") == untouched   # the other version saw nothing


def test_versions_are_counted_apart(http, grpc_):
    v1, v2 = one(http_stats(http, "add_sub", "1")), one(http_stats(http, "add_sub", "2"))
    infer(http, httpclient, 4, "2")
    infer(grpc_, grpcclient, 4, "")            # no version: the latest, 2
    both = http_stats(http, "add_sub")          # the model: every ready version, in order
    assert [s["version"] for s in both] == ["1", "2"]
    assert both[0] == v1
    d = delta(v2, both[1])
    assert (d["inference_count"], d["execution_count"], d["success"][0]) == (8, 2, 2)
    assert d["batch_stats"] == {4: 2}
    assert http_stats(http, "add_sub", "2") == [both[1]]


def test_listing_holds_exactly_the_ready_models(http, grpc_):
    listed = {(s["name"], s["version"]) for s in http_stats(http)}
    assert listed == {("add_sub", "1"), ("add_sub", "2"), ("identity_fp32", "1")}
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert "identity_int32" in index and index["identity_int32"].get("state") != "READY"
    idle = one(http_stats(http, "identity_fp32"))   # loaded, never used: all zero
    assert (idle["last_inference"], idle["inference_count"], idle["execution_count"]) == (0, 0, 0)
    assert all(idle[k] == (0, 0) for k in DURATIONS) and idle["batch_stats"] == {}

    http.load_model("identity_int32")
    try:
        listed = {(s["name"], s["version"]) for s in grpc_stats(grpc_)}
        assert ("identity_int32", "1") in listed and len(listed) == 4
        assert one(grpc_stats(grpc_, "identity_int32"))["execution_count"] == 0
    finally:
        http.unload_model("identity_int32")
    wait_until(lambda: ("identity_int32", "1") not in
               {(s["name"], s["version"]) for s in http_stats(http)}, 30, "the unload")
    with pytest.raises(InferenceServerException) as info:
        http.get_inference_statistics("identity_int32")
    assert info.value.message() == "requested model 'identity_int32' is not available"


def test_http_and_grpc_answer_the_same(http, grpc_):
    infer(http, httpclient, 5, "1")
    for args in ((), ("add_sub",), ("add_sub", "1"), ("identity_fp32", "1")):
        assert http_stats(http, *args) == grpc_stats(grpc_, *args), args
    # The protobuf answer (not as_json) carries the same numbers.
    proto = grpc_.get_inference_statistics("add_sub", "1").model_stats[0]
    ref = one(http_stats(http, "add_sub", "1"))
    assert (proto.name, proto.version, proto.inference_count, proto.execution_count,
            proto.last_inference) == (ref["name"], ref["version"], ref["inference_count"],
                                      ref["execution_count"], ref["last_inference"])
    assert (proto.inference_stats.compute_infer.count, proto.inference_stats.compute_infer.ns) \
        == ref["compute_infer"]
    assert {b.batch_size: b.compute_infer.count for b in proto.batch_stats} == \
        {bs: b["compute_infer"][0] for bs, b in ref["batch_stats"].items()}


def test_aio_clients(srv, http):
    async def main():
        async with httpclient_aio.InferenceServerClient(srv.http_url) as h, \
                grpcclient_aio.InferenceServerClient(srv.grpc_url) as g:
            got_h = (await h.get_inference_statistics("add_sub", "1"))["model_stats"]
            got_g = (await g.get_inference_statistics("add_sub", "1", as_json=True))
            with pytest.raises(InferenceServerException) as info:
                await g.get_inference_statistics("nope")
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert info.value.message() == NOT_AVAILABLE
            return [canon(s) for s in got_h], [canon(s) for s in got_g["model_stats"]]

    got_h, got_g = asyncio.run(asyncio.wait_for(main(), 60))
    assert got_h == got_g == http_stats(http, "add_sub", "1")


@pytest.mark.parametrize("model, version, message", [
    ("nope", "", NOT_AVAILABLE),
    ("nope", "1", NOT_AVAILABLE),
    ("identity_int32", "", "requested model 'identity_int32' is not available"),  # not loaded
    ("add_sub", "3", NO_VERSION),
])
def test_unknown_model_or_version(http, grpc_, model, version, message):
    with pytest.raises(InferenceServerException) as info:
        http.get_inference_statistics(model, version)
    assert (info.value.status(), info.value.message()) == ("400", message)
    with pytest.raises(InferenceServerException) as info:
        grpc_.get_inference_statistics(model, version)
    assert (info.value.status(), info.value.message()) == ("StatusCode.INVALID_ARGUMENT", message)


def test_http_json_is_tritons(srv, http):
    """Key for key what Triton's core writes, with integers (not strings) as numbers."""
    infer(http, httpclient, 1, "1")
    status, headers, body = raw_get(srv, "/v2/models/add_sub/versions/1/stats")
    assert status == 200 and headers["Content-Type"] == "application/json"
    (stat,) = json.loads(body)["model_stats"]
    assert list(stat) == ["name", "version", "last_inference", "inference_count",
                          "execution_count", "inference_stats", "response_stats", "batch_stats",
                          "memory_usage"]
    assert (stat["name"], stat["version"]) == ("add_sub", "1")
    assert list(stat["inference_stats"]) == list(DURATIONS)
    for d in stat["inference_stats"].values():
        assert list(d) == ["count", "ns"] and all(type(v) is int for v in d.values())
    assert stat["response_stats"] == {} and stat["memory_usage"] == []
    assert stat["batch_stats"]
    for b in stat["batch_stats"]:
        assert list(b) == ["batch_size", *BATCH_DURATIONS]
    # Triton parses the version as a number ("01" is 1); the all-models path is exact.
    assert json.loads(raw_get(srv, "/v2/models/add_sub/versions/01/stats")[2]) == \
        json.loads(raw_get(srv, "/v2/models/add_sub/versions/1/stats")[2])
    assert {s["name"] for s in json.loads(raw_get(srv, "/v2/models/stats")[2])["model_stats"]} \
        == {"add_sub", "identity_fp32"}


def test_http_routing(srv):
    for path in ("/v2/models/stats", "/v2/models/add_sub/stats",
                 "/v2/models/add_sub/versions/1/stats"):
        status, _, body = raw_get(srv, path, "POST")
        assert (status, json.loads(body)) == (405, {"error": "Method Not Allowed"}), path
    status, _, body = raw_get(srv, "/v2/models/nope/stats")
    assert (status, json.loads(body)) == (400, {"error": NOT_AVAILABLE})
    for path in ("/v2/models/add_sub/versions/x/stats", "/v2/models/add_sub/stats/x",
                 "/v2/models/stats/x/y"):
        assert raw_get(srv, path)[0] == 404, path
