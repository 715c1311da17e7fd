"""services.scheduler.metrics: /metrics text with Triton's names, help texts, types, labels,
buckets and quantiles (core/src/metrics.cc, metric_model_reporter.{h,cc}), for each
--metrics-config; driven through StatsRegistry and a fixed clock, no server."""
from __future__ import annotations

import math
import re

from google.protobuf import text_format

from protos import model_config_pb2 as mc
from services.scheduler.metrics import Metrics
from services.scheduler.metrics_config import MetricsOptions
from services.scheduler.metrics_latency import SLOT_NS
from services.scheduler.stats import StatsRegistry

MS = 1_000_000
US = 1_000
T0 = 1_000 * SLOT_NS   # a monotonic "now" at the start of an age bucket

# Triton's HELP text of every family (core/src/metrics.cc)
HELP = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count":
        "Number of model executions performed (does not include cached requests)",
    "nv_inference_request_duration_us":
        "Cumulative inference request duration in microseconds (includes cached requests)",
    "nv_inference_queue_duration_us":
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
    "nv_inference_compute_input_duration_us":
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    "nv_inference_compute_infer_duration_us":
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "nv_inference_compute_output_duration_us": "Cumulative inference compute output duration in "
        "microseconds (does not include cached requests)",
    "nv_inference_pending_request_count":
        "Instantaneous number of pending requests awaiting execution per-model.",
    "nv_inference_first_response_histogram_ms":
        "Duration from request to first response in milliseconds",
    "nv_inference_request_summary_us":
        "Summary of inference request duration in microseconds (includes cached requests)",
    "nv_inference_queue_summary_us":
        "Summary of inference queuing duration in microseconds (includes cached requests)",
    "nv_inference_compute_input_summary_us":
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    "nv_inference_compute_infer_summary_us":
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "nv_inference_compute_output_summary_us": "Cumulative inference compute output duration in "
        "microseconds (does not include cached requests)",
}
COUNTERS = [n for n in HELP if n.endswith(("_success", "_failure", "_count", "_us"))
            and "summary" not in n and n != "nv_inference_pending_request_count"]
LATENCY_COUNTERS = [n for n in COUNTERS if n.endswith("_duration_us")]
SUMMARIES = [n for n in HELP if n.endswith("_summary_us")]
FIRST = "nv_inference_first_response_histogram_ms"
LABELS = 'model="m",version="1"'


def config(text: str = "") -> mc.ModelConfig:
    return text_format.Parse(f'name: "m" {text}', mc.ModelConfig())


def metrics(*settings: str, cfg: mc.ModelConfig | None = None) -> tuple[Metrics, object]:
    reg = StatsRegistry(MetricsOptions.parse(settings, cpu=False, gpu=False))
    s = reg.fresh("m", 1, cfg if cfg is not None else config())
    return Metrics(reg, lambda: [("m", 1)]), s


def families(text: str) -> dict[str, tuple[str, str]]:
    """name -> (type, help), checking each HELP line is followed by its TYPE line."""
    lines = text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            m = re.fullmatch(rf"# TYPE {name} (\w+)", lines[i + 1])
            assert m, lines[i + 1]
            out[name] = (m.group(1), help_)
    return out


def samples(text: str) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")


def run_batch(s, now: int, requests: list[tuple[int, int]], compute=(10 * US, 2 * MS, 30 * US)):
    s.executed(len(requests), requests, 0, compute, now)


def test_default_families_names_help_and_types_are_tritons():
    m, s = metrics()
    run_batch(s, T0, [(T0 - 5 * MS, T0 - 4 * MS)])
    text = m.render(T0)
    fams = families(text)
    for name in COUNTERS:
        assert fams[name] == ("counter", HELP[name]), name
    assert fams["nv_inference_pending_request_count"] == ("gauge", HELP["nv_inference_pending_request_count"])
    assert FIRST not in text and "summary" not in text    # opt-in, off by default
    got = samples(text)
    assert got[f"nv_inference_request_success{{{LABELS}}}"] == "1"
    assert got[f"nv_inference_request_duration_us{{{LABELS}}}"] == "5000"
    assert got[f"nv_inference_queue_duration_us{{{LABELS}}}"] == "1000"
    assert got[f"nv_inference_compute_infer_duration_us{{{LABELS}}}"] == "2000"
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert got[f'nv_inference_request_failure{{{LABELS},reason="{reason}"}}'] == "0"
    # Triton's registry order: counters, then gauges, then histograms, then summaries
    order = list(fams)
    assert order.index("nv_inference_compute_output_duration_us") < \
        order.index("nv_inference_pending_request_count") < order.index("nv_inference_batch_size")


