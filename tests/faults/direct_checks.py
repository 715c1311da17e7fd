"""What the direct-path fault tests share: their Python models, a worker's pid, killing it
with requests queued at it, the statistics and metrics of models as comparable dicts, and
a data plane of the test's own on a running server."""
from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import tritonclient.http as httpclient
from conftest import wait_until
from tritonclient.utils import InferenceServerException
from unix_sockets import direct_path_of, queued_bytes

FAILER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("this model always fails")
'''

SLEEPER = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "started")

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()
            with open(self.marker, "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(float(seconds[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seconds)]))
        return responses
'''

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")
BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")


def worker(server, model: str) -> tuple[int, str]:
    """(pid, instance name) of the one worker titled 'trireme worker <instance> (<model> vN)'."""
    found = server.workers(model)
    assert len(found) == 1, f"workers of {model}: {found}"
    return found[0]


def started(repo: Path, model: str = "sleeper") -> int:
    """How many executions of a SLEEPER model have begun."""
    try:
        return len((repo / model / "started").read_text().splitlines())
    except FileNotFoundError:
        return 0


def kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: dead(pid), 10, f"pid {pid} to die")


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def answers(fn) -> bool:
    """Whether ``fn()`` got its answer (no InferenceServerException)."""
    try:
        fn()
        return True
    except InferenceServerException:
        return False


def canon(stat: dict) -> dict:
    def num(d: dict, key: str) -> int:
        return int(d.get(key, 0))

    def dur(d: dict) -> tuple[int, int]:
        return num(d, "count"), num(d, "ns")

    infer = stat.get("inference_stats", {})
    return {"inference_count": num(stat, "inference_count"),
            "execution_count": num(stat, "execution_count"),
            **{k: dur(infer.get(k, {})) for k in DURATIONS},
            "batch_stats": {num(b, "batch_size"): {k: dur(b.get(k, {})) for k in BATCH_DURATIONS}
                            for b in stat.get("batch_stats", [])}}


def stats(c, model: str) -> dict:
    (s,) = c.get_inference_statistics(model, "1")["model_stats"]
    return canon(s)


def delta(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    for k in DURATIONS:
        out[k] = (after[k][0] - before[k][0], after[k][1] - before[k][1])
    out["batch_stats"] = {}
    for bs, b in after["batch_stats"].items():
        prev = before["batch_stats"].get(bs, {})
        d = {k: (b[k][0] - prev.get(k, (0, 0))[0], b[k][1] - prev.get(k, (0, 0))[1])
             for k in BATCH_DURATIONS}
        if any(n for n, _ in d.values()):
            out["batch_stats"][bs] = d
    return out


def kill_while_queued(server, repo: Path, pid: int, request: Callable[[Any], None], n: int,
                      model: str = "sleeper") -> list[object]:
    """Send ``n`` requests (``request(client)``, each on a thread with an HTTP client of
    its own) that reach the SLEEPER model ``model`` served by worker ``pid``: the first runs
    there, the others queue unread on its direct connection; then kill -9 the worker.
    Returns each request's one answer: "ok" or its InferenceServerException."""
    path = direct_path_of(pid)
    results: list[list] = []

    def send() -> None:
        got: list = []
        results.append(got)
        c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        try:
            request(c)
            got.append("ok")
        except InferenceServerException as e:
            got.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
    n0 = started(repo, model)
    threads[0].start()
    wait_until(lambda: started(repo, model) > n0, 10, "the first request to run")
    # The worker runs it on its one loop: the others wait unread on its direct connection,
    # each adding to what is queued there.
    queued = queued_bytes(path)
    assert queued == 0
    for t in threads[1:]:
        t.start()
        wait_until(lambda q=queued: queued_bytes(path) > q, 10, "a request queued at the worker")
        queued = queued_bytes(path)
    assert started(repo, model) == n0 + 1 and all(t.is_alive() for t in threads), results
    kill_and_reap(pid)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hung after its worker died"
    assert len(results) == n and all(len(r) == 1 for r in results), results
    return [r[0] for r in results]


COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure",
            "nv_inference_count", "nv_inference_exec_count")


def scrape(server, models: tuple[str, ...]) -> dict[str, float]:
    """The COUNTERS series of ``models`` on the server's /metrics."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if name.split("{")[0] in COUNTERS and any(f'model="{m}"' in name for m in models):
                out[name] = float(value)
    return out


def snapshot(server, models: tuple[str, ...]) -> tuple[dict, dict]:
    """The statistics (canon) and metrics of ``models``."""
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    try:
        return {m: stats(c, m) for m in models}, scrape(server, models)
    finally:
        c.close()


def deltas(before: tuple[dict, dict], after: tuple[dict, dict]) -> tuple[dict, dict]:
    """What changed between two snapshots."""
    names = set(before[1]) | set(after[1])
    return ({m: delta(before[0][m], after[0][m]) for m in before[0]},
            {n: after[1].get(n, 0.0) - before[1].get(n, 0.0) for n in names})


@contextlib.asynccontextmanager
async def own_dataplane(server, name: str) -> AsyncIterator:
    """A DataPlane of this test's own on ``server``'s scheduler, ready (its models' routes
    can be tampered with before a request)."""
    from services.dataplane.client import DataPlane
    from services.dataplane.settings import DataPlaneSettings

    (run_dir,) = glob.glob(os.path.join(tempfile.gettempdir(), f"trireme-{server.proc.pid}-*"))
    dp = DataPlane(DataPlaneSettings(f"unix://{run_dir}/frontends.sock",
                                     result_addr=f"unix://{run_dir}/results-{name}.sock",
                                     use_shm=False))
    await dp.start()
    try:
        # the scheduler's answer to our hello (a repository change: it drops the cache)
        deadline = time.monotonic() + 10
        while not dp.ready():
            assert time.monotonic() < deadline, "the scheduler never answered"
            await asyncio.sleep(0.01)
        yield dp
    finally:
        dp.close()


def assert_same_statistics(d_stats: dict, s_stats: dict, ensembles: tuple[str, ...] = ()) -> None:
    """Two paths' statistics deltas (deltas()) agree field by field: every count equal, and
    a duration is there exactly where its count is. ``ensembles``: models whose queue and
    compute records are counted without durations (Triton sums its steps' there; docs/
    compat.md, "Not built yet")."""
    for model, d in d_stats.items():
        s = s_stats[model]
        assert (d["inference_count"], d["execution_count"]) == \
            (s["inference_count"], s["execution_count"]), (model, d, s)
        for k in DURATIONS:
            assert d[k][0] == s[k][0], (model, k, d[k], s[k])
            for got in (d, s):
                if model in ensembles and k in ("queue", "compute_input", "compute_infer",
                                                "compute_output"):
                    assert got[k][1] == 0, (model, k, got[k])
                else:
                    assert (got[k][1] > 0) == (got[k][0] > 0), (model, k, got[k])
        assert {bs: {k: n for k, (n, _) in b.items()} for bs, b in d["batch_stats"].items()} == \
            {bs: {k: n for k, (n, _) in b.items()} for bs, b in s["batch_stats"].items()}, \
            (model, d["batch_stats"], s["batch_stats"])
        for got in (d, s):
            for b in got["batch_stats"].values():
                for k, (n, ns) in b.items():
                    assert (ns > 0) == (n > 0 and model not in ensembles), (model, k, got["batch_stats"])
