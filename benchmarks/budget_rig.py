"""The in-process rig of benchmarks/request_budget.py: the frontend, the scheduler and the
workers built as their processes build them but wired to fake transports, the requests
tritonclient sends (HTTP body, gRPC ModelInferRequest, HTTP/2 frames), and the clock and
loops that time one stage per call."""
from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server import ROOT  # noqa: E402
from vs_triton_models import ENSEMBLE, add_sub_inputs, build_repository  # noqa: E402

sys.path.insert(0, str(ROOT))

from protos import model_config_pb2 as mc  # noqa: E402
from services.common import messages as m  # noqa: E402
from services.common import shm, transport_stream  # noqa: E402
from services.common.config import parse_pbtxt  # noqa: E402
from services.dataplane.client import DataPlane  # noqa: E402
from services.frontend.settings import FrontendSettings  # noqa: E402
from services.scheduler.main import Scheduler  # noqa: E402
from services.scheduler.settings import SchedulerSettings  # noqa: E402
from services.workers.backends.base import create_backend  # noqa: E402
from services.workers.main import Worker  # noqa: E402
from services.workers.results import ResultSender  # noqa: E402

A, B = add_sub_inputs()
SERVICE = "/inference.GRPCInferenceService/ModelInfer"


# ============================================================================ timing
# The clock of the in-process stages: this thread's CPU time (other processes on the
# shared 2 cores preempt us; CPU time does not count that), or with --wall perf_counter_ns.
CLOCK = time.thread_time_ns