def test_counter_latencies_false_drops_only_the_duration_counters():
    m, s = metrics("counter_latencies=false")
    run_batch(s, T0, [(T0 - MS, T0)])
    fams = families(m.render(T0))
    assert not [n for n in LATENCY_COUNTERS if n in fams]
    assert {"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
            "nv_inference_exec_count"} <= set(fams)


def test_request_duration_counts_successes_only_as_triton():
    m, s = metrics()
    run_batch(s, T0, [(T0 - 3 * MS, T0 - 3 * MS)])
    s.failed(7 * MS, "REJECTED")
    got = samples(m.render(T0))
    assert got[f"nv_inference_request_duration_us{{{LABELS}}}"] == "3000"
    assert got[f'nv_inference_request_failure{{{LABELS},reason="REJECTED"}}'] == "1"


def test_first_response_histogram_default_buckets_and_integer_ms():
    m, s = metrics("histogram_latencies=true")
    # first responses after 50.9 ms, 100 ms, 100.5 ms, 700 ms and 6 s (Triton: whole ms)
    run_batch(s, T0, [(T0 - int(50.9 * MS), T0), (T0 - 100 * MS, T0), (T0 - int(100.5 * MS), T0)])
    run_batch(s, T0, [(T0 - 700 * MS, T0)])
    s.failed(6000 * MS, "BACKEND")     # an error response is a first response too
    text = m.render(T0)
    assert families(text)[FIRST] == ("histogram", HELP[FIRST])
    got = samples(text)
    assert got[f"{FIRST}_count{{{LABELS}}}"] == "5"
    assert got[f"{FIRST}_sum{{{LABELS}}}"] == str(50 + 100 + 100 + 700 + 6000)
    want = {"100": 3, "500": 3, "2000": 4, "5000": 4, "+Inf": 5}
    for le, n in want.items():
        assert got[f'{FIRST}_bucket{{{LABELS},le="{le}"}}'] == str(n)
    assert text.count(f"{FIRST}_bucket") == 5
    # prometheus-cpp's order within a series: count, sum, then the buckets
    lines = [ln for ln in text.splitlines() if ln.startswith(FIRST)]
    assert lines[0].startswith(f"{FIRST}_count") and lines[1].startswith(f"{FIRST}_sum")


def test_model_metrics_override_the_buckets_as_tritons_qa():
    # qa/L0_metrics/test.sh: buckets [ -1, 0.0, 1, 2.5 ] -> le "-1,0,1,2.5,+Inf"
    cfg = config('model_metrics { metric_control: [ { metric_identifier: { family: '
                 '"nv_inference_first_response_histogram_ms" } histogram_options: '
                 '{ buckets: [ -1, 0.0, 1, 2.5 ] } } ] }')
    m, s = metrics("histogram_latencies=true", cfg=cfg)
    run_batch(s, T0, [(T0 - 2 * MS, T0)])
    text = m.render(T0)
    assert text.count(f"{FIRST}_bucket") == 5
    got = samples(text)
    for le, n in {"-1": 0, "0": 0, "1": 0, "2.5": 1, "+Inf": 1}.items():
        assert got[f'{FIRST}_bucket{{{LABELS},le="{le}"}}'] == str(n)


def test_model_metrics_with_histograms_off_shows_no_histogram():
    cfg = config('model_metrics { metric_control: [ { metric_identifier: { family: '
                 '"nv_inference_first_response_histogram_ms" } histogram_options: { buckets: [ 1 ] } } ] }')
    m, s = metrics("histogram_latencies=false", cfg=cfg)
    run_batch(s, T0, [(T0 - MS, T0)])
    assert FIRST not in m.render(T0)


