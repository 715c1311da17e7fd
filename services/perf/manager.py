"""The load generator's processes, seen from the profiler: it starts them (spawned: gRPC and
fork do not mix), gives each its share of the concurrency, request rate and request budget,
and merges what they measured.

    profiler ──LoadManager──pipe──▶ process 0 (lean: uvloop; tritonclient: gevent or asyncio;
                                               slots 0, P, 2P, ...)
                           ──pipe──▶ process 1 ...
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import resource
import signal
from typing import Any

import numpy as np

from services.perf.worker_core import RECORD, WorkerSpec

READY_TIMEOUT_S = 120.0
# The load one process drives before another starts (tritonclient's path; the lean path's)
SLOTS_PER_PROCESS = 16
RATE_PER_PROCESS = 1500.0     # requests/s
LEAN_SLOTS_PER_PROCESS = 256
LEAN_RATE_PER_PROCESS = 20000.0
STOP_TIMEOUT_S = 40.0


class LoadError(Exception):
    """A load process failed (a request's error, or the process itself)."""


def process_main(conn: Any, spec: WorkerSpec) -> None:
    """The entry of a load process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # (the profiler stops us on Ctrl-C)
    try:
        if spec.lean:
            from services.perf.load_lean import serve
        elif spec.protocol == "http":
            from services.perf.load_http import serve
        else:
            from services.perf.load_grpc import serve
        serve(conn, spec)
    except BaseException as e:   # noqa: BLE001  (reported to the profiler, which exits)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass


def process_count(load_mode: str, start: float, end: float, max_processes: int | None,
                  cpus: int | None = None, lean: bool = False) -> int:
    """As many processes as the peak load needs, at most one per CPU (or --max-threads)."""
    cpus = cpus or os.cpu_count() or 1
    peak = max(start, end)
    if end == 0:   # (searching until the latency threshold: no known peak)
        want = cpus
    elif load_mode == "concurrency":
        want = math.ceil(peak / (LEAN_SLOTS_PER_PROCESS if lean else SLOTS_PER_PROCESS))
    else:
        want = math.ceil(peak / (LEAN_RATE_PER_PROCESS if lean else RATE_PER_PROCESS))
    n = max(1, min(want, cpus))
    return min(n, max_processes) if max_processes else n


def shares(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights`, in whole numbers that sum to it."""
    w = sum(weights)
    if w == 0:
        return [0] * len(weights)
    exact = [total * x / w for x in weights]
    out = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - out[i], reverse=True):
        if sum(out) == total:
            break
        out[i] += 1
    return out


class LoadManager:
    def __init__(self, specs: list[WorkerSpec]) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for spec in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=process_main, args=(child, spec), daemon=True,
                            name=f"trireme perf load {spec.index}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for i, c in enumerate(self.conns):
            if not c.poll(READY_TIMEOUT_S):
                self.close()
                raise LoadError(f"load process {i} did not start in {READY_TIMEOUT_S:.0f} s")
            self._reply(i, c)
        self.concurrency = [0] * len(specs)

    @property
    def processes(self) -> int:
        return len(self.conns)

    def _reply(self, i: int, conn: Any) -> Any:
        try:
            r = conn.recv()
        except (EOFError, OSError):
            code = self.procs[i].exitcode
            raise LoadError(f"load process {i} exited"
                            + (f" with code {code}" if code is not None else "")) from None
        if isinstance(r, tuple) and r and r[0] == "error":
            raise LoadError(f"Thread [{i}] had error: {r[1]}")
        return r

    def _ask(self, msgs: list[tuple]) -> list[Any]:
        for c, m in zip(self.conns, msgs):
            c.send(m)
        return [self._reply(i, c) for i, c in enumerate(self.conns)]

    def set_concurrency(self, n: int, budget: int | None = None) -> None:
        self.concurrency = shares(n, [1] * self.processes)
        budgets = shares(budget, self.concurrency) if budget is not None else \
            [None] * self.processes
        self._ask([("load", {"concurrency": c}, b) for c, b in zip(self.concurrency, budgets)])

    def set_rate(self, rate: float, distribution: str, budget: int | None = None) -> None:
        budgets = shares(budget, [1] * self.processes) if budget is not None else \
            [None] * self.processes
        self._ask([("load", {"rate": rate, "distribution": distribution, "phase": i / rate}, b)
                   for i, b in enumerate(budgets)])

    def collect(self) -> dict[str, Any]:
        """Every record since the last collect, merged; the processes' CPU seconds so far
        (this one's included); the first error."""
        replies = self._ask([("collect",)] * self.processes)
        records = np.concatenate([np.frombuffer(r["records"], RECORD) for r in replies]) \
            if replies else np.empty(0, RECORD)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        errors = [(i, r["error"]) for i, r in enumerate(replies) if r["error"]]
        return {"records": records,
                "cpu": sum(r["cpu"] for r in replies) + ru.ru_utime + ru.ru_stime,
                "error": f"Thread [{errors[0][0]}] had error: {errors[0][1]}" if errors else None,
                "sent": sum(r["sent"] for r in replies),
                "delayed": sum(r["delayed"] for r in replies)}

    def count(self) -> int:
        """Requests completed so far, all processes; LoadError on a request's error."""
        replies = self._ask([("count",)] * self.processes)
        for i, r in enumerate(replies):
            if r["error"]:
                raise LoadError(f"Thread [{i}] had error: {r['error']}")
        return sum(r["completed"] for r in replies)

    def close(self) -> None:
        """Stop the load (requests in flight end first) and the processes."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                continue
        for c in self.conns:
            try:
                if c.poll(STOP_TIMEOUT_S):
                    c.recv()
            except (EOFError, OSError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
