"""`trireme` console command: serve | scheduler | frontend | workers | worker.

`serve` is the embedded default: this process becomes the scheduler, which spawns one
worker per model instance and N frontend processes sharing the HTTP/gRPC ports. The other
subcommands run one piece alone (compose, Kubernetes): `scheduler`, `frontend` (needs only
--scheduler), `workers` (a worker host: runs the instances the scheduler places on it) and
`worker` (one worker process, as hosts spawn them). Flags mirror `tritonserver` where it
has one.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.common import logsettings, transport_inproc
from services.common.errors import PortTaken
from services.common.flags import parse_bool
from services.common.procutil import set_title
from services.common.shm import DEFAULT_INLINE_THRESHOLD

log = logging.getLogger("trireme")

# After --exit-timeout-secs the frontends have this long to send the errors of the requests
# that were still executing (the scheduler fails them at the timeout), then they are killed.
FRONTEND_GRACE_S = 0.5


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", action="append", required=True, type=Path,
                   help="model repository path (repeatable)")
    p.add_argument("--model-namespacing", type=parse_bool, default=False,
                   help="a model name may be in several repositories: each repository's models "
                        "are apart, an ensemble's steps use its own repository's models first, "
                        "and a name loaded from several repositories is ambiguous")
    p.add_argument("--direct-path", type=parse_bool, default=True,
                   help="requests to a model version with no batcher, sequence, ensemble, "
                        "decoupled policy, rate limiter or execution timeout go from the "
                        "frontend to an instance directly; false: every request passes the "
                        "scheduler")
    p.add_argument("--model-control-mode", choices=["none", "poll", "explicit"], default="none",
                   help="how models are loaded: none (every model of the repository, at start), "
                        "poll (and their changes, every --repository-poll-secs), explicit "
                        "(--load-model and the repository API)",
                   type=str.lower)   # (Triton lower-cases it: "EXPLICIT" works)
    p.add_argument("--repository-poll-secs", type=float, default=15.0,
                   help="poll mode: seconds between two scans of the repository")
    p.add_argument("--load-model", action="append", default=[],
                   help="model to load at start in explicit mode ('*' for all)")
    p.add_argument("--model-config-name", default=None,
                   help="read <model>/configs/<name>.pbtxt instead of config.pbtxt where it exists")
    p.add_argument("--disable-auto-complete-config", action="store_true",
                   help="use model configs as written: no inputs, outputs or batching filled in "
                        "from the model")
    p.add_argument("--strict-readiness", type=parse_bool, default=True,
                   help="the server is ready only when every model it should load is READY "
                        "(false: when it is live)")
    p.add_argument("--exit-on-error", type=parse_bool, default=True,
                   help="a model that fails to load at start-up stops the server (exit code 1); "
                        "false: the others serve, the failed one is UNAVAILABLE with its reason")
    p.add_argument("--metrics-port", type=int, default=8002, help="the Prometheus /metrics port")
    p.add_argument("--allow-metrics", type=parse_bool, default=True, help="serve /metrics on --metrics-port")
    p.add_argument("--allow-cpu-metrics", type=parse_bool, default=True,
                   help="CPU metrics (nv_cpu_*) on /metrics; ignored unless --allow-metrics is true")
    p.add_argument("--allow-gpu-metrics", type=parse_bool, default=True,
                   help="GPU metrics (nv_gpu_*, through nvidia-ml-py); ignored unless "
                        "--allow-metrics is true")
    p.add_argument("--metrics-interval-ms", type=_interval_ms, default=2000,
                   help="CPU and GPU metrics are read once every this many milliseconds")
    p.add_argument("--metrics-config", action="append", default=[], type=_metrics_setting,
                   metavar="<setting>=<value>",
                   help="Triton's metrics settings, repeatable: counter_latencies=<bool> (true), "
                        "histogram_latencies=<bool> (false), summary_latencies=<bool> (false), "
                        "summary_quantiles=<quantile>:<error>,...")
    p.add_argument("--exit-timeout-secs", type=_secs, default=30.0,
                   help="on SIGTERM/SIGINT, how long work in flight may take to finish; a model "
                        "instance still executing then is killed and its requests fail")
    p.add_argument("--model-execution-timeout-secs", type=_secs, default=0.0,
                   help="kill and restart a model instance that stays in one execution longer "
                        "than this, failing its requests UNAVAILABLE (0: never, the default); a "
                        "model's 'execution_timeout_secs' config parameter overrides it")
    p.add_argument("--model-unload-timeout-secs", type=_secs, default=30.0,
                   help="how long an unload (or reload) waits for the model's executions in "
                        "flight; an instance still executing then is killed")
    p.add_argument("--model-memory-budget", type=_bytes, default=0, metavar="BYTES",
                   help="explicit mode: the bytes the models' instances may hold on each worker "
                        "host (each worker's size measured after load and warmup; suffixes K, M, "
                        "G, Ki, Mi, Gi); a load makes room by unloading the least recently used "
                        "idle models; 0: no budget")
    p.add_argument("--model-load-on-demand", type=parse_bool, default=False,
                   help="explicit mode: an inference request for a model the repository holds "
                        "and that is not loaded loads it, and waits for it")
    p.add_argument("--model-load-on-demand-timeout-secs", type=_secs, default=60.0,
                   help="how long a request waits for its model's load on demand (or for room "
                        "in --model-memory-budget) before it fails UNAVAILABLE")
    p.add_argument("--model-state-file", type=Path, default=None,
                   help="explicit mode: keep the loaded models (and their load parameters) in "
                        "this file, and load them again when the scheduler restarts")
    p.add_argument("--allow-client-shm", type=parse_bool, default=False,
                   help="clients may register system shared-memory regions (Triton's flag)")
    p.add_argument("--cache-config", action="append", default=[], metavar="<cache>,<setting>=<value>",
                   help="the response cache, one setting per flag, as Triton's: local,size=<bytes>")
    p.add_argument("--response-cache-byte-size", type=int, default=None,
                   help="deprecated: --cache-config local,size=<bytes>")
    p.add_argument("--rate-limit", choices=["off", "execution_count"], default="off",
                   help="execution_count: instances run only while their resources are free")
    p.add_argument("--rate-limit-resource", action="append", default=[], type=_resource,
                   metavar="NAME:COUNT[:DEVICE]",
                   help="resources available to the rate limiter (no device, or -1: on every device)")
    # ---- logging: Triton's --log-* flags. The scheduler's settings, which every frontend
    # and worker follows (services/common/logsettings.py)
    logsettings.add_log_args(p)
    # ---- tracing: Triton's --trace-config (and its deprecated --trace-* flags)
    from services.scheduler.trace_config import add_trace_args
    add_trace_args(p)


def _resource(v: str) -> str:
    from services.scheduler.rate_limiter import parse_resource
    try:
        parse_resource(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


def _metrics_setting(v: str) -> str:
    from services.scheduler.metrics_config import parse_setting
    try:
        parse_setting(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


def _interval_ms(v: str) -> int:
    try:
        ms = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid option value. Got {v}") from None
    if ms <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds > 0, got '{v}'")
    return ms


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _bytes(v: str) -> int:
    """A byte count: 1073741824, 1G, 1Gi, 512Mi (a trailing "B" allowed)."""
    t = v.strip().lower().removesuffix("b")
    digits = t.rstrip("kmgti")
    try:
        n = float(digits) * _UNITS[t[len(digits):]]
    except (ValueError, KeyError):
        n = -1
    if not 0 <= n < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of bytes >= 0 (suffixes K, M, G, "
                                         f"Ki, Mi, Gi), got '{v}'")
    return int(n)


def _memory(args: argparse.Namespace):
    """--model-memory-budget and --model-load-on-demand: explicit mode only (the other modes
    load every model of the repository, which a budget could not hold)."""
    from services.scheduler.memory import MemorySettings
    if (args.model_memory_budget or args.model_load_on_demand) and \
            args.model_control_mode != "explicit":
        which = "--model-memory-budget" if args.model_memory_budget else "--model-load-on-demand"
        raise SystemExit(f"error: {which} needs --model-control-mode=explicit")
    return MemorySettings(args.model_memory_budget, args.model_load_on_demand,
                          args.model_load_on_demand_timeout_secs)


def _secs(v: str) -> float:
    try:
        f = float(v)
    except ValueError:
        f = -1.0
    if not 0 <= f < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got '{v}'")
    return f




def _trace_config(args: argparse.Namespace):
    """The start-up trace settings; a bad value stops the server with Triton's text."""
    from services.scheduler.trace_config import TraceConfigError, config_from_args
    try:
        return config_from_args(args)
    except TraceConfigError as e:
        raise SystemExit(str(e).rstrip("\n")) from None


