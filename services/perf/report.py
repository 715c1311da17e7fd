"""What perf_analyzer prints, in its words and order: the measurement settings, each
level's client and server sections, the summary table; and its -f CSV (columns in its
order, rows by increasing throughput). Integer microseconds are ns // 1000 as it does;
throughputs print as C++'s default stream format (%g)."""
from __future__ import annotations

import sys
from typing import TextIO

from services.perf.flags import NO_LIMIT, PerfSettings
from services.perf.model import ModelInfo
from services.perf.profiler import PerfStatus
from services.perf.server_stats import ServerStats

CPU_WARN_SHARE = 0.9   # the client used this share of its processes' cores: it may be the limit
DELAY_PCT_THRESHOLD = 1.0   # % of requests sent late before the warning (perf_analyzer's)


def _us(ns: int, count: int = 1) -> int:
    return ns // (count * 1000) if count else 0


def settings(s: PerfSettings, model: ModelInfo, processes: int, out: TextIO = sys.stdout,
             lean: bool = False) -> None:
    p = lambda text: print(text, file=out)   # noqa: E731
    p("*** Measurement Settings ***")
    p(f"  Batch size: {s.batch_size}")
    p("  Service Kind: TRITON")
    if s.warmup_request_count > 0:
        p(f"  Sending {s.warmup_request_count} warmup request"
          f"{'s' if s.warmup_request_count > 1 else ''}")
    if s.request_count:
        p(f"  Sending {s.request_count} benchmark request{'s' if s.request_count > 1 else ''}")
    else:
        p(f"  Using \"{s.measurement_mode}\" mode for stabilization")
        metric = "throughput" if s.async_mode else "latency and throughput"
        p(f"  Stabilizing using average {metric}" if s.percentile == -1 else
          f"  Stabilizing using p{s.percentile} {metric}")
        if s.measurement_mode == "time_windows":
            p(f"  Measurement window: {s.measurement_interval_ms} msec")
        else:
            p(f"  Minimum number of samples in each window: {s.measurement_request_count}")
    if s.load_mode == "concurrency" and s.concurrency_range[1] != 1:
        p(f"  Latency limit: {s.latency_threshold_ms} msec")
        if s.concurrency_range[1] != NO_LIMIT:
            p(f"  Concurrency limit: {max(s.concurrency_range[0], s.concurrency_range[1])} "
              "concurrent requests")
    if s.load_mode == "request_rate":
        if s.rate_range[1] != 1.0:
            p(f"  Latency limit: {s.latency_threshold_ms} msec")
            if s.rate_range[1] != NO_LIMIT:
                p(f"  Request Rate limit: {max(s.rate_range[0], s.rate_range[1]):g} requests "
                  "per seconds")
        p("  Using poisson distribution on request generation" if s.distribution == "poisson"
          else "  Using uniform distribution on request generation")
    if s.binary_search:
        p("  Using Binary Search algorithm")
    p("  Using asynchronous calls for inference" if s.async_mode else
      "  Using synchronous calls for inference")
    if model.decoupled:
        p("  Detected decoupled model, using the first response for measuring latency")
    p(f"  Load generator: {processes} process{'es' if processes > 1 else ''}, "
      + ("lean (requests encoded once, our own connections)" if lean else "tritonclient"))
    p("")


def _client(st: PerfStatus, s: PerfSettings, model: ModelInfo, p) -> None:
    c = st.client
    p("  Client: ")
    p(f"    Request count: {c.request_count}")
    if c.request_count and c.delayed_count / c.request_count * 100 > DELAY_PCT_THRESHOLD:
        p(f"    Avg send request rate: {c.sent / (c.duration_ns / 1e9):.2f} infer/sec")
        p("    [WARNING] Perf Analyzer was not able to keep up with the desired request rate. "
          f"{c.delayed_count / c.request_count * 100:.2f}% of the requests were delayed. ")
    if model.is_sequence:
        p(f"    Sequence count: {c.sequence_count} ({c.sequence_per_sec:g} seq/sec)")
    p(f"    Throughput: {c.infer_per_sec:g} infer/sec")
    if model.decoupled:
        p(f"    Response Throughput: {c.responses_per_sec:g} infer/sec")
    if s.percentile == -1:
        p(f"    Avg latency: {c.avg_latency_ns // 1000} usec (standard deviation {c.std_us} usec)")
    for pct, ns in c.percentiles.items():
        p(f"    p{pct} latency: {ns // 1000} usec")
    req, send, recv = c.avg_request_ns // 1000, c.avg_send_ns // 1000, c.avg_recv_ns // 1000
    wait = max(0, req - send - recv)
    if s.protocol == "grpc":
        split = (f"marshal {send} usec + response wait {wait} usec + unmarshal {recv} usec"
                 if s.verbose else
                 f"(un)marshal request/response {send + recv} usec + response wait {wait} usec")
        p(f"    Avg gRPC time: {req} usec ({split})")
    else:
        split = (f"send {send} usec + response wait {wait} usec + receive {recv} usec"
                 if s.verbose else f"send/recv {send + recv} usec + response wait {wait} usec")
        p(f"    Avg HTTP time: {req} usec ({split})")
    secs = c.duration_ns / 1e9
    per_req = c.cpu_s / c.request_count * 1e6 if c.request_count else 0.0
    share = c.cpu_s / secs if secs else 0.0
    p(f"    Client CPU: {per_req:.0f} usec per request ({share * 100:.1f}% of a core, "
      f"{st.processes} load process{'es' if st.processes > 1 else ''})")


