"""The frontend process: HTTP and gRPC adapters over one DataPlane, on one event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from services.common import logsettings
from services.common.errors import PortTaken
from services.common.flags import parse_bool
from services.common.procutil import die_with_parent, set_title, tune_gc
from services.common.shm import DEFAULT_INLINE_THRESHOLD
from services.dataplane.client import DataPlane
from services.frontend.forward import pattern_arg
from services.frontend.grpc.limits import add_grpc_limit_args, grpc_limits_from_args
from services.frontend.restricted import GROUPS as RESTRICTED_GROUPS
from services.frontend.restricted import RestrictionAction, Restrictions
from services.frontend.settings import DEFAULT_HTTP_MAX_INPUT_SIZE, HEALTH_BODIES, FrontendSettings
from services.frontend.tls import TlsError, add_tls_args, load, tls_from_args

log = logging.getLogger("trireme.frontend")

STOP_GRACE_S = 60.0   # in-flight calls at SIGTERM; the scheduler's exit timeout comes first


async def run(settings: FrontendSettings, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT, or until ``stop`` is set (a frontend in the scheduler's
    process: `trireme serve --in-process-frontend`, whose signals are the scheduler's)."""
    dp = DataPlane(settings)   # (it chooses a result address when none is given)
    dp.starting = True
    await dp.start()
    http = grpc_server = None
    if settings.allow_http:
        from services.frontend.http.routes import start_http
        http = await start_http(dp, settings)
    if settings.allow_grpc:
        from services.frontend.grpc.methods import start_grpc
        grpc_server = await start_grpc(dp, settings)
    dp.starting = False
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    log.info("frontend %d serving http:%s grpc:%s", os.getpid(), settings.http_port, settings.grpc_port)
    await stop.wait()
    # Both servers stop taking new calls and let the ones in flight finish together, for as
    # long as HTTP allows: the scheduler answers every held request by --exit-timeout-secs
    # (and kills a frontend still running half a second later), so gRPC callers get that
    # answer rather than a cut stream.
    await asyncio.gather(*(s.stop(STOP_GRACE_S) for s in (grpc_server, http) if s is not None))
    dp.close()


def _max_input_size(value: str) -> int:
    """--http-max-input-size: an integer > 0, refused in Triton's words otherwise."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{value}'") from None
    if size <= 0:
        raise argparse.ArgumentTypeError("Error: --http-max-input-size must be greater than 0.")
    return size


def add_frontend_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The frontend's own flags, on `trireme frontend` and on `trireme serve` (which hands
    them on to its frontend processes with frontend_argv). Returns the actions added."""
    return [
        p.add_argument("--http-port", type=int, default=8000, help="the HTTP/REST port"),
        p.add_argument("--grpc-port", type=int, default=8001, help="the gRPC port"),
        p.add_argument("--host", default="0.0.0.0",
                       help="the address the HTTP and gRPC ports (and, for serve, the metrics "
                            "port) listen on"),
        p.add_argument("--reuse-port", type=parse_bool, default=False,
                       help="share the HTTP and gRPC ports with other frontends on this host "
                            "(SO_REUSEPORT), as the compose topology's frontends do; without "
                            "it a port another process holds stops the frontend"),
        p.add_argument("--allow-http", type=parse_bool, default=True, help="serve HTTP/REST"),
        p.add_argument("--allow-grpc", type=parse_bool, default=True, help="serve gRPC"),
        p.add_argument("--http-max-input-size", type=_max_input_size,
                       default=DEFAULT_HTTP_MAX_INPUT_SIZE,
                       help="the largest HTTP request body, in bytes (Triton's flag)"),
        p.add_argument("--http-health-body", choices=HEALTH_BODIES, default="empty",
                       help="the body of the health and model-ready answers: empty (Triton's) "
                            "or json (the Open Inference Protocol's {\"live\": true}, which "
                            "KServe's client reads)"),
        p.add_argument("--server-name", default="trireme",
                       help='name reported by server metadata ("triton" for Triton test suites)'),
        p.add_argument("--inline-threshold", type=int, default=DEFAULT_INLINE_THRESHOLD,
                       help="tensors smaller than this travel inline, larger ones in shared memory"),
        p.add_argument("--grpc-impl", choices=("native", "aio"), default="native",
                       help="gRPC server: native (HTTP/2 on the frontend's event loop, the default) "
                            "or aio (grpc.aio)"),
        p.add_argument("--http-impl", choices=("native", "aiohttp"), default="native",
                       help="HTTP server: native (HTTP/1.1 on the frontend's event loop, the "
                            "default) or aiohttp"),
        p.add_argument("--no-shm", action="store_true",
                       help="send every tensor inline (processes on different hosts)"),
        p.add_argument("--http-header-timeout-secs", type=float, default=60.0,
                       help="HTTP: a request head (request line and headers) must arrive "
                            "within this many seconds, else 408 and close (0: off)"),
        p.add_argument("--http-body-timeout-secs", type=float, default=60.0,
                       help="HTTP: a request body must arrive within this many seconds, plus "
                            "one per 64 KiB it brings, else 408 and close (0: off)"),
        p.add_argument("--http-idle-timeout-secs", type=float, default=75.0,
                       help="HTTP: an idle keep-alive connection closes after this (0: off)"),
        p.add_argument("--http-max-connections", type=int, default=1024,
                       help="HTTP: open connections per frontend; a connection past it is "
                            "answered 503 and closed (0: no cap)"),
        p.add_argument("--http-restricted-api", action=RestrictionAction, default=None,
                       metavar="<API>[,<API>...]:<key>=<value>",
                       help="HTTP endpoints of these groups need header <key>: <value> "
                            f"(repeatable). Groups: {', '.join(RESTRICTED_GROUPS)}"),
        p.add_argument("--grpc-restricted-protocol", action=RestrictionAction, default=None,
                       metavar="<protocol>[,<protocol>...]:<key>=<value>",
                       help="gRPC methods of these groups need metadata "
                            "triton-grpc-protocol-<key>: <value> (repeatable). Groups: as "
                            "--http-restricted-api"),
        p.add_argument("--http-header-forward-pattern", type=pattern_arg, default=None,
                       metavar="REGEX", help="HTTP infer requests' headers whose names match "
                       "(any case, anywhere in the name) reach the model as request parameters"),
        p.add_argument("--grpc-header-forward-pattern", type=pattern_arg, default=None,
                       metavar="REGEX", help="the same for gRPC inference calls' metadata"),
        *add_grpc_limit_args(p),
        *add_tls_args(p, "grpc"),
        *add_tls_args(p, "http"),
    ]


