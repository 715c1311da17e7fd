"""Triton's logging extension on real processes: GET/POST /v2/logging and the LogSettings
RPC with the official tritonclient, a change reaching every process of `trireme serve`
(both frontends, the scheduler, a Python model's worker) through the log file they all
append to, the --log-* flags at start, and the pieces run alone (`trireme scheduler`,
`frontend`, `workers`), each keeping its own --log-file while following the scheduler's
other settings."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, _get, free_port, start_server, wait_until
from tritonclient.utils import InferenceServerException

WAIT_S = 30.0
LOG_FILE_TEXT = "log file location can not be updated through network protocol"

MODEL_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tag = request.request_id()
            pb_utils.Logger.log_info(f"model-info {tag}")
            pb_utils.Logger.log_warn(f"model-warning {tag}")
            pb_utils.Logger.log_verbose(f"model-verbose {tag}")
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
'''
CONFIG = """backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]
output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""

# Triton's prefixes (triton common src/logging.cc LogPreamble): pid, file:line, message
DEFAULT_LINE = re.compile(r"^([IWE])\d{4} \d\d:\d\d:\d\d\.\d{6} (\d+) ([^ :]+):\d+\] (.*)$")
ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ([IWE]) (\d+) ([^ :]+):\d+\] (.*)$")


def repository(tmp: Path) -> Path:
    repo = tmp / "models"
    (repo / "logger" / "1").mkdir(parents=True)
    (repo / "logger" / "config.pbtxt").write_text(CONFIG)
    (repo / "logger" / "1" / "model.py").write_text(MODEL_PY)
    return repo


def records(path: Path, pattern: re.Pattern) -> list[tuple[str, int, str, str]]:
    """(level letter, pid, file, message) of every line of ``path`` in that format (a table,
    written unescaped as Triton writes its tables, is not a message line: left out)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        hit = pattern.match(line)
        if hit and hit.group(4).startswith('"'):
            out.append((hit.group(1), int(hit.group(2)), hit.group(3),
                        json.loads(hit.group(4))))
    return out


def settings_lines(path: Path, pattern: re.Pattern) -> dict[int, list[dict]]:
    """pid -> the settings each "log settings" verbose line of that pid shows."""
    out: dict[int, list[dict]] = {}
    for _, pid, _, text in records(path, pattern):
        if text.startswith("log settings: "):
            out.setdefault(pid, []).append(json.loads(text[len("log settings: "):]))
    return out


def worker_pid(pids) -> int:
    for pid in pids:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
            if "trireme worker " in cmd or "services.workers.main" in cmd:
                return pid
        except psutil.NoSuchProcess:
            pass
    raise AssertionError("no worker process")


def infer(url: str, tag: str) -> None:
    c = httpclient.InferenceServerClient(url)
    try:
        inp = httpclient.InferInput("IN", [1], "FP32")
        inp.set_data_from_numpy(np.array([1.5], np.float32))
        assert c.infer("logger", [inp], request_id=tag).as_numpy("OUT")[0] == 1.5
    finally:
        c.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logging")
    log_file = tmp / "trireme.log"
    with start_server(repository(tmp), "--log-file", str(log_file), frontends=2) as srv:
        yield srv, log_file


@pytest.fixture
def server(served):
    """The module's server, its settings back to their start after each test."""
    srv, log_file = served
    yield srv, log_file
    c = httpclient.InferenceServerClient(srv.http_url)
    c.update_log_settings({"log_info": True, "log_warning": True, "log_error": True,
                           "log_verbose_level": 0, "log_format": "default"})
    c.close()