def _server(stats: ServerStats, model: ModelInfo, p, level: int = 1) -> None:
    ident = " " * (2 * level)
    cnt = stats.success_count
    if cnt == 0:
        p(f"{ident}  Request count: {cnt}")
        return
    cumm = _us(stats.cumm_time_ns, cnt)
    p(f"{ident}  Inference count: {stats.inference_count}")
    p(f"{ident}  Execution count: {stats.execution_count}")
    if model.response_cache:
        p(f"{ident}  Cache hit count: {stats.cache_hit_count}")
        p(f"{ident}  Cache miss count: {stats.cache_miss_count}")
    p(f"{ident}  Successful request count: {cnt}")
    line = f"{ident}  Avg request latency: {cumm} usec"
    if not stats.composing:
        queue = _us(stats.queue_time_ns, stats.queue_count)
        c_in = _us(stats.compute_input_time_ns, stats.compute_input_count)
        c_infer = _us(stats.compute_infer_time_ns, stats.compute_infer_count)
        c_out = _us(stats.compute_output_time_ns, stats.compute_output_count)
        compute_ns = stats.compute_input_time_ns + stats.compute_infer_time_ns + \
            stats.compute_output_time_ns
        compute = _us(compute_ns, stats.compute_input_count)
        if model.response_cache:
            combined = _us(stats.cache_hit_time_ns + stats.cache_miss_time_ns + compute_ns,
                           stats.compute_input_count + stats.cache_hit_count)
            p(f"{line} (overhead {max(0, cumm - queue - combined)} usec + queue {queue} usec + "
              f"cache hit/miss {combined} usec)")
            p(f"{ident}{ident}  Average Cache Hit Latency: "
              f"{_us(stats.cache_hit_time_ns, stats.cache_hit_count)} usec")
            miss = _us(stats.cache_miss_time_ns, stats.cache_miss_count)
            p(f"{ident}{ident}  Average Cache Miss Latency: {miss + compute} usec (cache "
              f"lookup/insertion {miss} usec + compute input {c_in} usec + compute infer "
              f"{c_infer} usec + compute output {c_out} usec)")
        else:
            p(f"{line} (overhead {max(0, cumm - queue - compute)} usec + queue {queue} usec + "
              f"compute input {c_in} usec + compute infer {c_infer} usec + compute output "
              f"{c_out} usec)")
        return
    queue, compute = _ensemble_times(stats)
    p(f"{line} (overhead {max(0, cumm - queue - compute)} usec + queue {queue} usec + "
      f"compute {compute} usec)")
    p("")
    p(f"{ident}Composing models: ")
    for (name, version), sub in stats.composing.items():
        p(f"{ident}{name}, version: {version}")
        _server(sub, model, p, level + 1)


def _ensemble_times(stats: ServerStats) -> tuple[int, int]:
    """(queue, compute) averages summed over the composing models, nested ensembles included."""
    queue = compute = 0
    for sub in stats.composing.values():
        if sub.composing:
            q, c = _ensemble_times(sub)
        else:
            q = _us(sub.queue_time_ns, sub.queue_count)
            c = _us(sub.compute_input_time_ns + sub.compute_infer_time_ns +
                    sub.compute_output_time_ns, sub.compute_input_count)
        queue, compute = queue + q, compute + c
    return queue, compute


def _metrics(m: dict[str, dict[str, float]], p) -> None:
    p("  Server Prometheus Metrics: ")
    p("    Avg GPU Utilization:")
    for gpu, v in m["gpu_utilization"].items():
        p(f"      {gpu} : {v * 100.0:g}%")
    p("    Avg GPU Power Usage:")
    for gpu, v in m["gpu_power_usage"].items():
        p(f"      {gpu} : {v:g} watts")
    p("    Max GPU Memory Usage:")
    for gpu, v in m["gpu_memory_used"].items():
        p(f"      {gpu} : {v:.0f} bytes")
    p("    Total GPU Memory:")
    for gpu, v in m["gpu_memory_total"].items():
        p(f"      {gpu} : {v:.0f} bytes")


def level(st: PerfStatus, s: PerfSettings, model: ModelInfo, out: TextIO = sys.stdout) -> None:
    p = lambda text: print(text, file=out)   # noqa: E731
    _client(st, s, model, p)
    if st.server is not None:
        p("  Server: ")
        _server(st.server, model, p)
    if st.metrics is not None:
        _metrics(st.metrics, p)
    secs = st.client.duration_ns / 1e9
    if secs and st.client.cpu_s / secs >= CPU_WARN_SHARE * st.processes:
        p("[WARNING] Perf Analyzer is not able to keep up with the desired load. The results "
          "may not be accurate.")
    out.flush()