def frontend_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_frontend_args, as parsed into ``args``, written back as a frontend
    process's command line: `trireme serve` forwards every frontend flag this way, so a
    new flag needs no edit there."""
    argv: list[str] = []
    for action in add_frontend_args(argparse.ArgumentParser(add_help=False)):
        flag, value = action.option_strings[-1], getattr(args, action.dest)
        if action.nargs == 0:                    # store_true / store_false / store_const
            if value == action.const and value != action.default:
                argv.append(flag)
        elif isinstance(value, list):            # append
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv




def settings_from_args(args: argparse.Namespace, scheduler_addr: str,
                       result_addr: str = "") -> FrontendSettings:
    return FrontendSettings(
        scheduler_addr=scheduler_addr, result_addr=result_addr, host=args.host,
        http_port=args.http_port, grpc_port=args.grpc_port, allow_http=args.allow_http,
        allow_grpc=args.allow_grpc, http_max_input_size=args.http_max_input_size,
        server_name=args.server_name, http_health_body=args.http_health_body,
        reuse_port=args.reuse_port, http_listen_fd=getattr(args, "http_listen_fd", -1),
        grpc_listen_fd=getattr(args, "grpc_listen_fd", -1),
        inline_threshold=args.inline_threshold,
        use_shm=not args.no_shm, grpc_impl=args.grpc_impl, http_impl=args.http_impl,
        http_header_timeout_secs=args.http_header_timeout_secs,
        http_body_timeout_secs=args.http_body_timeout_secs,
        http_idle_timeout_secs=args.http_idle_timeout_secs,
        http_max_connections=args.http_max_connections,
        restricted=Restrictions.parse(args.http_restricted_api or (),
                                      args.grpc_restricted_protocol or ()),
        grpc_limits=grpc_limits_from_args(args),
        http_header_forward_pattern=args.http_header_forward_pattern,
        grpc_header_forward_pattern=args.grpc_header_forward_pattern,
        grpc_tls=tls_from_args(args, "grpc") if args.allow_grpc else None,
        http_tls=tls_from_args(args, "http") if args.allow_http else None)


def checked_settings(args: argparse.Namespace, scheduler_addr: str,
                     result_addr: str = "") -> FrontendSettings:
    """settings_from_args, with the TLS files read and checked: what a frontend would refuse
    to start with is refused here, in words (TlsError). `trireme serve` calls it before it
    starts a process."""
    settings = settings_from_args(args, scheduler_addr, result_addr)
    for tls in (settings.grpc_tls, settings.http_tls):
        if tls is not None:
            load(tls)
    return settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trireme frontend",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scheduler", required=True, help="the scheduler's frontend socket address")
    p.add_argument("--result-addr", default="",
                   help="address this frontend binds for results (default: a socket path when "
                        "the scheduler's is one, else a TCP port on the address this host "
                        "reaches the scheduler from)")
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--http-listen-fd", type=int, default=-1,
                   help="serve HTTP on this inherited listening socket (`trireme serve` hands "
                        "its frontends the sockets it bound)")
    p.add_argument("--grpc-listen-fd", type=int, default=-1,
                   help="serve gRPC on this inherited listening socket")
    add_frontend_args(p)
    logsettings.add_log_args(p)   # (then the scheduler's settings, from its hello on)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    logsettings.configure(logsettings.from_args(args))
    set_title(f"trireme frontend {args.http_port}/{args.grpc_port}")
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    try:
        settings = checked_settings(args, args.scheduler, args.result_addr)
    except TlsError as e:
        p.error(str(e))
    tune_gc()
    try:
        asyncio.run(run(settings))
    except PortTaken as e:   # another process holds a port (Triton's words)
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
