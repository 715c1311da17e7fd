"""The scheduler's trace settings store (services/scheduler/trace_settings.py): sampling,
trace_count, log_frequency and the trace files, child traces of ensemble steps, the
start-up flags; and the trace JSON the frontend writes (services/common/trace.py).

What Triton does, each checked against tritonserver 2.51 with the same settings and
requests: trace_count=3 with rate 1 writes <file>.<n> once the third trace is in; with
rate 2 the traces wait in the setting until it is replaced (then onto <file> itself:
log_frequency is 0); the count a read shows is what is left; ids count every trace, a
child's too.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.common import messages as m
from services.common.trace import (
    CHILDREN_KEY,
    TENSORS,
    TIMESTAMPS,
    RequestTrace,
    model_object,
    stamp_results,
    stoi,
    tensor_object,
)
from services.scheduler.trace_config import TraceConfig, TraceConfigError, add_trace_args, config_from_args
from services.scheduler.trace_settings import TraceManager

STEPS = b"steps"


class Frontends:
    """What the manager sends: (identity, message)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.identities = [b"f1"]

    def send(self, identity: bytes, msg: object) -> None:
        self.sent.append((identity, msg))


def manager(tmp_path: Path, **cfg) -> tuple[TraceManager, Frontends, Path]:
    f = Frontends()
    path = tmp_path / "trace.json"
    config = TraceConfig(**{"level": TIMESTAMPS, "rate": 1, "file": str(path), **cfg})
    return TraceManager(config, f.send, lambda: f.identities, STEPS), f, path


def request(model: str = "m", req_id: int = 1) -> m.InferRequest:
    return m.InferRequest(req_id, "", model, 1, [], trace=1)


def run(tm: TraceManager, n: int, model: str = "m") -> list[int]:
    """``n`` marked requests, each traced one answered at once; returns the trace ids."""
    ids = []
    for i in range(n):
        t = tm.sample(b"f1", request(model, i), 1000 + i)
        if t is not None:
            ids.append(t.id)
            tm.record(m.TraceRecord(t.id, f'{{"id":{t.id}}}'))
    return ids


def files(path: Path) -> dict[str, list]:
    return {p.name: json.loads(p.read_text()) for p in sorted(path.parent.glob(path.name + ".*"))}


def settings(tm: TraceManager, model: str = "") -> dict[str, list[str]]:
    return dict(tm.settings_of(model))


def update(tm: TraceManager, model: str = "", clear: tuple[str, ...] = (), **values: int) -> str:
    return tm.update(model, m.TraceUpdate(values, list(clear)))


def test_trace_count_with_rate_1_writes_an_indexed_file_when_used_up(tmp_path):
    tm, _, path = manager(tmp_path, count=3)
    assert run(tm, 5) == [1, 2, 3]
    assert files(path) == {"trace.json.0": [{"id": 1}, {"id": 2}, {"id": 3}]}
    assert settings(tm)["trace_count"] == ["0"]       # what is left
    assert not path.exists()


def test_traces_left_in_a_setting_go_to_the_file_when_it_is_replaced(tmp_path):
    tm, _, path = manager(tmp_path)
    assert update(tm, count=2, rate=2) == ""
    assert run(tm, 6) == [1, 2]                       # the 2nd and 4th requests
    assert files(path) == {}                          # 2 collected != 4 seen: nothing yet
    # the count set is what is left of it: 0 (a start-up count would be the fallback)
    assert update(tm, rate=1) == "Attempting to set invalid trace setting :"
    assert update(tm, count=-1, rate=1) == ""
    assert run(tm, 1) == [3]
    tm.close()
    assert json.loads(path.read_text()) == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_log_frequency_writes_every_n_traces_to_the_next_index(tmp_path):
    tm, _, path = manager(tmp_path, log_frequency=2)
    run(tm, 5)
    assert files(path) == {"trace.json.0": [{"id": 1}, {"id": 2}],
                           "trace.json.1": [{"id": 3}, {"id": 4}]}
    tm.close()                                        # the rest: the next index, not <file>
    assert files(path)["trace.json.2"] == [{"id": 5}]
    assert not path.exists()