def test_get_and_update_with_tritonclient(server):
    srv, log_file = server
    start = {"log_file": str(log_file), "log_info": True, "log_warning": True,
             "log_error": True, "log_verbose_level": 0, "log_format": "default"}
    http = httpclient.InferenceServerClient(srv.http_url)
    grpc_ = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert "logging" in http.get_server_metadata()["extensions"]
        assert "logging" in grpc_.get_server_metadata().extensions
        assert http.get_log_settings() == start
        assert grpc_.get_log_settings(as_json=True)["settings"] == {
            k: {"string_param" if isinstance(v, str) else "bool_param"
                if isinstance(v, bool) else "uint32_param": v} for k, v in start.items()}
        changed = {**start, "log_warning": False, "log_verbose_level": 2}
        assert http.update_log_settings({"log_warning": False, "log_verbose_level": 2}) == changed
        grpc_answer = grpc_.update_log_settings({"log_format": "ISO8601", "log_error": False},
                                                as_json=True)["settings"]
        changed = {**changed, "log_format": "ISO8601", "log_error": False}
        assert {k: next(iter(v.values())) for k, v in grpc_answer.items()} == changed
        # one source of truth, the scheduler: the update through gRPC shows over HTTP
        assert http.get_log_settings() == changed
        # errors in Triton's words; a refused update changes nothing
        with pytest.raises(InferenceServerException) as info:
            http.update_log_settings({"log_file": "elsewhere.log"})
        assert LOG_FILE_TEXT in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            http.update_log_settings({"log_info": False, "log_format": "iso"})
        assert "invalid argument for --log_format, got: iso" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            grpc_.update_log_settings({"log_file": "elsewhere.log"})
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert LOG_FILE_TEXT in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            grpc_.update_log_settings({"log_info": False, "log_format": "iso"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message() == "invalid argument for log_format, got: iso"
        assert http.get_log_settings() == changed
    finally:
        http.close()
        grpc_.close()


def test_a_change_reaches_every_process(server):
    """The scheduler, both frontends and the model's worker each write a verbose line with
    the settings they run with, in the new format, to the one log file; the model's own
    lines follow the switches."""
    srv, log_file = server
    frontends, scheduler = srv.frontend_pids(), srv.proc.pid
    worker = worker_pid(srv.family())
    everyone = {scheduler, worker, *frontends}
    assert len(frontends) == 2
    http = httpclient.InferenceServerClient(srv.http_url)
    grpc_ = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        infer(srv.http_url, "before")
        assert [r[0] for r in records(log_file, DEFAULT_LINE)
                if r[3] in ("model-info before", "model-warning before")] == ["I", "W"]
        assert not [r for r in records(log_file, DEFAULT_LINE) if r[3] == "model-verbose before"]

        http.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
        wait_until(lambda: everyone <= {pid for pid, seen in settings_lines(log_file, ISO_LINE)
                                        .items() if seen[-1]["log_verbose_level"] == 1},
                   WAIT_S, "every process to write its settings in ISO8601")
        infer(srv.http_url, "iso")   # the worker has the settings before the request
        model = {r[3]: r[:2] for r in records(log_file, ISO_LINE) if r[3].endswith(" iso")}
        assert model == {"model-info iso": ("I", worker), "model-warning iso": ("W", worker),
                         "model-verbose iso": ("I", worker)}

        grpc_.update_log_settings({"log_info": False, "log_format": "default"})
        wait_until(lambda: everyone <= {pid for pid, seen in settings_lines(log_file, DEFAULT_LINE)
                                        .items() if seen[-1]["log_info"] is False},
                   WAIT_S, "every process to write its settings in the default format")
        infer(srv.http_url, "quiet")
        model = {r[3]: r[:2] for r in records(log_file, DEFAULT_LINE) if r[3].endswith(" quiet")}
        # info off, verbose still on: Triton writes verbose lines as "I" lines regardless
        assert model == {"model-warning quiet": ("W", worker),
                         "model-verbose quiet": ("I", worker)}
        # every line any process wrote to the file is one of Triton's two formats, or a row
        # of a table (the model table after start-up), as Triton writes its tables
        lines = log_file.read_text(errors="replace").splitlines()
        assert lines and all(DEFAULT_LINE.match(x) or ISO_LINE.match(x) or x.startswith(("+", "|"))
                             for x in lines), [x for x in lines if not (
                                 DEFAULT_LINE.match(x) or ISO_LINE.match(x) or x.startswith(("+", "|")))]
    finally:
        http.close()
        grpc_.close()


def test_flags_at_start(tmp_path):
    """Triton's QA (L0_logging): --log-info=false leaves "Started HTTPService" out of the
    file, and nothing goes to the console when there is a log file."""
    log_file = tmp_path / "flags.log"
    with start_server(repository(tmp_path), "--log-file", str(log_file), "--log-info=false",
                      "--log-verbose", "1", "--log-format", "ISO8601") as srv:
        c = httpclient.InferenceServerClient(srv.http_url)
        try:
            assert c.get_log_settings() == {
                "log_file": str(log_file), "log_info": False, "log_warning": True,
                "log_error": True, "log_verbose_level": 1, "log_format": "ISO8601"}
        finally:
            c.close()
        everyone = {srv.proc.pid, worker_pid(srv.family()), *srv.frontend_pids()}
        # each process wrote its settings at start (verbose), inherited from the scheduler
        seen = settings_lines(log_file, ISO_LINE)
        assert everyone <= set(seen)
        assert all(s[0]["log_info"] is False and s[0]["log_file"] == str(log_file)
                   for s in seen.values())
        infer(srv.http_url, "flags")
        text = log_file.read_text()
        assert "Started HTTPService" not in text and "model-info flags" not in text
        assert "model-warning flags" in text and "model-verbose flags" in text
        console = srv.log()
    assert not [x for x in console.splitlines() if DEFAULT_LINE.match(x) or ISO_LINE.match(x)]


def test_pieces_alone_keep_their_own_log_file(tmp_path):
    """`trireme scheduler`, `trireme frontend` and `trireme workers`, each with its own
    --log-file: a change through the frontend reaches all three (and the host's worker,
    which writes where its host does), each still writing to its own file."""
    repo = repository(tmp_path)
    fport, wport, http, grpc_, metrics = (free_port() for _ in range(5))
    files = {name: tmp_path / f"{name}.log" for name in ("scheduler", "frontend", "host")}
    console = open(tmp_path / "console.log", "wb")
    argv = {
        "scheduler": ["scheduler", "--model-repository", str(repo),
                      "--frontend-addr", f"stream://127.0.0.1:{fport}",
                      "--worker-addr", f"stream://127.0.0.1:{wport}",
                      "--metrics-port", str(metrics), "--host", "127.0.0.1"],
        "frontend": ["frontend", "--scheduler", f"stream://127.0.0.1:{fport}",
                     "--http-port", str(http), "--grpc-port", str(grpc_), "--host", "127.0.0.1",
                     "--log-verbose", "1"],   # its own until it hears the scheduler's
        "host": ["workers", "--scheduler", f"stream://127.0.0.1:{wport}", "--name", "h"],
    }
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args, "--log-file", str(files[name])],
        cwd=ROOT, stdout=console, stderr=subprocess.STDOUT) for name, args in argv.items()}
    try:
        url = f"127.0.0.1:{http}"
        wait_until(lambda: _get(f"http://{url}/v2/health/ready") == 200, 90, "ready")
        worker = worker_pid({c.pid for c in psutil.Process(procs["host"].pid).children()})
        c = httpclient.InferenceServerClient(url)
        try:
            # the frontend follows the scheduler's settings from its hello on
            assert c.get_log_settings()["log_verbose_level"] == 0
            assert c.get_log_settings()["log_file"] == str(files["scheduler"])
            c.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
        finally:
            c.close()
        expected = {"scheduler": {procs["scheduler"].pid}, "frontend": {procs["frontend"].pid},
                    "host": {procs["host"].pid, worker}}
        for name, pids in expected.items():
            wait_until(lambda name=name, pids=pids: pids <= set(
                settings_lines(files[name], ISO_LINE)), WAIT_S, f"{name}'s processes")
            for pid in pids:
                assert settings_lines(files[name], ISO_LINE)[pid][-1]["log_file"] == \
                    str(files[name])
        infer(url, "alone")
        assert any(r[3] == "model-verbose alone" and r[1] == worker
                   for r in records(files["host"], ISO_LINE))
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            assert p.wait(30) == 0, name
        console.close()
    lines = (tmp_path / "console.log").read_text(errors="replace").splitlines()
    assert not [x for x in lines if DEFAULT_LINE.match(x) or ISO_LINE.match(x)], lines
