"""Measurement windows and stability (perf_analyzer's InferenceProfiler).

Per level (a concurrency or a request rate): set the load, then measure back-to-back
windows (time_windows: 1.2 x -p ms, as perf_analyzer sleeps; count_windows: whole seconds
until --measurement-request-count requests ended). A window counts the requests that ENDED
in it; the server's statistics are read at its edges and diffed. The level is stable when
the last 3 windows' throughputs (and, unless only throughput is checked, stabilising
latencies: the average or --percentile) have max/min <= 1 + -s; its report merges those 3.
After --max-trials windows an unstable level ends the sweep; the first level unstable is
exit code 2.
"""
from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.perf import server_stats
from services.perf.flags import GENERIC_ERROR, NO_LIMIT, OPTION_ERROR, STABILITY_ERROR, PerfSettings
from services.perf.manager import LoadError, LoadManager
from services.perf.server_stats import ServerStats
from services.perf.worker_core import DELAYED, RECORD, SEQUENCE_END, now_ns

STABILITY_WINDOW = 3
PERCENTILES = (50, 90, 95, 99)
STATS_CATCH_UP_S = 2.0


class ProfileError(Exception):
    """Ends the run with perf_analyzer's exit code for it."""

    def __init__(self, message: str, code: int = GENERIC_ERROR) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ClientStats:
    request_count: int = 0
    response_count: int = 0
    sequence_count: int = 0
    delayed_count: int = 0
    duration_ns: int = 0
    latencies: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    avg_latency_ns: int = 0
    std_us: int = 0
    percentiles: dict[int, int] = field(default_factory=dict)
    infer_per_sec: float = 0.0
    responses_per_sec: float = 0.0
    sequence_per_sec: float = 0.0
    avg_request_ns: int = 0
    avg_send_ns: int = 0
    avg_recv_ns: int = 0
    cpu_s: float = 0.0           # the client's CPU (every load process and this one)
    sent: int = 0                # requests started in the window (send rate)


@dataclass
class PerfStatus:
    concurrency: int = 0
    request_rate: float = 0.0
    batch_size: int = 1
    client: ClientStats = field(default_factory=ClientStats)
    server: ServerStats | None = None
    stabilizing_latency_ns: int = 0
    metrics: dict[str, dict[str, float]] | None = None
    metric_samples: list = field(default_factory=list)
    processes: int = 1


