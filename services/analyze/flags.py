"""`trireme analyze`'s command line."""
from __future__ import annotations

import argparse
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got '{text}'")
    return values


def _switches(text: str) -> list[bool]:
    words = {"on": True, "off": False, "true": True, "false": False}
    try:
        values = [words[v.strip().lower()] for v in text.split(",") if v.strip()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on,off (or one of them), got '{text}'") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected on,off (or one of them), got '{text}'")
    return list(dict.fromkeys(values))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trireme analyze", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Sweep a model's instance count, max_batch_size, dynamic batching and "
                    "queue delay, measure each with `trireme perf`, and write the best "
                    "configuration and a report.")
    p.add_argument("--model-repository", type=Path, required=True,
                   help="the repository holding the model")
    p.add_argument("-m", "--model", required=True, help="the model to configure")
    p.add_argument("--output", type=Path, required=True,
                   help="where results.json, config.pbtxt and report.html go (an existing "
                        "results.json is resumed)")
    p.add_argument("--latency-budget-ms", type=float, default=None,
                   help="a configuration qualifies at a concurrency only if its p99 latency "
                        "is within this (default: no budget)")
    p.add_argument("-u", "--url", default=None,
                   help="HTTP address of a running server in explicit mode (host:port); "
                        "default: start `trireme serve` on the repository")
    p.add_argument("--instance-counts", type=_ints, default=[1, 2],
                   help="instance counts to try")
    p.add_argument("--max-batch-sizes", type=_ints, default=None,
                   help="max_batch_size values to try (default: 1,4,16 for a model that "
                        "batches, 0 for one that does not)")
    p.add_argument("--dynamic-batching", type=_switches, default=[False, True],
                   help="dynamic batching off and/or on (for max_batch_size > 1)")
    p.add_argument("--max-queue-delays-us", type=_ints, default=[0, 500],
                   help="max_queue_delay_microseconds values to try with dynamic batching")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16],
                   help="client concurrencies to measure each configuration at")
    p.add_argument("-i", "--protocol", choices=["http", "grpc"], default="grpc",
                   help="the protocol `trireme perf` measures over")
    p.add_argument("-p", "--measurement-interval", type=int, default=2000,
                   help="`trireme perf` window, in milliseconds")
    p.add_argument("--max-trials", type=int, default=6,
                   help="`trireme perf` windows before a level counts as unstable")
    p.add_argument("--perf-arg", action="append", default=[], metavar="FLAG",
                   help="one more `trireme perf` flag (repeatable), e.g. --perf-arg=--shape=IN:16")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    return p