def test_rate_samples_every_nth_marked_request(tmp_path):
    tm, _, _ = manager(tmp_path, rate=3)
    assert run(tm, 10) == [1, 2, 3]


def test_a_setting_waits_for_its_open_traces_before_writing(tmp_path):
    tm, _, path = manager(tmp_path)
    t = tm.sample(b"f1", request(), 1)
    assert t is not None
    assert update(tm, level=TIMESTAMPS) == ""        # replaced while t is open
    tm.record(m.TraceRecord(t.id, '{"id":1}'))
    tm.close()
    assert json.loads(path.read_text()) == [{"id": 1}]


def test_traces_of_a_lost_frontend_are_given_up(tmp_path):
    tm, _, path = manager(tmp_path, count=1)
    t = tm.sample(b"f1", request(), 1)
    assert t is not None
    tm.frontend_lost(b"f1")
    tm.record(m.TraceRecord(t.id, '{"id":1}'))        # too late: nothing is written
    tm.close()
    assert files(path) == {} and not path.exists()


def test_model_settings_fall_back_to_the_global_ones(tmp_path):
    tm, _, path = manager(tmp_path)
    assert update(tm, "a", rate=2) == ""
    assert update(tm, count=5) == ""                  # rebuilds "a", whose rate is its own
    assert (settings(tm, "a")["trace_rate"], settings(tm, "a")["trace_count"]) == (["2"], ["5"])
    assert run(tm, 4, "a") == [1, 2]                  # its own counters
    assert settings(tm, "a")["trace_count"] == ["3"] and settings(tm)["trace_count"] == ["5"]
    assert update(tm, "a", clear=("rate",)) == ""     # nothing of its own left: the global one
    assert "a" not in tm.models


def test_levels_tell_frontends_what_to_mark(tmp_path):
    tm, f, _ = manager(tmp_path, count=1)
    assert tm.levels() == m.TraceLevels(TIMESTAMPS, {})
    tm.hello(b"f2")
    assert f.sent == [(b"f2", m.TraceLevels(TIMESTAMPS, {}))]
    run(tm, 1)                                        # count used up: nothing to mark
    assert f.sent[-1] == (b"f1", m.TraceLevels(0, {}))
    assert update(tm, "a", level=TENSORS, count=-1) == ""
    tm.answer(m.TraceSettingsRequest(1, "a", m.TraceUpdate({"level": TENSORS})), True)
    assert f.sent[-1] == (b"f1", m.TraceLevels(0, {"a": TENSORS}))


def test_off_with_no_file_is_valid_but_on_is_not(tmp_path):
    tm = TraceManager(TraceConfig(), lambda i, msg: None, lambda: [], STEPS)
    assert settings(tm) == {"trace_level": ["OFF"], "trace_rate": ["1000"], "trace_count": ["-1"],
                            "log_frequency": ["0"], "trace_file": [""], "trace_mode": ["triton"]}
    assert update(tm, level=TIMESTAMPS) == ("Attempting to set invalid trace setting :trace file "
                                            "name is not given")
    assert tm.sample(b"f1", request(), 1) is None


