"""The -f CSV (perf_analyzer's report_writer.cc): columns in its order, which ones appear
when, rows by increasing throughput, and its Network+Server arithmetic."""
from __future__ import annotations

import numpy as np

from services.perf import report
from services.perf.flags import PerfSettings
from services.perf.model import ModelInfo
from services.perf.profiler import ClientStats, PerfStatus
from services.perf.server_stats import ServerStats

BASE = ["Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv",
        "Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output",
        "Client Recv", "p50 latency", "p90 latency", "p95 latency", "p99 latency"]


def model(**kw) -> ModelInfo:
    return ModelInfo("m", "1", 8, [], [], "dynamic", **kw)


def status(concurrency: int, ips: float) -> PerfStatus:
    c = ClientStats(request_count=10, infer_per_sec=ips, avg_latency_ns=1_000_000,
                    avg_send_ns=20_000, avg_recv_ns=30_000, avg_request_ns=1_000_000,
                    latencies=np.array([1_000_000]),
                    percentiles={50: 900_000, 90: 1_100_000, 95: 1_200_000, 99: 1_500_000})
    srv = ServerStats(success_count=10, queue_count=10, queue_time_ns=1_000_000,
                      compute_input_count=10, compute_input_time_ns=500_000,
                      compute_infer_count=10, compute_infer_time_ns=3_000_000,
                      compute_output_count=10, compute_output_time_ns=500_000)
    return PerfStatus(concurrency=concurrency, client=c, server=srv)


def test_header_and_rows_as_perf_analyzer(tmp_path):
    s = PerfSettings(model="m")
    out = tmp_path / "r.csv"
    report.write_csv(str(out), [status(1, 200.5), status(2, 100.25)], s, model())
    lines = out.read_text().splitlines()
    assert lines[0].split(",") == BASE
    # sorted by throughput; network = wait (1000 - 20 - 30 us) - queue 100 - compute 400 us
    assert lines[1:] == ["2,100.25,20,450,100,50,300,50,30,900,1100,1200,1500",
                         "1,200.5,20,450,100,50,300,50,30,900,1100,1200,1500"]


def test_optional_columns():
    s = PerfSettings(model="m", load_mode="request_rate", verbose_csv=True, collect_metrics=True)
    cols = report.csv_header([status(1, 1.0)], s, model(decoupled=True, response_cache=True))
    assert cols[:3] == ["Request Rate", "Inferences/Second", "Response Throughput"]
    assert cols[cols.index("Server Compute Output") + 1:cols.index("Client Recv")] == \
        ["Server Cache Hit", "Server Cache Miss"]
    assert cols[-7:] == ["Avg latency", "request/response", "response wait",
                         "Avg GPU Utilization", "Avg GPU Power Usage", "Max GPU Memory Usage",
                         "Total GPU Memory"]
    no_server = status(1, 1.0)
    no_server.server = None
    assert "Server Queue" not in report.csv_header([no_server], PerfSettings(model="m"), model())
