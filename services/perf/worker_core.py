"""The part of a load-generating process that does not depend on its runtime (the lean path
on uvloop; tritonclient's: gevent for HTTP, asyncio for gRPC): what it was asked to run
(`WorkerSpec`), which data and sequence flags the next request carries (`RequestSource`),
the record of every request, the control messages from the profiler and their answers
(`WorkerState.handle`).

Control messages (profiler -> process, over a multiprocessing pipe; one answer each):
  ("load", {"concurrency": n} | {"rate": r, "distribution": d, "phase": s}, budget)
  ("collect",)  -> {"records": bytes, "cpu": seconds, "error": str|None, "completed": n,
                    "sent": n, "delayed": n}
  ("count",)    -> {"completed": requests completed so far, "error": str|None}
  ("stop",)     -> None, after the requests in flight ended
"""
from __future__ import annotations

import random
import resource
import time
from dataclasses import dataclass, field

import numpy as np

from services.perf.flags import SslSettings
from services.perf.inputs import Sample
from services.perf.model import Tensor

# One row per finished request: monotonic ns of its start and its last response, the ns
# the client spent building it (send) and decoding its outputs (recv), responses, flags.
RECORD = np.dtype([("start", "<i8"), ("end", "<i8"), ("send", "<i8"), ("recv", "<i8"),
                   ("responses", "<i4"), ("flags", "<i4")])
SEQUENCE_END = 1
DELAYED = 2


@dataclass
class SequenceSpec:
    length: int                 # --sequence-length
    variation: float            # --sequence-length-variation, %
    length_specified: bool      # (else a JSON stream's own length wins)
    id_start: int
    id_end: int | None          # exclusive; None: unbounded


@dataclass
class WorkerSpec:
    """What one load-generating process runs; picklable (it crosses a spawn)."""
    index: int
    processes: int
    protocol: str
    url: str
    ssl: SslSettings
    headers: dict[str, str]
    model: str
    version: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    requests: list[Sample]          # non-sequence models: the requests' tensors, round robin
    streams: list[list[Sample]]     # sequence models: one list per data stream
    sequence: SequenceSpec | None
    streaming: bool = False
    shared_memory: str = "none"
    output_shm_size: int = 102400
    batch_size: int = 1
    batched: bool = True
    grpc_compression: str | None = None
    parameters: dict[str, object] = field(default_factory=dict)
    input_json: bool = False
    output_json: bool = False
    lean: bool = False              # the lean path (load_lean), else tritonclient's
    seed: int = 0


@dataclass
class Planned:
    """One request to send: which prepared tensors, and its sequence flags."""
    data: int                   # index into the prepared requests (or the flat sample index)
    sequence_id: int = 0
    start: bool = False
    end: bool = False


class RequestSource:
    """Which data each request carries. Non-sequence models: every slot walks the requests
    round robin from its own offset. Sequence models: a slot plays whole sequences, one
    request at a time, each sequence on the next stream with a fresh id."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed * 7919 + spec.index)
        self._next_id = 0
        # sequence models: the flat index of each stream's first sample
        self.offsets: list[int] = []
        n = 0
        for s in spec.streams:
            self.offsets.append(n)
            n += len(s)
        self._stream = spec.index

    def new_id(self) -> int:
        """Ids unique across processes: process i of P takes start+i, start+i+P, ..."""
        seq = self.spec.sequence
        assert seq is not None
        k = self._next_id * self.spec.processes + self.spec.index
        self._next_id += 1
        if seq.id_end is not None:
            return seq.id_start + k % (seq.id_end - seq.id_start)
        return seq.id_start + k

    def _length(self, stream: list[Sample]) -> int:
        seq = self.spec.sequence
        assert seq is not None
        if not seq.length_specified and len(stream) > 1:
            return len(stream)
        spread = seq.length * seq.variation / 100
        return max(1, round(self.rng.uniform(seq.length - spread, seq.length + spread)))

    def slot(self, slot: int) -> SlotCursor:
        return SlotCursor(self, slot)


class SlotCursor:
    """One slot's (or one live sequence's) position in the data."""

    def __init__(self, source: RequestSource, slot: int) -> None:
        self.source = source
        spec = source.spec
        self.pos = (slot * spec.processes + spec.index) * max(1, spec.batch_size)
        self.seq_id = 0
        self.left = 0
        self.stream = 0
        self.step = 0

    def next(self) -> Planned:
        src, spec = self.source, self.source.spec
        if spec.sequence is None:
            n = len(spec.requests)
            self.pos += 1
            return Planned(self.pos % n)
        start = self.left == 0
        if start:
            src._stream = (src._stream + spec.processes) % len(spec.streams)
            self.stream, self.step = src._stream, 0
            self.seq_id = src.new_id()
            self.left = src._length(spec.streams[self.stream])
        stream = spec.streams[self.stream]
        data = src.offsets[self.stream] + self.step % len(stream)
        self.step += 1
        self.left -= 1
        return Planned(data, self.seq_id, start, self.left == 0)


class WorkerState:
    """Targets set by the profiler, the records, the first error; the runtime module reads
    the targets and calls `record`/`fail`."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.source = RequestSource(spec)
        self.concurrency = 0
        self.rate = 0.0
        self.distribution = "constant"
        self.phase = 0.0
        self.budget: int | None = None   # requests still to start; None: no limit
        self.error: str | None = None
        self.completed = 0
        self.sent = 0
        self.delayed = 0
        self.stopping = False
        self._rows: list[tuple[int, int, int, int, int, int]] = []

    # ---- the runtime's side
    def may_start(self) -> bool:
        """Take one request from the budget (False: the budget is spent, or an error)."""
        if self.error is not None or self.stopping:
            return False
        if self.budget is not None:
            if self.budget <= 0:
                return False
            self.budget -= 1
        self.sent += 1
        return True

    def record(self, start: int, end: int, send: int, recv: int, responses: int = 1,
               flags: int = 0) -> None:
        self._rows.append((start, end, send, recv, responses, flags))
        self.completed += 1

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message

    # ---- the profiler's side
    def handle(self, msg: tuple) -> object:
        kind = msg[0]
        if kind == "load":
            target, budget = msg[1], msg[2]
            self.budget = budget
            if "concurrency" in target:
                self.concurrency, self.rate = target["concurrency"], 0.0
            else:
                self.concurrency = 0
                self.rate, self.distribution = target["rate"], target["distribution"]
                self.phase = target.get("phase", 0.0)
            return None
        if kind == "collect":
            rows = np.array(self._rows, dtype=RECORD) if self._rows else np.empty(0, RECORD)
            self._rows = []
            ru = resource.getrusage(resource.RUSAGE_SELF)
            return {"records": rows.tobytes(), "cpu": ru.ru_utime + ru.ru_stime,
                    "error": self.error, "completed": self.completed, "sent": self.sent,
                    "delayed": self.delayed}
        if kind == "count":
            return {"completed": self.completed, "error": self.error}
        if kind == "stop":
            self.stopping = True
            self.concurrency, self.rate = 0, 0.0
            return None
        raise ValueError(f"unknown control message {kind!r}")


def now_ns() -> int:
    """The clock of every timestamp, shared by all processes (CLOCK_MONOTONIC)."""
    return time.monotonic_ns()