def test_ensemble_steps_are_child_traces(tmp_path):
    tm, _, path = manager(tmp_path, log_frequency=1)
    root = tm.sample(b"f1", request("ens", 1), 100)
    assert root is not None and root.head == [1, TIMESTAMPS, 100]
    for step_id, model in ((11, "a"), (12, "b")):
        tm.expect_child(step_id, root)
        step = m.InferRequest(step_id, "", model, 3, [], request_id="rq", trace=1)
        child = tm.sample(STEPS, step, 200 + step_id)
        assert child is not None and child.head[:2] == [root.id + step_id - 10, TIMESTAMPS]
        tm.step_done(m.InferResult(step_id, trace=[*child.head, 1, 2, 3, 4]))
    tm.record(m.TraceRecord(root.id, model_object(root.id, "ens", 1)))
    (trace,) = files(path).values()
    objects = [o for o in trace if "model_name" in o]
    assert objects == [   # the children first, the last one first (Triton's order)
        {"id": 3, "model_name": "b", "model_version": 3, "request_id": "rq", "parent_id": 1},
        {"id": 2, "model_name": "a", "model_version": 3, "request_id": "rq", "parent_id": 1},
        {"id": 1, "model_name": "ens", "model_version": 1}]
    names = [o["timestamps"][0]["name"] for o in trace if o["id"] == 2 and "timestamps" in o]
    assert names == ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
                     "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"]


def test_a_step_request_not_expected_is_not_traced(tmp_path):
    tm, _, _ = manager(tmp_path)
    assert tm.sample(STEPS, request("a", 5), 1) is None


# ---- start-up flags ------------------------------------------------------------------------

def flags(*argv: str) -> TraceConfig:
    p = argparse.ArgumentParser()
    add_trace_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_trace_config_flags():
    assert flags() == TraceConfig()
    cfg = flags("--trace-config", "level=TIMESTAMPS", "--trace-config", "level=tensors",
                "--trace-config", "rate=-1", "--trace-config", "count=5",
                "--trace-config", "triton,file=/t/x.json",
                "--trace-config", "triton,log-frequency=50")
    assert (cfg.level, cfg.rate, cfg.count, cfg.file, cfg.log_frequency) == (
        TIMESTAMPS | TENSORS, 2**32 - 1, 5, "/t/x.json", 50)
    assert flags("--trace-config", "level=TIMESTAMPS", "--trace-config", "level=OFF").level == 0
    cfg = flags("--trace-config", "mode=opentelemetry",
                "--trace-config", "opentelemetry,url=http://h:4318/v1/traces",
                "--trace-config", "opentelemetry,resource=service.name=x",
                "--trace-config", "triton,file=ignored")
    assert (cfg.mode, cfg.file) == ("opentelemetry", "")
    assert cfg.options["opentelemetry"][:2] == [("url", "http://h:4318/v1/traces"),
                                                ("resource", "service.name=x")]


def test_deprecated_trace_flags(capsys):
    cfg = flags("--trace-file", "/t/a", "--trace-level", "TIMESTAMPS", "--trace-rate", "7",
                "--trace-count", "3", "--trace-log-frequency", "2", "--trace-config", "rate=9")
    assert (cfg.file, cfg.level, cfg.rate, cfg.count, cfg.log_frequency) == (
        "/t/a", TIMESTAMPS, 9, 3, 2)
    err = capsys.readouterr().err
    assert "Warning: '--trace-file' has been deprecated" in err
    assert "Warning: Overriding deprecated '--trace-rate' in favor of provided rate" in err


@pytest.mark.parametrize("argv, text", [
    (["--trace-config", "rate=abc"], 'Bad option: "--trace-config rate".\nInvalid option value. Got abc'),
    (["--trace-config", "count=9999999999"],
     'Bad option: "--trace-config count".\nProvided option value is out of bound. Got 9999999999'),
    (["--trace-config", "level=bogus"],
     'Bad option: "--trace-config level".\ninvalid value for trace level option: bogus'),
    (["--trace-config", "triton,log-frequency=x"],
     'Bad option: "--trace-config triton,log-frequency".\nInvalid option value. Got x'),
])
def test_trace_config_errors_are_tritons(argv, text):
    with pytest.raises(TraceConfigError) as info:
        flags(*argv)
    assert str(info.value).rstrip("\n") == text


@pytest.mark.parametrize("arg", [",rate=1", "rate", "bogus,rate=1", "rate=", "triton,=x"])
def test_malformed_trace_config_is_refused_at_parse(arg, capsys):
    p = argparse.ArgumentParser()
    add_trace_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--trace-config", arg])
    assert "--trace-config" in capsys.readouterr().err


