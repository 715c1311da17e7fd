"""perf_analyzer's command line: the flags, their checks, and the flags Trireme refuses.

Flag names, defaults and the meaning of every value follow perf_analyzer's docs/cli.md.
A usage error exits with perf_analyzer's code for it (99, GENERIC_ERROR) and a line that
names the flag; argparse's own exit code 2 would read as a stability failure.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import NoReturn

# perf_analyzer's exit codes (src/constants.h)
SUCCESS = 0
STABILITY_ERROR = 2
OPTION_ERROR = 3
GENERIC_ERROR = 99

NO_LIMIT = 0   # an 'end' of 0: search until the latency threshold is met


class UsageError(Exception):
    """A flag that cannot be used as given; the message names it."""


# perf_analyzer flags Trireme does not implement: each is refused, by name, with why.
REFUSED: dict[str, str] = {
    "--bls-composing-models": "BLS composing-model statistics are not collected",
    "--model-signature-name": "it applies to --service-kind=tfserving only",
    "--periodic-concurrency-range": "the periodic concurrency mode is not implemented",
    "--request-period": "the periodic concurrency mode is not implemented",
    "--session-concurrency": "it applies to --service-kind=openai only",
    "--fixed-schedule": "the fixed-schedule mode is not implemented",
    "--request-intervals": "custom request intervals are not implemented",
    "--trace-level": "trace settings are the server's (use its trace API or --trace-config)",
    "--trace-rate": "trace settings are the server's (use its trace API or --trace-config)",
    "--trace-count": "trace settings are the server's (use its trace API or --trace-config)",
    "--log-frequency": "trace settings are the server's (use its trace API or --trace-config)",
    "--profile-export-file": "the per-request profile export is not implemented",
    "--enable-mpi": "multi-node (MPI) runs are not implemented",
    "--endpoint": "it applies to --service-kind=openai only",
    "--grpc-method": "it applies to --service-kind=dynamic_grpc only",
    "--proto": "it applies to --service-kind=dynamic_grpc only",
    "--triton-server-directory": "it applies to --service-kind=triton_c_api only",
    "--model-repository": "it applies to --service-kind=triton_c_api only",
}
_REFUSED_SWITCHES = {"--fixed-schedule", "--enable-mpi"}   # (take no value)


@dataclass
class SslSettings:
    """perf_analyzer's --ssl-* flags."""
    grpc_use_ssl: bool = False
    grpc_root_certifications_file: str = ""
    grpc_private_key_file: str = ""
    grpc_certificate_chain_file: str = ""
    https: bool = False                 # -u https://...
    https_verify_peer: int = 1          # 0: no certificate check at all
    https_verify_host: int = 2          # 0: the certificate's name is not checked
    https_ca_certificates_file: str = ""
    https_client_certificate_file: str = ""
    https_private_key_file: str = ""


