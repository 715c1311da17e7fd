"""`trireme analyze`: find a served model's best configuration, as Model Analyzer does,
with `trireme perf` (services/perf) as its measuring tool and no C++ binary.

Usage::

    trireme analyze --model-repository R -m MODEL --output DIR [--latency-budget-ms X]

It starts `trireme serve` on R in explicit mode (or uses the server at ``-u``, which must
accept loads), then for each configuration of the sweep (instance counts, max_batch_size,
dynamic batching on/off, max_queue_delay_microseconds; ranges by flag) loads the model
through the repository API's config override, measures it with `trireme perf` at each
concurrency, and reads the batch sizes the server ran (``nv_inference_batch_size``).
Every result is appended to DIR/results.json as it is measured: run the same command again
and an interrupted sweep resumes where it stopped. At the end it prints the configurations
ranked by throughput among those whose p99 latency keeps within the budget, and writes
DIR/config.pbtxt (the winner) and DIR/report.html (throughput against p99 per
configuration, the latency breakdown of each, the winner's batch sizes; PNG plots beside).

Modules, by role: flags (the command line), variants (the sweep and each configuration),
measure (the server, the loads, `trireme perf` runs and the metrics), report (ranking,
table, config.pbtxt, the HTML report and its plots), main (the run and its results file).
"""