def test_unknown_model_metrics_family_is_warned_about_in_tritons_words(caplog):
    cfg = config('model_metrics { metric_control: [ { metric_identifier: { family: "nv_nope" } '
                 'histogram_options: { buckets: [ 1 ] } } ] }')
    metrics("histogram_latencies=true", cfg=cfg)
    assert "Metric family 'nv_nope' in 'metric_identifier' is not a customizable metric in " \
           "Triton core." in caplog.text


def test_summaries_names_help_count_sum_and_default_quantiles():
    m, s = metrics("summary_latencies=true")
    for i in range(1, 101):   # request i: i ms long, queued i µs, the batch's compute times
        run_batch(s, T0, [(T0 - i * MS, T0 - i * MS + i * US)], (7 * US, 3 * MS, 1 * US))
    text = m.render(T0)
    fams = families(text)
    for name in SUMMARIES:
        assert fams[name] == ("summary", HELP[name]), name
    got = samples(text)
    assert got[f"nv_inference_request_summary_us_count{{{LABELS}}}"] == "100"
    assert got[f"nv_inference_request_summary_us_sum{{{LABELS}}}"] == str(5050 * 1000)
    assert got[f"nv_inference_queue_summary_us_sum{{{LABELS}}}"] == str(sum(range(1, 101)))
    assert got[f"nv_inference_compute_infer_summary_us_sum{{{LABELS}}}"] == "300000"
    # Triton's default quantiles, each within 1 % of the exact value
    for q, exact in ((0.5, 50_000), (0.9, 90_000), (0.95, 95_000), (0.99, 99_000), (0.999, 100_000)):
        v = float(got[f'nv_inference_request_summary_us{{{LABELS},quantile="{q}"}}'])
        assert abs(v - exact) <= 0.01 * exact, (q, v)
    assert got[f'nv_inference_compute_input_summary_us{{{LABELS},quantile="0.5"}}'] == "7"
    # summary count/sum agree with the counters, as Triton's docs say they should
    assert got[f"nv_inference_request_success{{{LABELS}}}"] == "100"
    # count, sum, then the quantiles (prometheus-cpp's order), quantile the last label
    lines = [ln for ln in text.splitlines() if ln.startswith("nv_inference_queue_summary_us")]
    assert lines[0].startswith("nv_inference_queue_summary_us_count")
    assert lines[2].startswith(f'nv_inference_queue_summary_us{{{LABELS},quantile="0.5"}}')


def test_summary_quantiles_setting_as_tritons_qa():
    # qa/L0_metrics/test.sh: SUMMARY_QUANTILES="0.1:0.0.1,0.7:0.01,0.75:0.01" (std::stod
    # reads "0.0.1" as 0.0) and metrics_config_test.py looks for quantile="0.1" etc.
    m, s = metrics("summary_latencies=true", "summary_quantiles=0.1:0.0.1,0.7:0.01,0.75:0.01")
    run_batch(s, T0, [(T0 - MS, T0)])
    text = m.render(T0)
    for q in ("0.1", "0.7", "0.75"):
        assert f'quantile="{q}"' in text
    assert 'quantile="0.5"' not in text


def test_summary_window_forgets_after_a_minute_but_count_and_sum_stay():
    m, s = metrics("summary_latencies=true")
    run_batch(s, T0, [(T0 - 5 * MS, T0)])
    got = samples(m.render(T0 + 47 * 10**9))     # 47 s later: still in the window
    assert abs(float(got[f'nv_inference_request_summary_us{{{LABELS},quantile="0.5"}}']) - 5000) <= 50
    got = samples(m.render(T0 + 61 * 10**9))     # past 60 s: NaN, as an empty prometheus-cpp window
    assert got[f'nv_inference_request_summary_us{{{LABELS},quantile="0.5"}}'] == "NaN"
    assert got[f"nv_inference_request_summary_us_count{{{LABELS}}}"] == "1"
    assert math.isnan(float(got[f'nv_inference_queue_summary_us{{{LABELS},quantile="0.99"}}']))