def summarize_latency(lat: np.ndarray, percentile: int) -> tuple[int, int, dict[int, int], int]:
    """(average ns, sample std us, {percentile: ns}, stabilising latency ns) of sorted latencies."""
    n = len(lat)
    if n == 0:
        raise ProfileError("No valid requests recorded within time interval. Please use a "
                           "larger time window.", OPTION_ERROR)
    avg = int(lat.sum() // n)
    std = int(math.sqrt(float(((lat - avg).astype(np.float64) ** 2).sum()) / (n - 1)) / 1000) \
        if n > 1 else 2**64 - 1
    wanted = sorted(set(PERCENTILES) | ({percentile} if percentile != -1 else set()))
    pct = {p: int(lat[int((p / 100.0) * (n - 1) + 0.5)]) for p in wanted}
    return avg, std, pct, (pct[percentile] if percentile != -1 else avg)


def is_stable(ips: list[float], latencies: list[float], threshold: float,
               check_latency: bool = True) -> bool:
    """perf_analyzer's rule: the last 3 windows all measured (a window without requests has
    throughput 0), their throughputs' max/min <= 1 + threshold, and so their latencies."""
    if len(ips) < STABILITY_WINDOW:
        return False
    last_ips, last_lat = ips[-STABILITY_WINDOW:], latencies[-STABILITY_WINDOW:]
    if min(last_ips) == 0:
        return False
    ok = max(last_ips) / min(last_ips) <= 1 + threshold
    if check_latency:
        ok = ok and max(last_lat) / max(min(last_lat), 1e-9) <= 1 + threshold
    return ok


def over_threshold(latencies: list[float], limit_ms: int) -> bool:
    """A latency limit is set and one of the last 3 windows' latencies (ns) reached it."""
    return limit_ms != NO_LIMIT and len(latencies) >= STABILITY_WINDOW and \
        any(v >= limit_ms * 1e6 for v in latencies[-STABILITY_WINDOW:])


def client_stats(rows: np.ndarray, duration_ns: int, batch: int, cpu_s: float, sent: int) -> ClientStats:
    c = ClientStats(request_count=len(rows), duration_ns=duration_ns, cpu_s=cpu_s, sent=sent)
    c.latencies = np.sort(rows["end"] - rows["start"])
    c.response_count = int(rows["responses"].sum())
    c.sequence_count = int(((rows["flags"] & SEQUENCE_END) != 0).sum())
    c.delayed_count = int(((rows["flags"] & DELAYED) != 0).sum())
    secs = duration_ns / 1e9
    c.infer_per_sec = len(rows) * batch / secs if secs else 0.0
    c.responses_per_sec = c.response_count / secs if secs else 0.0
    c.sequence_per_sec = c.sequence_count / secs if secs else 0.0
    if len(rows):
        c.avg_request_ns = int(c.latencies.sum() // len(rows))
        c.avg_send_ns = int(rows["send"].sum() // len(rows))
        c.avg_recv_ns = int(rows["recv"].sum() // len(rows))
    return c


class Profiler:
    def __init__(self, s: PerfSettings, manager: LoadManager, stats_reader: Callable | None,
                 stats_diff: Callable | None, sampler: server_stats.MetricsSampler | None,
                 report: Callable[[PerfStatus], None], clock: Callable[[], int] = now_ns,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.s = s
        self.clock = clock                  # ns, the load processes' clock
        self.sleep = sleep
        self.manager = manager
        self.read_stats = stats_reader      # () -> snapshot; None: no server statistics
        self.diff_stats = stats_diff        # (start, end) -> ServerStats
        self.sampler = sampler
        self.report = report
        self.statuses: list[PerfStatus] = []
        self._pending = np.empty(0, RECORD)
        self._prev: tuple[int, object, float, int] | None = None   # (end ns, stats, cpu, sent)

    def _log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    # ---- one window
    def _edges(self) -> tuple[object, float, int]:
        snap = self.read_stats() if self.read_stats else None
        got = self.manager.collect()
        if got["error"]:
            raise ProfileError(got["error"])
        self._pending = np.concatenate([self._pending, got["records"]])
        return snap, got["cpu"], got["sent"]

    def _wait_window(self, start_count: int) -> None:
        s = self.s
        if s.measurement_mode == "time_windows":
            deadline = self.clock() + s.measurement_interval_ms * 1_200_000
            while (left := deadline - self.clock()) > 0:   # (a failed load ends it early)
                self.sleep(min(left / 1e9, 0.5))
                self.manager.count()
            return
        while True:
            self.sleep(1.0)
            if self.manager.count() - start_count >= s.measurement_request_count:
                return

    def measure(self, status: PerfStatus) -> PerfStatus:
        if self._prev is None:
            snap0, cpu0, sent0 = self._edges()
            start = self.clock()
        else:
            start, snap0, cpu0, sent0 = self._prev
        count0 = self.manager.count() if self.s.measurement_mode == "count_windows" else 0
        self._wait_window(count0)
        end = self.clock()
        snap1, cpu1, sent1 = self._edges()
        self._prev = (end, snap1, cpu1, sent1)
        return self._summarize(status, start, end, snap0, snap1, cpu1 - cpu0, sent1 - sent0)

    def _summarize(self, status: PerfStatus, start: int, end: int, snap0, snap1, cpu: float,
                   sent: int) -> PerfStatus:
        rows = self._pending
        inside = (rows["end"] >= start) & (rows["end"] <= end)
        self._pending = rows[rows["end"] > end]
        w = PerfStatus(status.concurrency, status.request_rate, self.s.batch_size,
                       processes=self.manager.processes)
        w.client = client_stats(rows[inside], end - start, self.s.batch_size, cpu, sent)
        w.client.avg_latency_ns, w.client.std_us, w.client.percentiles, w.stabilizing_latency_ns = \
            summarize_latency(w.client.latencies, self.s.percentile)
        if self.diff_stats is not None:
            w.server = self.diff_stats(snap0, snap1)
        if self.sampler is not None:
            w.metric_samples = self.sampler.take()
        return w

    # ---- one level
    def _helper(self, status: PerfStatus) -> tuple[PerfStatus, bool]:
        s = self.s
        self._pending = np.empty(0, RECORD)
        self._prev = None
        self.manager.collect()   # (the records of what came before: not this level's)
        if self.sampler is not None:
            self.sampler.take()
        windows: deque = deque(maxlen=STABILITY_WINDOW)
        ips: list[float] = []
        lat: list[float] = []
        stable = False
        for trial in range(s.max_trials):
            try:
                w = self.measure(status)
                windows.append((w, None))
                ips.append(w.client.infer_per_sec)
                lat.append(float(w.stabilizing_latency_ns))
                if s.verbose:
                    shown = (f"p{s.percentile} latency: {w.client.percentiles[s.percentile] // 1000} usec"
                             if s.percentile != -1 else
                             f"Avg latency: {w.client.avg_latency_ns // 1000} usec (std "
                             f"{w.client.std_us} usec). ")
                    print(f"  Pass [{trial + 1}] throughput: {w.client.infer_per_sec:g} "
                          f"infer/sec. {shown}", flush=True)
            except ProfileError as e:
                if e.code != OPTION_ERROR:
                    raise
                windows.append((None, e))
                ips.append(0.0)
                lat.append(float(2**64 - 1))
                if s.verbose:
                    print(f"  Pass [{trial + 1}] cb::Error: {e}", flush=True)
            stable = is_stable(ips, lat, s.stability)
            if stable or over_threshold(lat, s.latency_threshold_ms):
                break
        if s.async_mode and not stable and is_stable(ips, lat, s.stability, check_latency=False):
            self._log("Warning: Request latency is not stabilizing. Please try lowering the "
                      "request rate.")
            stable = True
        for _, err in windows:
            if err is not None:
                raise err
        if not stable:
            return status, False
        return self._merge(status, [w for w, _ in windows]), True

    def _merge(self, status: PerfStatus, windows: list[PerfStatus]) -> PerfStatus:
        out = PerfStatus(status.concurrency, status.request_rate, self.s.batch_size,
                         processes=self.manager.processes)
        c = out.client
        for w in windows:
            for f in ("request_count", "response_count", "sequence_count", "delayed_count",
                      "duration_ns", "sent"):
                setattr(c, f, getattr(c, f) + getattr(w.client, f))
            c.cpu_s += w.client.cpu_s
        n = c.request_count
        if n:
            for f in ("avg_request_ns", "avg_send_ns", "avg_recv_ns"):
                setattr(c, f, sum(getattr(w.client, f) * w.client.request_count
                                  for w in windows) // n)
        c.latencies = np.sort(np.concatenate([w.client.latencies for w in windows]))
        secs = c.duration_ns / 1e9
        c.infer_per_sec = n * self.s.batch_size / secs
        c.responses_per_sec = c.response_count / secs
        c.sequence_per_sec = c.sequence_count / secs
        c.avg_latency_ns, c.std_us, c.percentiles, out.stabilizing_latency_ns = \
            summarize_latency(c.latencies, self.s.percentile)
        if windows[0].server is not None:
            out.server = server_stats.merge([w.server for w in windows if w.server is not None])
        if self.sampler is not None:
            samples = [m for w in windows for m in w.metric_samples]
            out.metrics = server_stats.merge_metrics(samples)
        return out

    def _exact(self, status: PerfStatus, count: int) -> PerfStatus:
        """--request-count: one window from before the first request until the last ends."""
        self.manager.collect()
        self._pending = np.empty(0, RECORD)
        snap0, cpu0, sent0 = self._edges()
        base = self.manager.count()
        start = self.clock()
        self._set_load(status, count)
        while self.manager.count() - base < count:
            self.sleep(0.01)
        end = self.clock()
        snap1, cpu1, sent1 = self._edges()
        if self.read_stats is not None and self.diff_stats is not None:
            # (a server may count a request a moment after its response left: wait for it)
            deadline = self.clock() + STATS_CATCH_UP_S * 1e9
            while self.diff_stats(snap0, snap1).success_count < count and \
                    self.clock() < deadline:
                self.sleep(0.05)
                snap1 = self.read_stats()
        return self._summarize(status, start, end, snap0, snap1, cpu1 - cpu0, sent1 - sent0)

    def _set_load(self, status: PerfStatus, budget: int | None = None) -> None:
        if self.s.load_mode == "concurrency":
            self.manager.set_concurrency(status.concurrency, budget)
        else:
            self.manager.set_rate(status.request_rate, self.s.distribution, budget)

    def _warmup(self, status: PerfStatus) -> None:
        n = self.s.warmup_request_count
        if n <= 0:
            return
        base = self.manager.count()
        self._set_load(status, n)
        while self.manager.count() - base < n:
            self.sleep(0.01)
        self.manager.collect()

    def profile(self, value: float) -> tuple[bool, bool]:
        """Measure one level and report it; (meets the threshold, stable)."""
        s = self.s
        status = PerfStatus(batch_size=s.batch_size)
        if s.load_mode == "concurrency":
            status.concurrency = int(value)
        else:
            status.request_rate = value
        self._warmup(status)
        if s.load_mode == "concurrency":
            print(f"Request concurrency: {status.concurrency}", flush=True)
        else:
            print(f"Request Rate: {status.request_rate:g} inference requests per second",
                  flush=True)
        if s.request_count:
            merged, stable = self._exact(status, s.request_count), True
        else:
            self._set_load(status)
            merged, stable = self._helper(status)
        if stable and s.latency_threshold_ms != NO_LIMIT and \
                merged.stabilizing_latency_ns // 1_000_000 >= s.latency_threshold_ms:
            self._log(f"Measured latency went over the set limit of {s.latency_threshold_ms} msec. ")
            return False, stable
        if not stable:
            if s.load_mode == "request_rate":
                self._log("Failed to obtain stable measurement.")
            else:
                more = "--measurement-interval" if s.measurement_mode == "time_windows" \
                    else "--measurement-request-count"
                self._log(f"Failed to obtain stable measurement within {s.max_trials} "
                          f"measurement windows for concurrency {status.concurrency}. Please "
                          f"try to increase the {more}.")
            return False, False
        self.statuses.append(merged)
        self.report(merged)
        return True, True

    # ---- the sweep
    def run(self) -> None:
        s = self.s
        if s.load_mode == "concurrency":
            start, end, step = (float(v) for v in s.concurrency_range)
        else:
            start, end, step = s.rate_range
        if s.binary_search:
            self._binary(start, end, step)
            return
        value = start
        while True:
            meets, stable = self.profile(value)
            value += step
            if not ((value <= end or end == NO_LIMIT) and meets):
                break
        if value == start + step and not stable:
            raise ProfileError("Failed to obtain stable measurement.", STABILITY_ERROR)

    def _binary(self, start: float, end: float, step: float) -> None:
        whole = self.s.load_mode == "concurrency"
        meets, _ = self.profile(start)
        if not meets:
            return
        meets, _ = self.profile(end)
        if meets:
            return
        lo, hi = start, end
        while hi - lo > step:
            mid = (lo + hi) // 2 if whole else (lo + hi) / 2
            meets, _ = self.profile(mid)
            lo, hi = (mid, hi) if meets else (lo, mid)


__all__ = ["LoadError", "PerfStatus", "ProfileError", "Profiler"]