def _cache_config(args: argparse.Namespace) -> tuple[str, dict[str, str]] | None:
    """The response cache's flags; a bad one stops the server with Triton's text."""
    from services.scheduler.response_cache import CacheConfigError, make_cache, parse_cache_flags
    try:
        config = parse_cache_flags(args.cache_config, args.response_cache_byte_size)
        make_cache(config, [r.resolve() for r in args.model_repository])
    except CacheConfigError as e:
        raise SystemExit(str(e)) from None
    return config


def _scheduler_settings(args: argparse.Namespace, frontend_addr: str, worker_addr: str, host: str):
    from services.scheduler.settings import SchedulerSettings
    for r in args.model_repository:
        if not r.is_dir():
            raise SystemExit(f"error: failed to stat file {r}")
    cache = _cache_config(args)
    return SchedulerSettings(
        repositories=[r.resolve() for r in args.model_repository],
        frontend_addr=frontend_addr, worker_addr=worker_addr,
        control_mode=args.model_control_mode, load_models=args.load_model,
        repository_poll_secs=args.repository_poll_secs, config_name=args.model_config_name,
        disable_autocomplete=args.disable_auto_complete_config,
        strict_readiness=args.strict_readiness, metrics_port=args.metrics_port,
        allow_metrics=args.allow_metrics, host=host, rate_limit=args.rate_limit,
        rate_limit_resources=args.rate_limit_resource,
        execution_timeout_secs=args.model_execution_timeout_secs,
        unload_timeout_secs=args.model_unload_timeout_secs,
        local_workers=getattr(args, "local_workers", True),
        state_file=str(args.model_state_file or ""),
        allow_client_shm=args.allow_client_shm, trace=_trace_config(args),
        metrics_config=args.metrics_config, metrics_interval_ms=args.metrics_interval_ms,
        allow_cpu_metrics=args.allow_cpu_metrics, allow_gpu_metrics=args.allow_gpu_metrics,
        model_namespacing=args.model_namespacing, direct_path=args.direct_path, cache=cache,
        memory=_memory(args),
        worker_args=(["--no-shm"] if getattr(args, "no_shm", False) else [])
        + ["--inline-threshold", str(args.inline_threshold)])