def test_empty_summary_is_nan():
    m, _ = metrics("summary_latencies=true")
    got = samples(m.render(T0))
    assert got[f'nv_inference_queue_summary_us{{{LABELS},quantile="0.9"}}'] == "NaN"
    assert got[f"nv_inference_queue_summary_us_count{{{LABELS}}}"] == "0"


def test_failed_requests_are_not_in_the_summaries():
    m, s = metrics("summary_latencies=true")
    s.executed(1, [(T0 - MS, T0)], 1, (0, 0, 0), T0)    # a failed batch
    got = samples(m.render(T0))
    assert got[f"nv_inference_request_summary_us_count{{{LABELS}}}"] == "0"
    assert got[f'nv_inference_request_failure{{{LABELS},reason="BACKEND"}}'] == "1"


def test_ensemble_answers_count_in_request_summary_and_first_response():
    m, s = metrics("summary_latencies=true", "histogram_latencies=true")
    s.completed(1, 3 * MS)
    got = samples(m.render())
    assert got[f"nv_inference_request_summary_us_count{{{LABELS}}}"] == "1"
    assert got[f"nv_inference_request_summary_us_sum{{{LABELS}}}"] == "3000"
    assert got[f"nv_inference_queue_summary_us_count{{{LABELS}}}"] == "0"
    assert got[f"{FIRST}_count{{{LABELS}}}"] == "1"


def test_response_senders_first_responses_are_theirs_not_the_batch_end():
    m, s = metrics("summary_latencies=true", "histogram_latencies=true")
    # A batch done 400 ms after its requests arrived: the first request's first response
    # left 390 ms before the BatchDone, the second's comes later (StreamsDone: 250 ms
    # after arrival), the third was answered with the batch, the fourth never sent one.
    arrived = T0 - 400 * MS
    s.executed(4, [(arrived, arrived)] * 4, 0, (0, 0, 0), T0, [390 * MS, -1, -2, -1])
    s.first_response(250 * MS)
    got = samples(m.render(T0))
    assert got[f"{FIRST}_count{{{LABELS}}}"] == "3"
    assert got[f"{FIRST}_sum{{{LABELS}}}"] == str(10 + 250 + 400)
    # the request summary still times each request to its batch's end (as Triton's stats)
    assert got[f"nv_inference_request_summary_us_count{{{LABELS}}}"] == "4"
    assert got[f"nv_inference_request_summary_us_sum{{{LABELS}}}"] == str(4 * 400_000)


def test_metric_tags_are_underscored_labels_as_triton():
    m, s = metrics(cfg=config('metric_tags { key: "team" value: "search" }'))
    run_batch(s, T0, [(T0 - MS, T0)])
    got = samples(m.render(T0))
    assert got['nv_inference_request_success{model="m",version="1",_team="search"}'] == "1"
    assert 'nv_inference_request_failure{model="m",version="1",_team="search",reason="OTHER"}' in got


def test_many_batches_fold_on_the_way_and_count_exactly():
    m, s = metrics("summary_latencies=true", "histogram_latencies=true")
    for _ in range(5000):   # more than FOLD_BATCHES: folded while recording, then on render
        run_batch(s, T0, [(T0 - MS, T0), (T0 - 2 * MS, T0)])
    got = samples(m.render(T0))
    assert got[f"{FIRST}_count{{{LABELS}}}"] == "10000"
    assert got[f"nv_inference_request_summary_us_count{{{LABELS}}}"] == "10000"
    assert got[f"nv_inference_request_success{{{LABELS}}}"] == "10000"


def test_unloaded_versions_and_no_models_show_no_model_families():
    reg = StatsRegistry(MetricsOptions.parse(cpu=False, gpu=False))
    reg.fresh("m", 1, None)
    text = Metrics(reg, lambda: []).render(T0)
    assert "nv_inference" not in text


def test_allow_metrics_false_records_no_latency():
    reg = StatsRegistry(MetricsOptions.parse(["histogram_latencies=true", "summary_latencies=true"],
                                             enabled=False))
    assert reg.fresh("m", 1, None).latency is None