# ---- the JSON pieces -------------------------------------------------------------------------

def test_stoi_reads_as_cpp_does():
    assert [stoi(s) for s in (" 12abc", "+5", "-0", "\t7", "2147483647")] == [12, 5, 0, 7, 2**31 - 1]
    for bad in ("", "x", "-", " +"):
        with pytest.raises(ValueError):
            stoi(bad)
    with pytest.raises(OverflowError):
        stoi("2147483648")


def test_tensor_data_as_triton_prints_it():
    f32 = json.loads(tensor_object(1, "TENSOR_QUEUE_INPUT", "X", "FP32", [3],
                                   b"\x00\x00\xc0\x3f\xcd\xcc\xcc\x3d\x00\x00\x80\x7f"))
    assert f32 == {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
                   "tensor": {"name": "X", "data": "1.5,0.1,inf", "shape": "3", "dtype": "FP32"}}
    s = json.loads(tensor_object(2, "TENSOR_BACKEND_OUTPUT", "S", "BYTES", [2, 1],
                                 b"\x02\0\0\0hi\x00\0\0\0"))
    assert s["tensor"] == {"name": "S", "data": '"hi",""', "shape": "2,1", "dtype": "BYTES"}
    b = json.loads(tensor_object(3, "TENSOR_QUEUE_INPUT", "B", "BOOL", [2], b"\x01\x00"))
    assert b["tensor"]["data"] == "1,0"
    h = json.loads(tensor_object(3, "TENSOR_QUEUE_INPUT", "H", "FP16", [1], b"\x00\x3c"))
    assert h["tensor"]["data"] == ""                  # Triton leaves FP16 out
    i = json.loads(tensor_object(3, "TENSOR_QUEUE_INPUT", "I", "INT64", [2],
                                 b"\xff" * 8 + b"\x02" + b"\0" * 7))
    assert i["tensor"]["data"] == "-1,2"


