"""`trireme analyze` (services/analyze) against a server it starts on a repository: a
small sweep of a batching Python model, its ranking, config.pbtxt, report and resume, and
its refusals. `trireme perf` does the measuring (tests/e2e/test_perf.py covers it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from google.protobuf import text_format
from models_python import python_model

from protos import model_config_pb2 as mc

IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''


def config(name: str, extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n'
            'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]\n' + extra)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("analyze") / "models"
    python_model(root, "ident", IDENTITY, config("ident"))
    python_model(root, "seq", IDENTITY, config("seq", "sequence_batching { }\n"))
    return root


def analyze(repo: Path, out: Path, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", "analyze", "--model-repository", str(repo),
           "--output", str(out), "--concurrency", "2", "-p", "300", "--max-trials", "4", *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(400)
def test_a_sweep_ranks_writes_and_resumes(repo, tmp_path):
    out = tmp_path / "out"
    flags = ("-m", "ident", "--instance-counts", "1", "--max-batch-sizes", "1,8",
             "--max-queue-delays-us", "100", "--latency-budget-ms", "1000")
    r = analyze(repo, out, *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((out / "results.json").read_text())
    keys = {"i1_mbs1_nodyn", "i1_mbs8_nodyn", "i1_mbs8_dyn100us"}
    assert set(results["variants"]) == keys
    for v in results["variants"].values():
        (level,) = v["levels"]
        assert level["concurrency"] == 2 and level["throughput"] > 0
        assert 0 < level["p50_us"] <= level["p99_us"]
        assert sum(v["batch_sizes"].values()) > 0   # the server ran it (nv_inference_batch_size)
    # The table: every configuration once, ranked by throughput
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"^\d+\s+i1_", line)]
    assert [row[1] for row in rows] and set(row[1] for row in rows) == keys
    tputs = [float(row[-3].replace(",", "")) for row in rows]   # (infer/s, p99 ms, stable)
    assert tputs == sorted(tputs, reverse=True)
    winner = rows[0][1]
    assert f"best: {winner}; wrote {out / 'config.pbtxt'}" in r.stdout
    # config.pbtxt: the winner's configuration, as Triton's text format
    cfg = text_format.Parse((out / "config.pbtxt").read_text(), mc.ModelConfig())
    want = results["variants"][winner]["variant"]
    assert cfg.name == "ident" and cfg.max_batch_size == want["max_batch_size"]
    assert cfg.instance_group[0].count == want["instances"]
    assert cfg.HasField("dynamic_batching") == want["dynamic"]
    report = (out / "report.html").read_text()
    assert report.count("src='data:image/png;base64,") == 3
    for png in ("throughput_vs_p99.png", "latency_breakdown.png", "batch_sizes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Again: everything is measured already, nothing runs again
    measured = {p.name: p.stat().st_mtime_ns for p in out.glob("*.csv")}
    again = analyze(repo, out, *flags)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming: 3 of 3 configurations already measured in {out / 'results.json'}" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.csv")} == measured
    # A budget nothing keeps: exit code 1, said so
    tight = analyze(repo, out, *flags[:-1], "0.001")
    assert tight.returncode == 1
    assert "no configuration keeps p99 within 0.001 ms" in tight.stdout


def test_refusals(repo, tmp_path):
    r = analyze(repo, tmp_path / "seq", "-m", "seq")
    assert r.returncode == 1
    assert r.stderr.strip() == ("error: 'seq': a sequence model's batching is its sequence "
                                "batcher's: not swept")
    r = analyze(repo, tmp_path / "none", "-m", "missing")
    assert r.returncode == 1
    assert r.stderr.strip() == "error: the repository has no model 'missing'"
    r = analyze(repo, tmp_path / "bad", "-m", "ident", "--instance-counts", "x")
    assert r.returncode == 2
    assert "argument --instance-counts: expected comma-separated integers, got 'x'" in r.stderr


def test_a_killed_analyze_takes_its_server_along(repo, tmp_path):
    import psutil
    from conftest import wait_until
    cmd = [sys.executable, "-m", "services.cli", "analyze", "--model-repository", str(repo),
           "--output", str(tmp_path / "out"), "-m", "ident", "--concurrency", "1", "-p", "300"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server = wait_until(lambda: psutil.Process(proc.pid).children(), 60, "its server")[0]
        family = [server, *server.children(recursive=True)]
    finally:
        proc.kill()
        proc.wait(30)
    wait_until(lambda: not [p for p in family if p.is_running()
                            and p.status() != psutil.STATUS_ZOMBIE], 30, "its server to exit")
