"""The profiler's windows, stability rule and sweep (perf_analyzer's InferenceProfiler), driven
by a fake load on a fake clock: each window's throughput and latency are chosen by the test."""
from __future__ import annotations

import numpy as np
import pytest

from services.perf.flags import PerfSettings
from services.perf.profiler import ProfileError, Profiler, is_stable, over_threshold, summarize_latency
from services.perf.worker_core import RECORD


class FakeLoad:
    """LoadManager's interface. Requests end evenly at `shape(level, window)` = (per second,
    latency ns), window counting the collects (one per window edge) of the level."""

    processes = 1

    def __init__(self, shape) -> None:
        self.shape = shape
        self.t = 1_000_000_000
        self.level = 0
        self.window = 0
        self.budget: int | None = None
        self.completed = 0
        self.rows: list[tuple] = []

    def clock(self) -> int:
        return self.t

    def sleep(self, secs: float) -> None:
        per_s, latency = self.shape(self.level, self.window)
        step = int(1e9 / per_s) if per_s else 0
        end = self.t + int(secs * 1e9)
        t = self.t + step
        while step and t <= end and (self.budget is None or self.budget > 0):
            self.rows.append((t - latency, t, 1000, 2000, 1, 0))
            self.completed += 1
            if self.budget is not None:
                self.budget -= 1
            t += step
        self.t = end

    def set_concurrency(self, n: int, budget: int | None = None) -> None:
        if n != self.level:
            self.window = 0
        self.level, self.budget = n, budget

    def collect(self) -> dict:
        self.window += 1
        rows, self.rows = np.array(self.rows, dtype=RECORD), []
        return {"records": rows, "cpu": 0.0, "error": None, "sent": len(rows), "delayed": 0}

    def count(self) -> int:
        return self.completed


def run(shape, **settings) -> tuple[Profiler, list, FakeLoad]:
    s = PerfSettings(model="m", measurement_interval_ms=1000, **settings)
    load = FakeLoad(shape)
    reported: list = []
    p = Profiler(s, load, None, None, None, reported.append, clock=load.clock, sleep=load.sleep)
    p.run()
    return p, reported, load


def test_a_steady_level_is_stable_after_three_windows_and_merges_them():
    p, reported, load = run(lambda level, w: (1000, 2_000_000))
    assert len(reported) == 1
    st = reported[0]
    assert st.concurrency == 1
    assert st.client.request_count == pytest.approx(3 * 1200, abs=3)   # (1.2 x -p each)
    assert st.client.infer_per_sec == pytest.approx(1000, rel=0.01)
    assert st.client.avg_latency_ns == 2_000_000 and st.stabilizing_latency_ns == 2_000_000
    assert st.client.avg_send_ns == 1000 and st.client.avg_recv_ns == 2000
    assert load.window == 5   # (a drop of what came before, the first edge, 3 window ends)


def test_a_first_level_that_never_stabilises_is_exit_code_2():
    with pytest.raises(ProfileError) as e:
        run(lambda level, w: (100 if w % 2 else 1000, 1_000_000), max_trials=5)
    assert e.value.code == 2


def test_an_unstable_later_level_ends_the_sweep_without_an_error():
    p, reported, _ = run(lambda level, w: (1000 if level != 2 or w % 2 else 100, 1_000_000),
                         concurrency_range=(1, 3, 1), max_trials=4)
    assert [st.concurrency for st in reported] == [1]


def test_the_latency_threshold_ends_an_open_ended_sweep():
    # latency 1 ms per concurrency level: level 3 reaches the 3 ms limit
    p, reported, _ = run(lambda level, w: (1000, level * 1_000_000), concurrency_range=(1, 0, 1),
                         latency_threshold_ms=3)
    assert [st.concurrency for st in reported] == [1, 2]


def test_percentile_stabilises_on_that_percentile():
    p, reported, _ = run(lambda level, w: (1000, 5_000_000), percentile=95)
    assert reported[0].stabilizing_latency_ns == reported[0].client.percentiles[95]
    assert list(reported[0].client.percentiles) == [50, 90, 95, 99]


def test_binary_search_halves_towards_the_threshold():
    p, reported, _ = run(lambda level, w: (1000, level * 1_000_000), concurrency_range=(1, 16, 1),
                         binary_search=True, latency_threshold_ms=6)
    # 1 (meets), 16 (over), then 8 over, 4, 6 over, 5: the levels that met it are reported
    assert [st.concurrency for st in reported] == [1, 4, 5]


def test_request_count_measures_exactly_that_many():
    p, reported, _ = run(lambda level, w: (500, 1_000_000), request_count=25)
    assert reported[0].client.request_count == 25


def test_stability_rule():
    assert is_stable([100, 105, 109], [10, 10, 10], 0.10)
    assert not is_stable([100, 105, 111], [10, 10, 10], 0.10)
    assert not is_stable([100, 100, 100], [10, 10, 12], 0.10)
    assert is_stable([100, 100, 100], [10, 10, 12], 0.10, check_latency=False)
    assert not is_stable([100, 100], [10, 10], 0.10)
    assert not is_stable([0, 100, 100, 100][:3], [10, 10, 10], 10.0)
    assert over_threshold([1e6, 2e6, 5e6], 5) and not over_threshold([1e6, 2e6, 5e6], 0)


def test_percentiles_are_perf_analyzers_nearest_rank():
    lat = np.arange(1, 101, dtype=np.int64) * 1000   # 1..100 us
    avg, std, pct, stab = summarize_latency(lat, -1)
    # index = p/100 * (n - 1) + 0.5, truncated
    assert pct == {50: 51_000, 90: 90_000, 95: 95_000, 99: 99_000}
    assert avg == 50_500 and stab == avg and std == 29
    with pytest.raises(ProfileError) as e:
        summarize_latency(np.empty(0, np.int64), -1)
    assert e.value.code == 3 and "No valid requests" in str(e.value)
