"""`trireme perf`: perf_analyzer's interface, in Python, against any Triton-protocol server.

Usage: scripts and tuning guides written for perf_analyzer run by changing the program
name: ``trireme perf -m simple -u localhost:8000 --concurrency-range 1:8:2 -f out.csv``
(``-i grpc -u localhost:8001`` for gRPC; ``python -m services.cli perf ...`` or
``python -m services.perf ...`` from a checkout). It reads the model's metadata and config
from the server to make the inputs (random by default; ``--input-data zero|random|FILE.json
|DIR`` in perf_analyzer's formats, ``--shape NAME:D1,D2``, ``-b N``, ``--string-length``),
drives the load from as many processes as the peak load needs, one per CPU at most
(``--max-threads`` caps them; two load paths, below), and at each concurrency
(``--concurrency-range start:end:step``) or request rate (``--request-rate-range``,
``--request-distribution constant|poisson``) measures windows (``-p MS``, or
``--measurement-mode count_windows --measurement-request-count N``) until the last 3 agree
within ``-s`` percent on throughput and latency (``--percentile N``: on that percentile).
Per level it prints perf_analyzer's client section (request count, throughput, average and
p50/p90/p95/p99 latency, the send / response wait / receive split, see below), its own CPU
(every load process and the profiler: µs per request and % of a core), and the server side
from the statistics extension diffed per window (queue, compute input/infer/output, cache
hits and misses, an ensemble's composing models);
then the "Inferences/Second vs. Client Average Batch Latency" summary and, with ``-f``,
perf_analyzer's CSV columns in its order. Also: ``--shared-memory system``
(``--output-shared-memory-size``), sequence models (``--sequence-length``,
``--sequence-id-range``), ``--streaming`` for decoupled models over gRPC, ``--ssl-grpc-*`` and
``--ssl-https-*`` (``-u https://...``), ``-H``, ``--request-parameter``, ``--collect-metrics``,
``--request-count``, ``--warmup-request-count``, ``--binary-search``, ``--latency-threshold``,
``-a``/``--sync``, ``-v``, ``--verbose-csv``. Exit codes are perf_analyzer's: 0; 2 when the
first level never stabilises in ``--max-trials`` windows (a later one ends the sweep);
3 when windows hold no requests; 99 for any other error. perf_analyzer flags that are not
implemented (``--shared-memory cuda``, ``--profile-export-file``, ``--fixed-schedule``,
``--request-intervals``, ``--periodic-concurrency-range``, ``--trace-*``, other
``--service-kind`` values, request rates on sequence models, ...) are refused with an error
naming the flag (exit 99), never ignored.

Two load paths (``--load-impl``, Trireme's own flag; auto by default):
- lean, wherever it applies: each distinct request is encoded once (HTTP: the KServe v2
  binary-tensor body tritonclient.http would send, from its own encoder; gRPC: the
  ModelInferRequest tritonclient.grpc would send, serialised and framed once), then sent as
  bytes over our own keep-alive HTTP/1.1 connections or our own HTTP/2 connections, on
  uvloop, one connection per concurrency slot; responses are read for their status and
  their end only (trireme perf does not validate outputs). TLS (both protocols), -H,
  --request-parameter, JSON tensors, -b, --grpc-compression-algorithm and request rates
  are covered. "send" is handing the bytes to the socket, "receive" is from the first
  byte of the response to its last; the rest is "response wait".
- tritonclient (HTTP: gevent, gRPC: asyncio; and the sync gRPC stream), for what needs
  per-request work or the client's own machinery: --shared-memory system, --streaming,
  sequence models (ids and flags per request), decoupled models. HTTP's "send" is
  tritonclient building the request, gRPC's is not separable and shows 0, "receive" is
  decoding the outputs.
Measured side by side with wrk and h2load: benchmarks/perf_vs_tools.py.

Modules, by role: flags (the command line), model (what the server says of the model),
inputs (the tensors), payload (tritonclient inputs/outputs, shared memory), worker_core,
load_lean with lean_http and lean_h2 (the lean path), load_http and load_grpc
(tritonclient's), load_async (what the asyncio processes share) and manager (the load
processes), profiler (windows and stability),
server_stats (the statistics extension and Prometheus metrics), report (stdout and CSV),
main (the run).
"""