@dataclass
class PerfSettings:
    """Everything a run needs, checked; one field per perf_analyzer flag."""
    model: str
    """-m: the model to measure."""
    version: str = ""
    """-x: its version ("": the server's choice, the latest)."""
    url: str = ""
    """-u: host:port of the server (localhost:8000 for HTTP, :8001 for gRPC)."""
    protocol: str = "http"
    """-i: http or grpc."""
    batch_size: int = 1
    """-b: the batch size of every request."""
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """--shape NAME:D1,D2: the shape (without the batch dimension) of variable-size inputs."""
    input_data: list[str] = field(default_factory=list)
    """--input-data: zero, random (default), JSON files or directories."""
    string_length: int = 128
    """--string-length: the length of random strings for BYTES inputs."""
    string_data: str | None = None
    """--string-data: the string every BYTES element holds instead of random ones."""
    load_mode: str = "concurrency"
    """concurrency (--concurrency-range) or request_rate (--request-rate-range)."""
    concurrency_range: tuple[int, int, int] = (1, 1, 1)
    rate_range: tuple[float, float, float] = (1.0, 1.0, 1.0)
    distribution: str = "constant"
    """--request-distribution: constant or poisson intervals between requests."""
    binary_search: bool = False
    measurement_mode: str = "time_windows"
    measurement_interval_ms: int = 5000
    measurement_request_count: int = 50
    stability: float = 0.10
    """-s as a fraction: the last 3 windows' max/min within 1 + this."""
    max_trials: int = 10
    percentile: int = -1
    """--percentile: stabilise on (and report) this latency percentile; -1: the average."""
    latency_threshold_ms: int = NO_LIMIT
    filename: str = ""
    """-f: the CSV report."""
    async_mode: bool = False
    forced_sync: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    collect_metrics: bool = False
    metrics_url: str = "localhost:8002/metrics"
    metrics_interval_ms: int = 1000
    verbose: int = 0
    verbose_csv: bool = False
    max_threads: int | None = None
    """--max-threads: here, the most load-generating processes (each drives many requests)."""
    request_count: int = 0
    warmup_request_count: int = 0
    shared_memory: str = "none"
    output_shm_size: int = 102400
    sequence_length: int = 20
    sequence_length_specified: bool = False
    sequence_length_variation: float = 20.0
    sequence_id_range: tuple[int, int | None] = (1, None)
    num_of_sequences: int = 4
    serial_sequences: bool = False
    streaming: bool = False
    ssl: SslSettings = field(default_factory=SslSettings)
    grpc_compression: str | None = None
    request_parameters: dict[str, object] = field(default_factory=dict)
    input_tensor_format: str = "binary"
    output_tensor_format: str = "binary"
    load_impl: str = "auto"
    """--load-impl (Trireme's own): lean (requests encoded once, our own HTTP/1.1 and HTTP/2
    connections), tritonclient, or auto: lean wherever it applies."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:   # (argparse would exit 2: a stability code)
        self.print_usage(sys.stderr)
        print(f"Error: {message}", file=sys.stderr)
        sys.exit(GENERIC_ERROR)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trireme perf", allow_abbrev=False, add_help=False,
                description="perf_analyzer's interface: measures a model's throughput and "
                            "latency on a running server at each concurrency or request rate")
    a = p.add_argument
    a("-h", "--help", "-?", action="help", help="show this help and exit")
    a("--version", dest="show_version", action="store_true", help="print the version and exit")
    a("-m", dest="model", help="the model to measure (required)")
    a("-x", dest="version", default="", help="the model version (default: the latest)")
    a("--service-kind", default="triton", help="triton (the only kind served here)")
    a("-v", dest="verbose", action="count", default=0, help="verbose: each measurement pass")
    # ---- measurement
    a("--measurement-mode", choices=["time_windows", "count_windows"], default="time_windows")
    a("-p", "--measurement-interval", dest="measurement_interval", type=int, default=5000,
      metavar="MS", help="time_windows: the length of a window (ms)")
    a("--measurement-request-count", type=int, default=50,
      help="count_windows: the fewest requests in a window")
    a("-s", "--stability-percentage", dest="stability", type=float, default=10.0,
      help="stable when the last 3 windows' throughput and latency agree within this %%")
    a("--percentile", type=int, default=-1,
      help="stabilise on this latency percentile (default: the average)")
    a("--warmup-request-count", type=int, default=0)
    a("--request-count", type=int, default=0,
      help="measure exactly this many requests, in one window")
    a("-r", "--max-trials", dest="max_trials", type=int, default=10,
      help="windows tried per level before it counts as unstable")
    a("--concurrency-range", help="start:end:step (end 0: until --latency-threshold)")
    a("--request-rate-range", help="start:end:step, requests per second")
    a("--request-distribution", choices=["constant", "poisson"], default="constant")
    a("-l", "--latency-threshold", dest="latency_threshold", type=int, default=0, metavar="MS")
    a("--binary-search", action="store_true")
    a("--max-threads", type=int, default=None,
      help="the most load-generating processes (default: as the load and the CPUs need)")
    # ---- sequence models
    a("--num-of-sequences", type=int, default=4)
    a("--sequence-length", type=int, default=None)
    a("--sequence-length-variation", type=float, default=20.0)
    a("--sequence-id-range", default=None, help="start[:end]")
    a("--serial-sequences", action="store_true")
    # ---- input data
    a("--input-data", action="append", default=[], help="zero, random, a JSON file or a directory")
    a("--data-directory", action="append", default=[], help="deprecated: --input-data DIR")
    a("-b", dest="batch_size", type=int, default=1)
    a("--shape", action="append", default=[], help="NAME:D1,D2,... (repeatable)")
    a("--string-data", default=None)
    a("--string-length", type=int, default=128)
    a("--shared-memory", choices=["none", "system", "cuda"], default="none")
    a("--output-shared-memory-size", type=int, default=102400)
    a("--input-tensor-format", choices=["binary", "json"], default="binary")
    a("--output-tensor-format", choices=["binary", "json"], default="binary")
    # ---- requests
    a("-i", dest="protocol", type=str.lower, choices=["http", "grpc"], default="http")
    a("-a", "--async", dest="async_mode", action="store_true")
    a("--sync", action="store_true")
    a("--streaming", action="store_true")
    a("-H", dest="headers", action="append", default=[], help="'Header: value' (repeatable)")
    a("--grpc-compression-algorithm", choices=["none", "gzip", "deflate"], default="none")
    a("--request-parameter", action="append", default=[], help="name:value:type (bool|int|string)")
    a("--load-impl", choices=["auto", "lean", "tritonclient"], default="auto",
      help="Trireme's own: the load's client. lean: each request encoded once and sent as bytes "
           "over our own connections; tritonclient: the official client; auto (default): lean "
           "unless --shared-memory, --streaming or a sequence or decoupled model needs tritonclient")
    # ---- server
    a("-u", dest="url", default=None)
    a("--ssl-grpc-use-ssl", action="store_true")
    a("--ssl-grpc-root-certifications-file", default="")
    a("--ssl-grpc-private-key-file", default="")
    a("--ssl-grpc-certificate-chain-file", default="")
    a("--ssl-https-verify-peer", type=int, choices=[0, 1], default=1)
    a("--ssl-https-verify-host", type=int, choices=[0, 1, 2], default=2)
    a("--ssl-https-ca-certificates-file", default="")
    a("--ssl-https-client-certificate-file", default="")
    a("--ssl-https-client-certificate-type", default="PEM")
    a("--ssl-https-private-key-file", default="")
    a("--ssl-https-private-key-type", default="PEM")
    # ---- metrics and report
    a("--collect-metrics", action="store_true")
    a("--metrics-url", default="localhost:8002/metrics")
    a("--metrics-interval", type=int, default=1000)
    a("-f", dest="filename", default="")
    a("--verbose-csv", action="store_true")
    # ---- deprecated
    a("-t", dest="deprecated_t", type=int, default=None, help="deprecated: --concurrency-range N")
    a("-c", dest="deprecated_c", type=int, default=None, help="deprecated: with -d, 1:N")
    a("-d", dest="deprecated_d", action="store_true", help="deprecated: dynamic concurrency")
    a("-z", dest="deprecated_z", action="store_true", help="deprecated: --input-data zero")
    for flag in REFUSED:
        if flag in _REFUSED_SWITCHES:
            a(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            a(flag, default=None, help=argparse.SUPPRESS)
    return p


def _range(text: str, flag: str, cast: type) -> list:
    parts = text.split(":")
    if len(parts) > 3:
        raise UsageError(f"Failed to parse {flag}. The value does not match <start:end:step>.")
    try:
        return [cast(v) for v in parts]
    except ValueError:
        raise UsageError(f"Failed to parse {flag}: '{text}' is not <start:end:step>.") from None


def _shape(text: str) -> tuple[str, list[int]]:
    name, colon, dims = text.rpartition(":")
    if not colon:
        raise UsageError("Failed to parse --shape. There must be a colon after input name.")
    try:
        shape = [int(d) for d in dims.split(",")]
    except ValueError:
        raise UsageError(f"Failed to parse --shape '{text}': dimensions must be integers.") from None
    if any(d <= 0 for d in shape):
        raise UsageError("Failed to parse --shape. The dimensions of input tensor must be > 0.")
    return name, shape


def _parameter(text: str) -> tuple[str, object]:
    parts = text.split(":")
    if len(parts) != 3:
        raise UsageError(f"Failed to parse --request-parameter '{text}': expected name:value:type.")
    name, value, kind = parts
    if kind == "bool":
        return name, value.lower() in ("true", "1")
    if kind == "int":
        try:
            return name, int(value)
        except ValueError:
            raise UsageError(f"--request-parameter '{text}': '{value}' is not an int.") from None
    if kind == "string":
        return name, value
    raise UsageError(f"--request-parameter '{text}': the type must be bool, int or string.")


def _refusals(ns: argparse.Namespace) -> None:
    for flag, why in REFUSED.items():
        if getattr(ns, flag[2:].replace("-", "_")) not in (None, False):
            raise UsageError(f"{flag} is not supported by trireme perf: {why}.")
    if ns.service_kind != "triton":
        raise UsageError(f"--service-kind={ns.service_kind} is not supported by trireme perf: "
                         "it measures Triton-protocol servers only (--service-kind=triton).")
    if ns.shared_memory == "cuda":
        raise UsageError("--shared-memory=cuda is not supported by trireme perf: use "
                         "--shared-memory=system or none.")
    for flag in ("ssl_https_client_certificate_type", "ssl_https_private_key_type"):
        if getattr(ns, flag).upper() != "PEM":
            raise UsageError(f"--{flag.replace('_', '-')}={getattr(ns, flag)} is not supported "
                             "by trireme perf: PEM files only.")


def settings_from(ns: argparse.Namespace) -> PerfSettings:
    """The checked settings of parsed flags; UsageError names the flag at fault."""
    _refusals(ns)
    if not ns.model:
        raise UsageError("-m flag must be specified")
    s = PerfSettings(model=ns.model, version=ns.version, protocol=ns.protocol)
    url = ns.url or ("localhost:8000" if ns.protocol == "http" else "localhost:8001")
    if url.startswith("https://"):
        s.ssl.https = True
    s.url = url.split("://", 1)[-1].rstrip("/")
    if ns.batch_size <= 0:
        raise UsageError("Failed to parse -b. The value must be > 0.")
    s.batch_size = ns.batch_size
    s.shapes = dict(_shape(t) for t in ns.shape)
    data = ns.input_data + ns.data_directory
    if ns.deprecated_z:
        data.append("zero")
    s.input_data = data
    if ns.string_length <= 0:
        raise UsageError("Failed to parse --string-length. The value must be > 0")
    s.string_length, s.string_data = ns.string_length, ns.string_data
    _load(ns, s)
    s.measurement_mode = ns.measurement_mode
    if ns.measurement_interval <= 0:
        raise UsageError("Failed to parse --measurement-interval (-p). The value must be > 0 msec.")
    s.measurement_interval_ms = ns.measurement_interval
    if ns.measurement_request_count <= 0:
        raise UsageError("Failed to parse --measurement-request-count. The value must be > 0.")
    s.measurement_request_count = ns.measurement_request_count
    if ns.stability < 0:
        raise UsageError("Failed to parse --stability-percentage (-s). The value must be >= 0.0.")
    s.stability = ns.stability / 100
    if ns.max_trials <= 0:
        raise UsageError("Failed to parse --max-trials (-r). The value must be > 0.")
    s.max_trials = ns.max_trials
    if ns.percentile != -1 and not 0 < ns.percentile < 100:
        raise UsageError("Failed to parse --percentile. The value must be between 1 and 99.")
    s.percentile = ns.percentile
    if ns.latency_threshold < 0:
        raise UsageError("Failed to parse --latency-threshold (-l). The value must be >= 0 msecs.")
    s.latency_threshold_ms = ns.latency_threshold
    s.filename, s.verbose, s.verbose_csv = ns.filename, ns.verbose, ns.verbose_csv
    if ns.async_mode and ns.sync:
        raise UsageError("-a/--async and --sync cannot be given together.")
    s.async_mode, s.forced_sync = ns.async_mode, ns.sync
    for h in ns.headers:
        name, colon, value = h.partition(":")
        if not colon or not name.strip():
            raise UsageError(f"Failed to parse -H '{h}': expected 'Header:Value'.")
        s.headers[name.strip()] = value.strip()
    s.collect_metrics, s.metrics_url = ns.collect_metrics, ns.metrics_url
    if ns.metrics_interval <= 0:
        raise UsageError("Failed to parse --metrics-interval. The value must be > 0 msecs.")
    s.metrics_interval_ms = ns.metrics_interval
    if ns.max_threads is not None and ns.max_threads <= 0:
        raise UsageError("Failed to parse --max-threads. The value must be > 0.")
    s.max_threads = ns.max_threads
    for flag in ("request_count", "warmup_request_count"):
        if getattr(ns, flag) < 0:
            raise UsageError(f"Failed to parse --{flag.replace('_', '-')}. The value must be >= 0.")
    s.request_count, s.warmup_request_count = ns.request_count, ns.warmup_request_count
    s.shared_memory = ns.shared_memory
    if ns.output_shared_memory_size <= 0:
        raise UsageError("Failed to parse --output-shared-memory-size. The value must be > 0.")
    s.output_shm_size = ns.output_shared_memory_size
    _sequences(ns, s)
    s.streaming = ns.streaming
    if s.streaming and s.protocol != "grpc":
        raise UsageError("Streaming is only allowed with gRPC protocol.")
    if s.streaming and s.forced_sync:
        raise UsageError("can not use streaming with synchronous API")
    _ssl(ns, s)
    s.grpc_compression = None if ns.grpc_compression_algorithm == "none" \
        else ns.grpc_compression_algorithm
    if s.grpc_compression and s.protocol != "grpc":
        raise UsageError("--grpc-compression-algorithm is only allowed with gRPC protocol.")
    s.request_parameters = dict(_parameter(t) for t in ns.request_parameter)
    s.input_tensor_format, s.output_tensor_format = ns.input_tensor_format, ns.output_tensor_format
    if "json" in (s.input_tensor_format, s.output_tensor_format) and s.protocol != "http":
        raise UsageError("--input-tensor-format/--output-tensor-format json is only allowed "
                         "with HTTP protocol.")
    s.load_impl = ns.load_impl
    return s


def _load(ns: argparse.Namespace, s: PerfSettings) -> None:
    """The search: concurrency or request rate, its range, the latency threshold."""
    deprecated = ns.deprecated_t is not None or ns.deprecated_c is not None or ns.deprecated_d
    if ns.concurrency_range and ns.request_rate_range:
        raise UsageError("Cannot use both Request Rate and Concurrency inference load modes.")
    if deprecated and (ns.concurrency_range or ns.request_rate_range):
        raise UsageError("The deprecated -t, -c and -d cannot be used with --concurrency-range "
                         "or --request-rate-range.")
    if ns.request_rate_range:
        s.load_mode = "request_rate"
        vals = _range(ns.request_rate_range, "--request-rate-range", float)
        rr = [1.0, 1.0, 1.0]
        rr[:len(vals)] = vals
        if rr[0] <= 0 or rr[2] <= 0 or rr[1] < 0:
            raise UsageError("--request-rate-range: start and step must be > 0, end >= 0.")
        s.rate_range = (rr[0], rr[1], rr[2])
    else:
        cr = [1, 1, 1]
        if ns.concurrency_range:
            vals = _range(ns.concurrency_range, "--concurrency-range", int)
            cr[:len(vals)] = vals
        elif ns.deprecated_t is not None:
            cr[0] = ns.deprecated_t
        elif ns.deprecated_d:
            cr = [1, ns.deprecated_c or 1, 1]
        if cr[0] <= 0 or cr[2] <= 0 or cr[1] < 0:
            raise UsageError("--concurrency-range: start and step must be > 0, end >= 0.")
        s.concurrency_range = (cr[0], cr[1], cr[2])
    end = s.rate_range[1] if s.load_mode == "request_rate" else s.concurrency_range[1]
    if end == NO_LIMIT and ns.latency_threshold == NO_LIMIT:
        raise UsageError("The end of the search range and the latency limit can not be both 0 "
                         "(or 0.0) simultaneously")
    s.distribution, s.binary_search = ns.request_distribution, ns.binary_search
    if s.binary_search:
        start = s.rate_range[0] if s.load_mode == "request_rate" else s.concurrency_range[0]
        if end == NO_LIMIT or end < start or ns.latency_threshold == NO_LIMIT:
            raise UsageError("--binary-search needs an explicit start:end range and "
                             "--latency-threshold.")
    if s.load_mode == "request_rate" and ns.request_count:
        raise UsageError("--request-count is only allowed with the concurrency load mode.")


def _sequences(ns: argparse.Namespace, s: PerfSettings) -> None:
    if ns.sequence_length is not None:
        s.sequence_length_specified = True
        if ns.sequence_length > 0:
            s.sequence_length = ns.sequence_length
        else:
            print("WARNING: The sequence length must be > 0. Perf Analyzer will use default "
                  "value if it is measuring on sequence model.", file=sys.stderr)
    if ns.sequence_length_variation < 0:
        raise UsageError("Failed to parse --sequence-length-variation. The value must be >= 0.")
    s.sequence_length_variation = ns.sequence_length_variation
    if ns.sequence_id_range:
        parts = ns.sequence_id_range.split(":")
        try:
            ids = [int(v) for v in parts]
        except ValueError:
            raise UsageError(f"Failed to parse --sequence-id-range '{ns.sequence_id_range}': "
                             "expected <start:end>.") from None
        if len(ids) > 2 or ids[0] <= 0 or (len(ids) == 2 and ids[1] <= ids[0]):
            raise UsageError("Failed to parse --sequence-id-range. The value does not match "
                             "<start:end> with 0 < start < end.")
        s.sequence_id_range = (ids[0], ids[1] if len(ids) == 2 else None)
    if ns.num_of_sequences <= 0:
        raise UsageError("Failed to parse --num-of-sequences. The value must be > 0.")
    s.num_of_sequences, s.serial_sequences = ns.num_of_sequences, ns.serial_sequences


def _ssl(ns: argparse.Namespace, s: PerfSettings) -> None:
    t = s.ssl
    t.grpc_use_ssl = ns.ssl_grpc_use_ssl
    t.grpc_root_certifications_file = ns.ssl_grpc_root_certifications_file
    t.grpc_private_key_file = ns.ssl_grpc_private_key_file
    t.grpc_certificate_chain_file = ns.ssl_grpc_certificate_chain_file
    t.https_verify_peer, t.https_verify_host = ns.ssl_https_verify_peer, ns.ssl_https_verify_host
    t.https_ca_certificates_file = ns.ssl_https_ca_certificates_file
    t.https_client_certificate_file = ns.ssl_https_client_certificate_file
    t.https_private_key_file = ns.ssl_https_private_key_file
    if bool(t.https_client_certificate_file) != bool(t.https_private_key_file):
        raise UsageError("--ssl-https-client-certificate-file and --ssl-https-private-key-file "
                         "must be given together.")
    if bool(t.grpc_private_key_file) != bool(t.grpc_certificate_chain_file):
        raise UsageError("--ssl-grpc-private-key-file and --ssl-grpc-certificate-chain-file "
                         "must be given together.")
    grpc_files = (t.grpc_root_certifications_file, t.grpc_private_key_file)
    if any(grpc_files) and not t.grpc_use_ssl:
        raise UsageError("the --ssl-grpc-* files need --ssl-grpc-use-ssl.")
    if t.grpc_use_ssl and s.protocol != "grpc":
        raise UsageError("--ssl-grpc-use-ssl needs -i grpc.")
    https_files = (t.https_ca_certificates_file, t.https_client_certificate_file)
    if any(https_files) and s.protocol == "http":
        t.https = True   # (as -u https://host:port does; an http:// URL would ignore them)
    if t.https and s.protocol != "http":
        raise UsageError("the --ssl-https-* options need -i http.")
