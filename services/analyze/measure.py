"""What `trireme analyze` measures against: the server (started here, or given), loading
a configuration through the repository API, one `trireme perf` run per concurrency (its
CSV read back), and the batch sizes the server ran (nv_inference_batch_size)."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.procutil import die_with_parent

START_TIMEOUT_S = 180.0
LOAD_TIMEOUT_S = 300.0


class AnalyzeError(Exception):
    """A failure the user is told in words (exit code 1)."""


@dataclass
class Level:
    """One concurrency of one configuration, as `trireme perf` measured it (µs, infer/s)."""
    concurrency: int
    throughput: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    client_send_us: float
    network_us: float
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    client_recv_us: float
    stable: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


class Target:
    """The server the sweep loads configurations into: `trireme serve` on the repository
    in explicit mode, started here, or the one at ``url`` (HTTP host:port; its gRPC and
    metrics ports are taken as the defaults' offsets: +1, +2)."""

    def __init__(self, repository: Path, model: str, url: str | None, log_path: Path) -> None:
        self.repository = repository
        self.model = model
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.given = bool(url)
        if url:
            host, _, port = url.rpartition(":")
            self.host, self.http_port = host or "127.0.0.1", int(port)
            self.grpc_port, self.metrics_port = self.http_port + 1, self.http_port + 2
        else:
            self.host = "127.0.0.1"
            self.http_port, self.grpc_port, self.metrics_port = _free_port(), _free_port(), _free_port()

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def start(self) -> None:
        if self.given or self.proc is not None:
            self._wait_ready()
            return
        cmd = [sys.executable, "-m", "services.cli", "serve", "--model-repository",
               str(self.repository), "--model-control-mode", "explicit", "--load-model",
               self.model, "--exit-on-error", "false", "--host", self.host,
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port)]
        parent = os.getpid()
        with open(self.log_path, "ab") as log:   # (a killed analyze takes its server along)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=lambda: die_with_parent(parent))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AnalyzeError(f"the server exited with code {self.proc.returncode} "
                                   f"(its log: {self.log_path})")
            if _get(f"http://{self.http}/v2/health/live", 2)[0] == 200:
                return
            time.sleep(0.2)   # (a server starting: nothing to wait on but its port)
        raise AnalyzeError(f"no server answered at {self.http} within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # ------------------------------------------------------------------ the model
    def ensure_loaded(self) -> None:
        """The model READY as the repository has it: loaded by the server started here, or
        asked of the user's server."""
        ready = f"http://{self.http}/v2/models/{self.model}/ready"
        if self.given and _get(ready)[0] != 200:
            self.load(None)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while _get(ready)[0] != 200:
            if self.proc is not None and self.proc.poll() is not None:
                raise AnalyzeError(f"the server exited with code {self.proc.returncode} "
                                   f"(its log: {self.log_path})")
            self._check_index()
            if time.monotonic() > deadline:
                raise AnalyzeError(f"'{self.model}' was not ready within {LOAD_TIMEOUT_S:.0f} s "
                                   f"(the server's log: {self.log_path})")
            time.sleep(0.2)   # (a model loading: nothing to wait on but its readiness)

    def _check_index(self) -> None:
        """Fail now when the repository index says the model will not become ready."""
        req = urllib.request.Request(f"http://{self.http}/v2/repository/index", data=b"{}",
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                index = json.loads(r.read())
        except (OSError, ValueError):
            return   # (still starting: asked again on the next turn)
        entries = [e for e in index if e.get("name") == self.model]
        if not entries:
            raise AnalyzeError(f"the repository has no model '{self.model}'")
        failed = [e for e in entries if e.get("state") == "UNAVAILABLE" and e.get("reason")]
        if failed and len(failed) == len(entries):
            raise AnalyzeError(f"'{self.model}' failed to load: {failed[0]['reason']}")

    def base_config(self) -> dict[str, Any]:
        code, body = _get(f"http://{self.http}/v2/models/{self.model}/config")
        if code != 200:
            raise AnalyzeError(f"the server has no configuration of '{self.model}' "
                               f"(HTTP {code}): {_error_text(body)}")
        return dict(json.loads(body))

    def load(self, config: dict[str, Any] | None) -> None:
        """Load the model with ``config`` (the repository API's override; None: the
        repository's own) and wait for it."""
        body = json.dumps({"parameters": {"config": json.dumps(config)}} if config is not None
                          else {}).encode()
        req = urllib.request.Request(f"http://{self.http}/v2/repository/models/{self.model}/load",
                                     data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=LOAD_TIMEOUT_S) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise AnalyzeError(f"loading '{self.model}' with this configuration failed "
                               f"(HTTP {e.code}): {_error_text(e.read())}") from None
        except OSError as e:
            raise AnalyzeError(f"loading '{self.model}' failed: {e}") from None

    def batch_sizes(self) -> dict[int, int]:
        """Executions so far by batch-size bucket (nv_inference_batch_size: a bucket's
        count is of executions whose size is at most its bound, above the previous)."""
        code, body = _get(f"http://{self.host}:{self.metrics_port}/metrics")
        if code != 200:
            return {}
        cumulative: dict[int, int] = {}
        pattern = re.compile(r'^nv_inference_batch_size_bucket\{(.*)\} (\S+)$')
        for line in body.decode(errors="replace").splitlines():
            m = pattern.match(line)
            if m is None or f'model="{self.model}"' not in m.group(1):
                continue
            le = re.search(r'le="([^"]+)"', m.group(1))
            if le is None or le.group(1) == "+Inf":
                continue
            bound = int(float(le.group(1)))
            cumulative[bound] = cumulative.get(bound, 0) + int(float(m.group(2)))
        out, below = {}, 0
        for bound in sorted(cumulative):
            out[bound] = cumulative[bound] - below
            below = cumulative[bound]
        return out


def _error_text(body: bytes) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body)["error"])
    return body.decode(errors="replace")[:300]