def test_request_trace_layouts():
    def sampled(protocol: str, level: int) -> RequestTrace:
        t = RequestTrace(protocol)
        t.begin("m", 2, "rid", [("X", "INT32", [1], b"\x05\0\0\0")], lambda i, s: None)
        t.arrived([7, level, 10, 11, 12, 13, 14], [("Y", "INT32", [1], b"\x06\0\0\0")])
        t.replied()
        return t

    def names(t: RequestTrace) -> list[str]:
        return [o["timestamps"][0]["name"] if "timestamps" in o else
                "model" if "model_name" in o else o["activity"]
                for o in json.loads("[" + t.text() + "]")]
    t = sampled("HTTP", TIMESTAMPS)
    t.finish()
    assert names(t) == ["HTTP_RECV_START", "HTTP_RECV_END", "model", "REQUEST_START",
                        "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
                        "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE",
                        "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]
    assert json.loads("[" + t.text() + "]")[2] == {"id": 7, "model_name": "m",
                                                   "model_version": 2, "request_id": "rid"}
    t = sampled("GRPC", TIMESTAMPS | TENSORS)
    t.finish()
    assert names(t) == ["model", "REQUEST_START", "QUEUE_START", "TENSOR_QUEUE_INPUT",
                        "TENSOR_BACKEND_OUTPUT", "COMPUTE_START", "COMPUTE_INPUT_END",
                        "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END",
                        "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE",
                        "GRPC_SEND_START", "GRPC_SEND_END"]
    assert names(sampled("HTTP", TENSORS)) == ["TENSOR_QUEUE_INPUT", "TENSOR_BACKEND_OUTPUT"]


def test_an_unsampled_request_writes_nothing():
    got = []
    t = RequestTrace("HTTP")
    t.begin("m", 1, "", None, lambda i, s: got.append(s))
    t.replied()
    t.finish()
    assert got == []


def test_stamp_results_marks_the_sampled_final_results_only():
    items = [m.BatchItem("a", 1, [], trace=[5, TIMESTAMPS, 9]), m.BatchItem("a", 2, [])]
    replies = {"a": ([m.InferResult(1), m.InferResult(2), m.InferResult(1, final=False)], [])}
    stamp_results(items, replies, (1, 2, 3, 4))
    assert [r.trace for r in replies["a"][0]] == [[5, TIMESTAMPS, 9, 1, 2, 3, 4], [], []]


# ---- mode opentelemetry ----------------------------------------------------------------------

def test_opentelemetry_flags_add_the_batch_span_processor_defaults(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    cfg = flags("--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
                "--trace-config", "opentelemetry,url=http://c:4318/v1/traces",
                "--trace-config", "opentelemetry,bsp_schedule_delay=0100")
    assert cfg.options["opentelemetry"] == [   # Triton's order: given, then the defaults
        ("url", "http://c:4318/v1/traces"), ("bsp_schedule_delay", "100"),
        ("bsp_max_export_batch_size", "512"), ("bsp_max_queue_size", "100")]
    tm = TraceManager(cfg, lambda i, msg: None, lambda: [], STEPS)
    assert tm.settings_of("") == [
        ("trace_level", ["TIMESTAMPS"]), ("trace_rate", ["1000"]), ("trace_count", ["-1"]),
        ("trace_mode", ["opentelemetry"]), ("url", ["http://c:4318/v1/traces"]),
        ("bsp_schedule_delay", ["100"]), ("bsp_max_export_batch_size", ["512"]),
        ("bsp_max_queue_size", ["100"])]
    assert tm.levels() == m.TraceLevels(TIMESTAMPS, {}, "opentelemetry",
                                        cfg.options["opentelemetry"])
    with pytest.raises(TraceConfigError) as info:
        flags("--trace-config", "mode=opentelemetry", "--trace-config",
              "opentelemetry,bsp_max_queue_size=x")
    assert str(info.value).startswith(
        'Bad option: "--trace-config opentelemetry,bsp_max_queue_size".\nInvalid option value.')


def test_a_propagated_context_is_traced_whatever_the_rate_and_count(tmp_path):
    cfg = TraceConfig(level=TIMESTAMPS, rate=0, mode="opentelemetry")
    tm = TraceManager(cfg, lambda i, msg: None, lambda: [], STEPS)
    assert tm.levels().default == TIMESTAMPS      # frontends mark requests: some may bring one
    assert tm.sample(b"f1", request(), 1) is None                         # rate 0: none ...
    forced = m.InferRequest(2, "", "m", 1, [], trace=2)
    t = tm.sample(b"f1", forced, 1)                                       # ... but these
    assert t is not None and t.head == [1, TIMESTAMPS, 1]
    tm.record(m.TraceRecord(t.id, ""))
    assert t.setting.open == 0 and t.setting.in_stream == []              # no file in this mode
    off = TraceManager(TraceConfig(mode="opentelemetry"), lambda i, msg: None, lambda: [], STEPS)
    assert off.sample(b"f1", forced, 1) is None                           # level OFF: never


def test_opentelemetry_steps_travel_to_the_frontend(tmp_path):
    tm = TraceManager(TraceConfig(level=TIMESTAMPS, rate=1, mode="opentelemetry"),
                      lambda i, msg: None, lambda: [], STEPS)
    root = tm.sample(b"f1", request("ens", 1), 100)
    assert root is not None
    tm.expect_child(11, root)
    child = tm.sample(STEPS, m.InferRequest(11, "", "a", 2, [], request_id="rq", trace=1), 200)
    assert child is not None
    tm.step_done(m.InferResult(11, trace=[*child.head, 1, 2, 3, 4]))
    result = m.InferResult(1, parameters={"sequence_id": 5})
    tm.answered(root, result)
    (step,) = result.parameters[CHILDREN_KEY]
    assert step[:5] == [2, 1, "a", 2, "rq"] and step[6:11] == [200, 1, 2, 3, 4]
    assert result.trace == root.head and result.parameters["sequence_id"] == 5