def summary(statuses: list[PerfStatus], s: PerfSettings, out: TextIO = sys.stdout) -> None:
    if not statuses:
        return
    p = lambda text: print(text, file=out)   # noqa: E731
    p("Inferences/Second vs. Client " + ("Average Batch Latency" if s.percentile == -1
                                         else f"p{s.percentile} Batch Latency"))
    for st in statuses:
        head = f"Concurrency: {st.concurrency}" if s.load_mode == "concurrency" \
            else f"Request Rate: {st.request_rate:g}"
        p(f"{head}, throughput: {st.client.infer_per_sec:g} infer/sec, latency "
          f"{st.stabilizing_latency_ns // 1000} usec")
    out.flush()


def csv_header(statuses: list[PerfStatus], s: PerfSettings, model: ModelInfo) -> list[str]:
    cols = ["Concurrency" if s.load_mode == "concurrency" else "Request Rate", "Inferences/Second"]
    if model.decoupled:
        cols.append("Response Throughput")
    cols.append("Client Send")
    if statuses[0].server is not None:
        cols += ["Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                 "Server Compute Infer", "Server Compute Output"]
        if model.response_cache:
            cols += ["Server Cache Hit", "Server Cache Miss"]
    cols.append("Client Recv")
    cols += [f"p{pct} latency" for pct in statuses[0].client.percentiles]
    if s.verbose_csv:
        if s.percentile == -1:
            cols.append("Avg latency")
        cols += ["request/response", "response wait"]
        if s.collect_metrics:
            cols += ["Avg GPU Utilization", "Avg GPU Power Usage", "Max GPU Memory Usage",
                     "Total GPU Memory"]
    return cols


def _gpu_cell(values: dict[str, float]) -> str:
    return "".join(f"{gpu}:{v:g};" for gpu, v in values.items())


def csv_row(st: PerfStatus, s: PerfSettings, model: ModelInfo) -> list[str]:
    c, v = st.client, st.server
    row = [str(st.concurrency) if s.load_mode == "concurrency" else f"{st.request_rate:g}",
           f"{c.infer_per_sec:g}"]
    if model.decoupled:
        row.append(f"{c.responses_per_sec:g}")
    row.append(str(c.avg_send_ns // 1000))
    if v is not None:
        queue = v.queue_time_ns // v.queue_count if v.queue_count else 0
        n = v.compute_input_count
        c_in = v.compute_input_time_ns // n if n else 0
        c_infer = v.compute_infer_time_ns // v.compute_infer_count if v.compute_infer_count else 0
        c_out = v.compute_output_time_ns // v.compute_output_count if v.compute_output_count else 0
        compute = (v.compute_input_time_ns + v.compute_infer_time_ns + v.compute_output_time_ns) \
            // n if n else 0
        hit = v.cache_hit_time_ns // v.cache_hit_count if v.cache_hit_count else 0
        miss = v.cache_miss_time_ns // v.cache_miss_count if v.cache_miss_count else 0
        wait = max(0, c.avg_latency_ns - c.avg_send_ns - c.avg_recv_ns)
        network = max(0, wait - (queue + compute + hit + miss))
        row += [str(network // 1000), str(queue // 1000), str(c_in // 1000),
                str(c_infer // 1000), str(c_out // 1000)]
        if model.response_cache:
            row += [str(hit // 1000), str(miss // 1000)]
    row.append(str(c.avg_recv_ns // 1000))
    row += [str(ns // 1000) for ns in c.percentiles.values()]
    if s.verbose_csv:
        send, recv, req = c.avg_send_ns // 1000, c.avg_recv_ns // 1000, c.avg_request_ns // 1000
        if s.percentile == -1:
            row.append(str(c.avg_latency_ns // 1000))
        row += [str(send + recv), str(max(0, req - send - recv))]
        if s.collect_metrics:
            m = st.metrics or {"gpu_utilization": {}, "gpu_power_usage": {},
                               "gpu_memory_used": {}, "gpu_memory_total": {}}
            row += [_gpu_cell(m["gpu_utilization"]), _gpu_cell(m["gpu_power_usage"]),
                    _gpu_cell(m["gpu_memory_used"]), _gpu_cell(m["gpu_memory_total"])]
    return row


def write_csv(path: str, statuses: list[PerfStatus], s: PerfSettings, model: ModelInfo) -> None:
    """perf_analyzer's -f file."""
    if not statuses:
        return
    ordered = sorted(statuses, key=lambda st: st.client.infer_per_sec)
    with open(path, "w") as f:
        f.write(",".join(csv_header(statuses, s, model)) + "\n")
        for st in ordered:
            f.write(",".join(csv_row(st, s, model)) + "\n")