# ---------------------------------------------------------------------- trireme perf

_COLUMNS = {   # perf_analyzer's CSV header -> Level field
    "Inferences/Second": "throughput", "p50 latency": "p50_us", "p90 latency": "p90_us",
    "p95 latency": "p95_us", "p99 latency": "p99_us", "Client Send": "client_send_us",
    "Network+Server Send/Recv": "network_us", "Server Queue": "queue_us",
    "Server Compute Input": "compute_input_us", "Server Compute Infer": "compute_infer_us",
    "Server Compute Output": "compute_output_us", "Client Recv": "client_recv_us",
}


UNSTABLE_RETRY_PCT = 30   # a level that did not stabilise is measured again this loosely


def run_perf(target: Target, concurrency: int, protocol: str, interval_ms: int,
             max_trials: int, extra: list[str], csv_path: Path) -> Level | None:
    """`trireme perf` at one concurrency. A level that does not stabilise (its exit code
    2) is measured again with windows twice as long and a looser stability rule, its
    figures marked unstable; None when it still does not."""
    level = _perf(target, concurrency, protocol, interval_ms, max_trials, extra, csv_path)
    if level is None:
        level = _perf(target, concurrency, protocol, interval_ms * 2, max_trials, extra
                      + ["-s", str(UNSTABLE_RETRY_PCT)], csv_path)
        if level is not None:
            level.stable = False
    return level


def _perf(target: Target, concurrency: int, protocol: str, interval_ms: int,
          max_trials: int, extra: list[str], csv_path: Path) -> Level | None:
    url = target.grpc if protocol == "grpc" else target.http
    cmd = [sys.executable, "-m", "services.cli", "perf", "-m", target.model, "-u", url,
           "-i", protocol, "--concurrency-range", f"{concurrency}:{concurrency}",
           "-p", str(interval_ms), "--max-trials", str(max_trials), "-f", str(csv_path), *extra]
    csv_path.unlink(missing_ok=True)
    timeout = 60 + max_trials * interval_ms / 1000 * 3
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AnalyzeError(f"trireme perf did not finish within {timeout:.0f} s") from None
    if r.returncode == 2 and not csv_path.exists():
        return None
    if r.returncode not in (0, 2) or not csv_path.exists():
        tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-3:]
        raise AnalyzeError(f"trireme perf failed (exit code {r.returncode}): " + " / ".join(tail))
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise AnalyzeError(f"trireme perf wrote no measurement to {csv_path}")
    row = rows[0]
    values = {field: float(row.get(col) or 0.0) for col, field in _COLUMNS.items()}
    return Level(concurrency=concurrency, stable=r.returncode == 0, **values)