def per_call(fn, n: int, repeats: int) -> float:
    """µs per fn() call: the median of `repeats` timings of n calls (after n // 5 warm-up)."""
    for _ in range(max(1, n // 5)):
        fn()
    runs = []
    for _ in range(repeats):
        t = CLOCK()
        for _ in range(n):
            fn()
        runs.append((CLOCK() - t) / n / 1e3)
    return statistics.median(runs)


def in_loop(loop, fn, n: int, repeats: int) -> float:
    """per_call() run inside `loop` (for functions that need a running loop)."""
    async def run() -> float:
        return per_call(fn, n, repeats)
    t = loop.run_until_complete(run())
    loop.run_until_complete(asyncio.sleep(0))     # what the calls scheduled
    return t


def per_request_async(loop, one, n: int, repeats: int) -> float:
    """µs per `await one()` run back to back on `loop` (median of repeats)."""
    async def run(k: int) -> float:
        t = CLOCK()
        for _ in range(k):
            await one()
        return (CLOCK() - t) / k / 1e3
    loop.run_until_complete(run(max(1, n // 5)))
    return statistics.median(loop.run_until_complete(run(n)) for _ in range(repeats))


def segmented(one_pass, n: int, repeats: int, out: dict) -> None:
    """one_pass(timed) appends ns per named segment; out[name] = µs, median of repeats."""
    for _ in range(max(1, n // 5)):
        one_pass()
    runs: list[dict] = []
    for _ in range(repeats):
        timed: dict = {}
        for _ in range(n):
            one_pass(timed)
        runs.append({k: sum(v) / len(v) / 1e3 for k, v in timed.items()})
    for k in runs[0]:
        out[k] = statistics.median(r[k] for r in runs)


def framed(parts) -> bytes:
    """The bytes transport_stream puts on the wire for one message."""
    return b"".join(bytes(p) if not isinstance(p, bytes) else p
                    for p in transport_stream.frame(parts))


def split(data: bytes) -> list:
    """What BlockingConnection.recv returns for one framed message."""
    return transport_stream._split(memoryview(bytearray(data))[4:])


class FakeTransport(asyncio.Transport):
    """An asyncio transport that hands each write to `on_write` (no syscall)."""

    def __init__(self, on_write=None) -> None:
        super().__init__()
        self.on_write = on_write

    def write(self, data) -> None:
        if self.on_write is not None:
            self.on_write(data)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class FakeBlocking:
    """The worker's BlockingConnection.send without the socket: frames and joins."""

    def __init__(self) -> None:
        self.last = b""

    def send(self, parts) -> None:
        self.last = framed(parts)

    def close(self) -> None:
        pass


def peer(listener, identity: bytes, on_write=None):
    """A connected peer of a transport_stream.Listener that was never started."""
    p = transport_stream._PeerProtocol(listener)
    p.connection_made(FakeTransport(on_write))
    p.data_received(framed([identity]))
    return p


# ============================================================================ the pieces
class Rig:
    """One scheduler, one worker per model (add_sub, scale), one DataPlane, on fakes."""

    def __init__(self, loop, tmp: Path) -> None:
        self.loop = loop
        self.tmp = tmp
        repo = build_repository(tmp)
        self.repo = repo
        self.domain = shm.domain()
        # ---- scheduler
        s = self.sched = Scheduler(SchedulerSettings(
            [repo], f"unix://{tmp}/f.sock", f"unix://{tmp}/w.sock", allow_metrics=False))
        s.step_addr = f"unix://{tmp}/steps.sock"
        pids = itertools.count(1_000_000)

        async def spawn(inst, config, model_dir, autocomplete):
            inst.pid, inst.shm_domain, inst.loaded = next(pids), self.domain, True
            s.workers.by_pid[inst.pid] = inst
            s.workers.by_id[inst.worker_id] = inst
            return mc.ModelConfig.FromString(config)

        s.models.spawn_instance = spawn
        s.fsock = transport_stream.Listener(f"unix://{tmp}/f.sock", s._on_frontend, s._frontend_lost)
        s.wsock = transport_stream.Listener(f"unix://{tmp}/w.sock", s.workers.on_message)
        s.ssock = transport_stream.Listener(s.step_addr, s._on_step_results)
        for name in ("add_sub", "scale", ENSEMBLE):
            loop.run_until_complete(s.models.load(name))
        s.ready = True
        self.to_frontend = b""
        self.to_worker: dict[str, bytes] = {}

        def keep_front(d):
            self.to_frontend = bytes(d)
        self.front_peer = peer(s.fsock, b"frontend-1", keep_front)
        self.worker_peer = {}
        for name in ("add_sub", "scale"):
            inst = s.models.lookup(name).instances[0]

            def keep(d, name=name):
                self.to_worker[name] = bytes(d)
            self.worker_peer[name] = peer(s.wsock, inst.worker_id.encode(), keep)
        # ---- data plane (the frontend's half)
        self.result_addr = f"unix://{tmp}/results.sock"
        self.front_peer.data_received(framed(m.encode(m.FrontendHello(os.getpid(), self.domain,
                                                                       self.result_addr))))
        dp = self.dp = DataPlane(FrontendSettings(f"unix://{tmp}/f.sock", self.result_addr))
        dp._scheduler_lost, dp._scheduler_ready = False, True
        self.sent = b""                              # the frontend's last message to the scheduler
        self.on_sent = None
        conn = transport_stream.Connection(dp.settings.scheduler_addr, dp._on_message)
        conn._transport = FakeTransport(self._frontend_wrote)
        dp._sched = conn
        dp._loop = self.loop                         # (what start() sets)
        dp._domain = self.domain
        dp._paths()   # (no routes here: the scheduled path)
        for name in ("add_sub", "scale", ENSEMBLE):
            self.front_peer.data_received(framed(m.encode(m.GetModelInfo(next(dp._ids), name))))
            info, _ = m.decode(split(self.to_frontend))
            dp.models.infos[name] = info
        results = transport_stream.Listener(self.result_addr, dp._on_result)
        self.results_peer = peer(results, b"worker-1")
        # ---- workers
        self.workers = {n: self._worker(n) for n in ("add_sub", "scale")}

    def _frontend_wrote(self, data) -> None:
        self.sent = bytes(data)
        if self.on_sent is not None:
            self.on_sent(self.sent)

    def _worker(self, name: str) -> Worker:
        cfg = parse_pbtxt((self.repo / name / "config.pbtxt").read_text())
        inst = self.sched.models.lookup(name).instances[0]
        w = Worker.__new__(Worker)
        w.worker_id, w.scheduler_addr = inst.worker_id, f"unix://{self.tmp}/w.sock"
        w.sock = FakeBlocking()
        w.hub, w.direct = None, None   # (the scheduled path: ExecuteBatch in, BatchDone out)
        w.segments, w.regions = shm.SegmentMap(), None
        w.arena, w.shm_ok, w.domain = shm.Arena("out"), True, self.domain
        w.housekeeper = shm.Housekeeper(w.arena, w.segments)
        w.inline_threshold = shm.DEFAULT_INLINE_THRESHOLD
        w.backend = create_backend(cfg, m.LoadModel(name, 1, str(self.repo / name), cfg.SerializeToString(),
                                                    f"{name}_0", step_addr=self.sched.step_addr))
        w.batch_io, w.sequence_io = None, None
        w.config_outputs = [o.name for o in w.backend.config.output]
        w.lock, w.model, w.running = threading.Lock(), name, True
        w.results = ResultSender(w.sock, w.scheduler_addr, w.arena, w.lock)
        w.results.pushers[self.result_addr] = FakeBlocking()
        w.results.model, w.results.step_addr = name, self.sched.step_addr
        w._finals, w._streaming, w._first_at = set(), set(), {}
        return w

    # one message through one process's handler -----------------------------------------
    def scheduler_gets_request(self, data: bytes) -> None:
        self.front_peer.data_received(data)

    def scheduler_gets_batch_done(self, model: str, data: bytes) -> None:
        self.worker_peer[model].data_received(data)

    def worker_runs(self, model: str, data: bytes) -> tuple[bytes, bytes]:
        """(result message to the frontend or b"", BatchDone) for one ExecuteBatch."""
        w = self.workers[model]
        msg, frames = m.decode(split(data), for_worker=True)
        w.execute(msg, frames)
        return w.results.pushers[self.result_addr].last, w.sock.last


# ============================================================================ client bytes
def http_request_bytes(model: str = "add_sub") -> bytes:
    """What tritonclient.http sends for add_sub: binary inputs, two binary outputs."""
    import tritonclient.http as th
    ins = []
    for name, arr in (("INPUT0", A), ("INPUT1", B)):
        i = th.InferInput(name, list(arr.shape), "FP32")
        i.set_data_from_numpy(arr)
        ins.append(i)
    outs = [th.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    body, json_size = th.InferenceServerClient.generate_request_body(ins, outputs=outs)
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
            "User-Agent: python/gevent-http-client-1.5.3\r\nAccept-Encoding: identity\r\n"
            f"Inference-Header-Content-Length: {json_size}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def grpc_message(model: str) -> bytes:
    """tritonclient.grpc's ModelInferRequest for add_sub (or the ensemble), serialized."""
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, arr in (("INPUT0", A), ("INPUT1", B)):
        t = req.inputs.add()
        t.name, t.datatype = name, "FP32"
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    for name in (("OUTPUT0", "OUTPUT1") if model == "add_sub" else ("OUTPUT0",)):
        req.outputs.add().name = name
    return req.SerializeToString()


class H2Client:
    """The frames a gRPC client writes: preface, SETTINGS, a large connection window, then
    per call HEADERS (HPACK, one encoder for the connection, as a client keeps) and DATA."""

    def __init__(self) -> None:
        from hpack import Encoder
        self.enc = Encoder()
        self.sid = -1

    @staticmethod
    def frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload

    def preface(self) -> bytes:
        return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + self.frame(4, 0, 0, b"")
                + self.frame(8, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))

    def call(self, message: bytes, model: str) -> tuple[int, bytes]:
        self.sid += 2
        block = self.enc.encode([
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE),
            (":authority", "127.0.0.1:8001"), ("content-type", "application/grpc"),
            ("te", "trailers"), ("grpc-accept-encoding", "identity,deflate,gzip"),
            ("user-agent", "grpc-python/1.66.0 grpc-c/43.0.0 (linux; chttp2)")])
        body = b"\x00" + struct.pack(">I", len(message)) + message
        return self.sid, self.frame(1, 4, self.sid, block) + self.frame(0, 1, self.sid, body)


def ended(data: bytes, sid: int) -> bool:
    """Whether ``data`` (server frames) holds stream ``sid``'s trailers (END_STREAM)."""
    pos = 0
    while pos + 9 <= len(data):
        n = int.from_bytes(data[pos:pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        s = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        if s == sid and flags & 1 and kind in (0, 1):
            return True
        pos += 9 + n
    return False