LOAD_FAILED_TEXT = "error: creating server: Internal - failed to load all models"


async def _run_scheduler(settings, frontend_cmds: list[list[str]], exit_timeout: float,
                         in_process: Any = None, exit_on_error: bool = False,
                         pass_fds: list[tuple[int, ...]] | None = None) -> int:
    """The scheduler, its frontend processes (``frontend_cmds``) or the one frontend that runs
    on its event loop (``in_process``: its FrontendSettings). ``exit_on_error``
    (--exit-on-error): a model that fails to load at start-up stops the server, exit code 1
    with Triton's text, once the others are stopped."""
    from services.common.supervisor import ProcessHandle
    from services.scheduler.main import Scheduler

    if in_process is not None:
        transport_inproc.enable()   # (before the scheduler binds the frontend socket)
    sched = Scheduler(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await sched.start()
    frontends: list[ProcessHandle] = []

    async def frontend_exited(h: ProcessHandle, code: int) -> None:
        if h.stopping or stop.is_set():
            return
        log.error("%s exited with code %s; restarting it", h.name, code)
        await asyncio.sleep(0.5)
        if not stop.is_set():
            await h.start()

    for i, cmd in enumerate(frontend_cmds):
        h = ProcessHandle(f"frontend {i}", "services.frontend.main", cmd, on_exit=frontend_exited,
                          pass_fds=pass_fds[i] if pass_fds else ())
        await h.start()
        frontends.append(h)
    embedded = None
    if in_process is not None:
        from services.frontend.main import run as run_frontend
        embedded = loop.create_task(run_frontend(in_process, stop))
        # A frontend that cannot serve (its port taken) takes the server down with it, as
        # a failed process would be restarted: there is nothing here to restart.
        embedded.add_done_callback(lambda t: stop.set())
    load = loop.create_task(sched.load_initial())

    def loaded(task: asyncio.Task) -> None:
        if exit_on_error and not task.cancelled() and task.exception() is None and task.result():
            stop.set()
    load.add_done_callback(loaded)
    await stop.wait()
    load_failed = (exit_on_error and load.done() and not load.cancelled()
                   and load.exception() is None and bool(load.result()))
    log.info("shutting down")
    load.cancel()
    # --exit-timeout-secs bounds the whole shutdown. The frontends stop taking requests and
    # wait for the answers to theirs while the scheduler lets the work in flight finish; at
    # the timeout it kills the instances still executing, which fails their requests, so
    # the frontends answer those with an error and exit; FRONTEND_GRACE_S later whatever
    # is left is killed.
    fronts = asyncio.ensure_future(asyncio.gather(
        *(h.stop(exit_timeout + FRONTEND_GRACE_S) for h in frontends),
        *((asyncio.wait_for(embedded, exit_timeout + FRONTEND_GRACE_S),) if embedded else ()),
        return_exceptions=True))
    await sched.stop(exit_timeout, fronts)
    await fronts
    if embedded is not None and embedded.done() and not embedded.cancelled() \
            and embedded.exception() is not None:
        log.error("the frontend failed: %s", embedded.exception())
        return 1
    if load_failed:
        print(LOAD_FAILED_TEXT, file=sys.stderr, flush=True)
        return 1
    return 0


_RUNS_CODE = ("lets callers load models from files they send (the 'file:' parameters of a load "
              "request write model.py and other model files, which the server then runs), "
              "i.e. run code on this host as the server's user")
_RESTRICT_HOW = ("--http-restricted-api model-repository:<key>=<value> and "
                 "--grpc-restricted-protocol model-repository:<key>=<value>")


def _warn_open_repository_api(args: argparse.Namespace, frontends_here: bool) -> None:
    """In explicit model-control mode, warn when the model-repository API is open: on
    `trireme serve`, on each protocol served without a model-repository restriction; on
    `trireme scheduler`, always (its frontends are started elsewhere, with their own flags)."""
    if args.model_control_mode != "explicit":
        return
    if not frontends_here:
        log.warning("explicit model control: the model-repository API of every frontend that "
                    "connects to this scheduler %s, unless the frontend restricts it (%s)",
                    _RUNS_CODE, _RESTRICT_HOW)
        return
    from services.frontend.restricted import Restrictions
    restricted = Restrictions.parse(args.http_restricted_api or (),
                                    args.grpc_restricted_protocol or ())
    open_on = [name for name, served, rules in (("HTTP", args.allow_http, restricted.http),
                                                ("gRPC", args.allow_grpc, restricted.grpc))
               if served and "model-repository" not in rules]
    if open_on:
        log.warning("explicit model control: the model-repository API is not restricted on %s; "
                    "it %s. Restrict it (%s) or keep the ports private.",
                    " and ".join(open_on), _RUNS_CODE, _RESTRICT_HOW)


def _taken_port(args: argparse.Namespace) -> str | None:
    """Triton's error for the first of this server's ports another process listens on; None
    when all are free. The frontends of one server share their ports (SO_REUSEPORT), so
    another server's would let two servers take turns answering: a plain bind, which any
    listener refuses, tells first."""
    for service, port, used in (("GRPC", args.grpc_port, args.allow_grpc),
                                ("HTTP", args.http_port, args.allow_http),
                                ("Metrics", args.metrics_port, args.allow_metrics)):
        if not used or not port:
            continue
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((args.host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return str(PortTaken(service, args.host, port))
                raise
    return None


def _listening(args: argparse.Namespace, count: int) -> list[dict[str, socket.socket]]:
    """For each of ``count`` frontends, its HTTP and gRPC sockets (listen.py); PortTaken
    with Triton's text when another process holds a port. grpc.aio binds its own."""
    from services.frontend.listen import bind
    out: list[dict[str, socket.socket]] = [{} for _ in range(count)]
    for which, service, port, used in (
            ("grpc", "GRPC", args.grpc_port, args.allow_grpc and args.grpc_impl == "native"),
            ("http", "HTTP", args.http_port, args.allow_http)):
        if not used:
            continue
        for mine in out:
            try:
                mine[which] = bind(args.host, port)
            except OSError as e:
                for s in (s for m in out for s in m.values()):
                    s.close()
                if e.errno == errno.EADDRINUSE:
                    raise PortTaken(service, args.host, port) from None
                raise
            port = mine[which].getsockname()[1]   # (port 0: the siblings take the same)
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from services.frontend.main import checked_settings, frontend_argv
    from services.frontend.tls import TlsError

    try:
        checked_settings(args, "")   # refuse bad TLS files before any process starts
    except TlsError as e:
        log.error("%s", e)
        return 2
    if args.in_process_frontend and args.frontends != 1:
        log.error("--in-process-frontend runs one frontend: leave --frontends at 1")
        return 2
    set_title("trireme serve (scheduler)")
    _warn_open_repository_api(args, frontends_here=True)
    run_dir = tempfile.mkdtemp(prefix=f"trireme-{os.getpid()}-")
    try:
        scheme = "unix" if args.transport == "stream" else "ipc"
        settings = _scheduler_settings(args, f"{scheme}://{run_dir}/frontends.sock",
                                       f"{scheme}://{run_dir}/workers.sock", args.host)
        # (after the flags, as Triton: a bad flag is told before a taken port)
        taken = _taken_port(args)
        if taken is not None:
            log.error("%s", taken)
            return 1
        try:   # the frontends' sockets, bound here: only this server's processes share them
            listening = _listening(args, 1 if args.in_process_frontend else args.frontends)
        except PortTaken as e:
            log.error("%s", e)
            return 1
        fds = [{which: s.fileno() for which, s in mine.items()} for mine in listening]
        if args.in_process_frontend:
            embedded = checked_settings(args, settings.frontend_addr,
                                        f"{scheme}://{run_dir}/results-0.sock")
            embedded.http_listen_fd = fds[0].get("http", -1)
            embedded.grpc_listen_fd = fds[0].get("grpc", -1)
            return _asyncio_run(_run_scheduler(settings, [], args.exit_timeout_secs, embedded,
                                               args.exit_on_error))
        forwarded = frontend_argv(args)   # every flag add_frontend_args defines, as parsed
        cmds = [["--scheduler", settings.frontend_addr,
                 "--result-addr", f"{scheme}://{run_dir}/results-{i}.sock",
                 *(a for which, fd in fds[i].items() for a in (f"--{which}-listen-fd", str(fd))),
                 *forwarded]
                for i in range(args.frontends)]
        return _asyncio_run(_run_scheduler(settings, cmds, args.exit_timeout_secs,
                                           exit_on_error=args.exit_on_error,
                                           pass_fds=[tuple(f.values()) for f in fds]))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def cmd_scheduler(args: argparse.Namespace) -> int:
    set_title("trireme scheduler")
    _warn_open_repository_api(args, frontends_here=False)
    settings = _scheduler_settings(args, args.frontend_addr, args.worker_addr, args.host)
    return _asyncio_run(_run_scheduler(settings, [], args.exit_timeout_secs,
                                       exit_on_error=args.exit_on_error))


def _asyncio_run(coro) -> int:
    from services.common.procutil import tune_gc
    tune_gc()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(coro)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("trireme")
    except PackageNotFoundError:   # (run from a checkout that was never installed)
        return "unknown"


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """The `trireme` parser with its `serve` and `scheduler` subcommands (the others parse
    their own flags). Tests check deployment manifests' command lines against it."""
    from services.frontend.main import add_frontend_args

    parser = parser_class(prog="trireme", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"trireme {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    shown = argparse.ArgumentDefaultsHelpFormatter   # every flag's help shows its default

    serve = sub.add_parser("serve", help="scheduler + workers + N frontends on this machine",
                           formatter_class=shown)
    _add_scheduler_args(serve)
    add_frontend_args(serve)
    serve.add_argument("--frontends", type=int, default=1, help="frontend processes sharing the ports")
    serve.add_argument("--in-process-frontend", action="store_true",
                       help="run the one frontend on the scheduler's event loop instead of in "
                            "its own process: a process hop less per request (lower latency "
                            "at low concurrency); a crash of either then takes down both")
    serve.add_argument("--transport", choices=("stream", "zmq"), default="stream",
                       help="between the processes: stream (Unix sockets, the default) or zmq "
                            "(ZeroMQ over ipc://)")
    serve.set_defaults(func=cmd_serve)

    sched = sub.add_parser("scheduler", help="the scheduler alone (frontends connect to it)",
                           formatter_class=shown)
    _add_scheduler_args(sched)
    sched.add_argument("--frontend-addr", default="stream://0.0.0.0:8010",
                       help="where frontends connect (stream:// or unix://: framed sockets; "
                            "tcp:// or ipc://: ZeroMQ)")
    sched.add_argument("--worker-addr", default="stream://0.0.0.0:8011",
                       help="where worker hosts (trireme workers) and their workers connect")
    sched.add_argument("--local-workers", type=parse_bool, default=False,
                       help="also run model instances in processes of this scheduler (as "
                            "`trireme serve` does), besides those on worker hosts")
    sched.add_argument("--host", default="0.0.0.0", help="the metrics port's address")
    sched.add_argument("--no-shm", action="store_true",
                       help="workers send every tensor inline (frontends on other hosts)")
    sched.add_argument("--inline-threshold", type=int, default=DEFAULT_INLINE_THRESHOLD,
                       help="outputs smaller than this travel inline, larger ones in shared memory")
    sched.set_defaults(func=cmd_scheduler)

    sub.add_parser("frontend", help="one frontend (see trireme frontend --help)", add_help=False)
    sub.add_parser("workers", help="a worker host (see trireme workers --help)", add_help=False)
    sub.add_parser("worker", help="one worker (see trireme worker --help)", add_help=False)
    sub.add_parser("perf", help="perf_analyzer's interface (see trireme perf --help)",
                   add_help=False)
    sub.add_parser("analyze", help="find a model's best configuration (see trireme analyze "
                                   "--help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "frontend":
        from services.frontend.main import main as frontend_main
        return frontend_main(argv[1:])
    if argv and argv[0] == "workers":
        from services.workers.host import main as host_main
        return host_main(argv[1:])
    if argv and argv[0] == "worker":
        from services.workers.main import main as worker_main
        return worker_main(argv[1:])
    if argv and argv[0] == "perf":
        from services.perf.main import main as perf_main
        return perf_main(argv[1:])
    if argv and argv[0] == "analyze":
        from services.analyze.main import main as analyze_main
        return analyze_main(argv[1:])
    args = parser.parse_args(argv)
    logsettings.configure(logsettings.from_args(args))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
