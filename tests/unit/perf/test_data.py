"""Input data (perf_analyzer's JSON format and synthetic data), the load split across
processes, and the server statistics' window arithmetic."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from services.perf import inputs, server_stats
from services.perf.manager import process_count, shares
from services.perf.model import ModelInfo, Tensor


def model(*tensors: Tensor, mbs: int = 8) -> ModelInfo:
    return ModelInfo("m", "1", mbs, list(tensors), [], "none")


def test_json_input_data_content_shape_b64_and_strings(tmp_path):
    m = model(Tensor("A", "INT32", [-1]), Tensor("B", "FP32", [2]), Tensor("S", "BYTES", [1]))
    raw = base64.b64encode(np.array([1.5, 2.5], np.float32).tobytes()).decode()
    doc = {"data": [{"A": {"content": [1, 2, 3], "shape": [3]}, "B": {"b64": raw}, "S": ["hi"]},
                    {"A": [4, 5], "B": [0, 1], "S": ["yo"]}]}
    f = tmp_path / "in.json"
    f.write_text(json.dumps(doc))
    (stream,) = inputs.load(m, [str(f)], {}, 8, None)
    assert stream[0]["A"].tolist() == [1, 2, 3] and stream[0]["A"].dtype == np.int32
    assert stream[0]["B"].tolist() == [1.5, 2.5]
    assert stream[1]["S"].tolist() == [b"yo"]
    with pytest.raises(inputs.InputError, match="'B' is missing"):
        f.write_text(json.dumps({"data": [{"A": [1], "S": ["x"]}]}))
        inputs.load(m, [str(f)], {}, 8, None)


def test_sequence_streams_and_batching(tmp_path):
    m = model(Tensor("X", "INT32", [1]))
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"data": [[{"X": [1]}, {"X": [2]}], [{"X": [3]}]]}))
    assert [len(s) for s in inputs.load(m, [str(f)], {}, 8, None)] == [2, 1]
    samples = [{"X": np.array([v], np.int32)} for v in (1, 2, 3)]
    reqs = inputs.batch(samples, 2, batched=True)
    assert [r["X"].ravel().tolist() for r in reqs] == [[1, 2], [3, 1], [2, 3]]


def test_synthetic_data_needs_shapes_for_variable_dims():
    m = model(Tensor("X", "FP32", [-1, 4]), Tensor("T", "BYTES", [2]))
    with pytest.raises(inputs.InputError, match="--shape X:"):
        inputs.load(m, ["zero"], {}, 8, None)
    (stream,) = inputs.load(m, ["random"], {"X": [3, 4]}, 5, None)
    assert stream[0]["X"].shape == (3, 4)
    assert all(len(v) == 5 for v in stream[0]["T"].ravel())


def test_shares_and_process_count():
    assert shares(10, [1, 1, 1]) == [4, 3, 3]
    assert shares(40, [3, 1]) == [30, 10]
    assert shares(5, [0, 0]) == [0, 0]
    assert process_count("concurrency", 64, 64, None, cpus=2) == 2
    assert process_count("concurrency", 64, 64, None, cpus=8, lean=True) == 1
    assert process_count("concurrency", 1024, 1024, None, cpus=8, lean=True) == 4
    assert process_count("request_rate", 30000, 1, None, cpus=8, lean=True) == 2
    assert process_count("concurrency", 1, 1, None, cpus=8) == 1
    assert process_count("concurrency", 64, 64, 1, cpus=8) == 1
    assert process_count("request_rate", 100, 1, None, cpus=8) == 1


def test_statistics_diff_merge_and_composing_versions():
    def entry(name, version, n):
        return {"name": name, "version": version, "inference_count": n, "execution_count": n,
                "inference_stats": {"success": {"count": n, "ns": 1000 * n},
                                    "queue": {"count": str(n), "ns": str(10 * n)}}}
    start = {(e["name"], e["version"]): server_stats.parse_entry(e)
             for e in (entry("ens", "1", 5), entry("a", "1", 5), entry("a", "2", 0))}
    end = {(e["name"], e["version"]): server_stats.parse_entry(e)
           for e in (entry("ens", "1", 8), entry("a", "1", 5), entry("a", "2", 3))}
    d = server_stats.diff(start, end, "ens", "1", {"ens": [("a", "")]})
    assert (d.success_count, d.cumm_time_ns, d.queue_count, d.queue_time_ns) == (3, 3000, 3, 30)
    assert list(d.composing) == [("a", "2")]   # (the version that moved)
    merged = server_stats.merge([d, d])
    assert merged.success_count == 6 and merged.composing[("a", "2")].success_count == 6
