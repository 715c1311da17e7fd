"""The worker process: one model instance, one framework, one blocking loop.

    scheduler ──LoadModel / ExecuteBatch / ReleaseOutputs / Shutdown──▶ worker
    scheduler ──Cancel (own connection, own thread: services/workers/python/cancel.py)──▶ worker
    worker ──WorkerReady / ModelLoaded / BatchDone──▶ scheduler
    worker ──InferResult (+ frames or refs into this worker's output arena)──▶ frontend
    frontend ──InferRequest (the direct path: services/workers/direct.py)──▶ worker

The loop is synchronous on purpose: a worker runs one batch at a time, and a framework
call holds the thread anyway. Inputs are read in place (the message's frames or the frontend's
shared memory); outputs above the inline threshold go into this worker's own arena and
are freed when the consumer sends them back (ReleaseOutputs, via the scheduler). The
result connections, their retries and the lent blocks are results.py's (ResultSender, owned).
A thread of its own tidies shared memory every shm.HOUSEKEEPING_S (shm.Housekeeper): the loop
blocks on its socket, and the arena and segment map are safe to tidy from another thread.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from services.common import logsettings, shm, transport
from services.common import messages as m
from services.common.client_shm import RegionMap, output_too_small
from services.common.datatypes import (
    datatype_of,
    deserialize_bytes_tensor,
    numpy_dtype,
    serialize_bytes_tensor,
)
from services.common.errors import Code, TriremeError, load_failed_text
from services.common.procutil import TERM_GRACE_S, die_with_parent, resident_bytes, set_title, tune_gc
from services.common.shm import DEFAULT_INLINE_THRESHOLD, Arena, SegmentMap, ShmUnavailable
from services.common.trace import stamp_results
from services.workers import warmup
from services.workers.batch_io import BatchIO
from services.workers.direct import DirectSide, hub_for
from services.workers.results import ResultSender
from services.workers.sequence import SequenceIO

if TYPE_CHECKING:
    from services.workers.backends.base import Backend

log = logging.getLogger("trireme.worker")


class Worker:
    def __init__(self, scheduler_addr: str, worker_id: str, inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
                 use_shm: bool = True) -> None:
        self.worker_id = worker_id
        self.scheduler_addr = scheduler_addr
        self.sock = transport.connect_blocking(scheduler_addr, worker_id.encode())
        self.segments = SegmentMap()
        self._housekeeping = threading.Event()   # set: the housekeeping thread stops
        self.regions = RegionMap()   # client shared memory (read in place, outputs written there)
        self.arena = Arena("out") if use_shm else None
        self.housekeeper = shm.Housekeeper(self.arena, self.segments)
        self.shm_ok = self.arena is not None
        self.domain = shm.domain() if self.arena is not None else ""
        if self.arena is not None and not self.domain:
            log.warning("shared memory is not usable here (%s): every output travels inline",
                        shm.SHM_DIR)
            self.shm_ok = False
        self.inline_threshold = inline_threshold
        self.backend: Backend | None = None
        self.batch_io: BatchIO | None = None   # ragged inputs, batch_input/batch_output
        # The outputs of a request that names none: every output of the config (Triton's
        # InferenceRequest::Normalize), decided here once for every backend.
        self.config_outputs: list[str] = []
        self.sequence_io: SequenceIO | None = None   # a sequence model's control/state inputs
        # A Python model may send responses from its own threads: the output arena and
        # the result sockets are used under this lock.
        self.lock = threading.Lock()
        # Results on their way to frontends (those for the scheduler's step socket go
        # inside BatchDone instead), and the output blocks lent with them
        self.results = ResultSender(self.sock, scheduler_addr, self.arena, self.lock)
        self.model = ""
        self.running = True
        # Decoupled answers that outlive execute(): finals sent while their batch still ran,
        # and requests left open when it ended (reported in BatchDone.streaming, and their
        # finals in StreamsDone), both under self.lock.
        self._finals: set[tuple[str, int]] = set()
        self._streaming: set[tuple[str, int]] = set()
        # When each of them sent its first response (perf_counter_ns; _REPORTED once a
        # BatchDone told it): the scheduler's first-response histogram (BatchDone.first).
        self._first_at: dict[tuple[str, int], int] = {}
        # The direct path: frontends' connections and the scheduler's, read in one loop.
        self.hub = hub_for(self)
        self.direct = DirectSide(self, self.hub) if self.hub is not None else None

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        # 1. announce ourselves; 2. serve messages until Shutdown or a signal.
        hub = self.hub
        self.sock.send(m.encode(m.WorkerReady(self.worker_id, os.getpid(), self.domain,
                                              hub.address if hub is not None else "")))
        self.start_housekeeping()
        handlers = self._handler_table()
        while self.running:
            try:
                if hub is None:
                    parts = self.sock.recv()
                else:
                    peer, parts = hub.recv()
                    if peer is not None:   # a frontend's direct request (or its leaving)
                        assert self.direct is not None   # (there is a hub)
                        self.direct.on_message(peer, parts)
                        continue
            except EOFError as e:   # the scheduler is gone: so is our reason to run
                log.warning("%s; exiting", e)
                return
            msg, frames = m.decode(parts, for_worker=True)
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("dropped a %s from the scheduler: not a message for a worker",
                            type(msg).__name__)
                continue
            handler(msg, frames)

    def _handler_table(self) -> dict[type, Callable[[Any, list[Any]], Any]]:
        """What the scheduler sends a worker, and who handles it: the socket's one table."""
        def execute(msg: m.ExecuteBatch, frames: list[Any]) -> None:
            self.housekeeper.busy = True
            self.execute(msg, frames)

        def shutdown(msg: m.Shutdown, frames: list[Any]) -> None:
            self.running = False

        direct = self.direct
        return {
            m.DirectEpoch: lambda msg, frames: direct.set_epoch(msg) if direct else None,
            m.FlushStats: lambda msg, frames: direct.send_stats(msg.flush_id) if direct else None,
            m.ExecuteBatch: execute,
            m.ReleaseOutputs: lambda msg, frames: self.results.release(msg.blocks),
            m.ForgetRegions: lambda msg, frames: self.regions.forget(msg.keys),
            m.ProbeReady: lambda msg, frames: self.probe(msg),
            m.LoadModel: lambda msg, frames: self.load(msg),
            m.LogSettingsChanged: lambda msg, frames: logsettings.apply(msg.settings),
            m.Shutdown: shutdown,
        }

    def start_housekeeping(self, period: float = shm.HOUSEKEEPING_S) -> threading.Thread:
        def tick() -> None:
            while not self._housekeeping.wait(period):
                try:
                    self.housekeep()
                except Exception:   # a failed tick must not end the ticking
                    log.exception("shared-memory housekeeping failed")

        t = threading.Thread(target=tick, name="trireme-housekeeping", daemon=True)
        t.start()
        return t

    def housekeep(self, now: float | None = None) -> bool:
        """Give back what a burst left: idle output segments (none holds a block a
        consumer still reads), mappings of frontends' input segments no batch read since
        the last tick, the C heap's free pages (shm.Housekeeper)."""
        return self.housekeeper.tick(now)

    def close(self) -> None:
        self._housekeeping.set()
        if self.direct is not None:   # frontends hear Goodbye before the instance goes
            self.direct.close()
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:
                log.exception("backend close failed")
        self.results.close()
        self.sock.close()
        self.segments.close()
        self.regions.close()
        if self.arena is not None:
            self.arena.close()

    # ------------------------------------------------------------------ load
    def load(self, msg: m.LoadModel) -> None:
        from protos import model_config_pb2 as mc
        from services.workers.backends.base import create_backend

        self.model = self.results.model = msg.model
        self.results.step_addr = msg.step_addr
        # BLS requests enter at the scheduler's frontend socket: bound to every interface
        # there, it is reached here by the host our own connection uses.
        msg.frontend_addr = transport.reachable(msg.frontend_addr, self.scheduler_addr)
        set_title(f"trireme worker {msg.instance_name} ({msg.model} v{msg.version})")
        try:
            cfg = mc.ModelConfig.FromString(msg.config)
            backend = self.backend = create_backend(cfg, msg)
            # Decided once here: batches of models without any keep the plain path.
            self.batch_io = None if backend.per_request else BatchIO.of(backend.config)
            self.config_outputs = [io.name for io in backend.config.output]
            self.sequence_io = SequenceIO.of(backend.config, msg.model_dir)
            warmup.run(backend, self.batch_io, msg)   # model_warmup, before the instance serves
            if backend.cancels is not None:   # its models can stop early: open the cancel channel
                backend.cancels.listen(self.scheduler_addr, self.worker_id)
            reply = m.ModelLoaded(self.worker_id, config=backend.config.SerializeToString(),
                                  probe=backend.probes_ready, metrics=backend.take_metrics(),
                                  cancellable=backend.cancels is not None,
                                  resident_bytes=resident_bytes())
        except TriremeError as e:
            reply = m.ModelLoaded(self.worker_id, error=m.ErrorRecord(int(e.code), e.message))
        except Exception as e:  # a framework's own load error
            log.exception("load of %s failed", msg.model)
            reply = m.ModelLoaded(self.worker_id, error=m.ErrorRecord(
                int(Code.INVALID_ARG), load_failed_text(msg.model, msg.version, e)))
        self.sock.send(m.encode(reply))
        tune_gc()   # the model's own objects, kept for good, leave the collector's view too

    def probe(self, msg: m.ProbeReady) -> None:
        """Readiness as the backend sees it (a Python model's is_ready())."""
        ready, reason = True, ""
        try:
            ready = bool(self.backend.is_ready())
            if not ready:
                reason = f"model '{self.model}' reports it is not ready"
        except Exception as e:  # noqa: BLE001 - any failure of the check means not ready
            ready, reason = False, str(e)
        self.sock.send(m.encode(m.ProbeResult(msg.probe_id, self.worker_id, ready, reason)))

    # ------------------------------------------------------------------ execute
    def _array(self, ref: m.TensorRef, frames: list[Any]) -> np.ndarray:
        if ref.frame >= 0:
            buf = frames[ref.frame]
        elif ref.key:
            buf = self.regions.view(ref.key, ref.offset, ref.nbytes)
        else:
            buf = self.segments.view(ref.segment, ref.offset, ref.nbytes)
        if ref.datatype == "BYTES":
            return deserialize_bytes_tensor(buf).reshape(ref.shape)
        return np.frombuffer(buf, dtype=numpy_dtype(ref.datatype), count=_count(ref.shape)).reshape(ref.shape)

    def execute(self, batch: m.ExecuteBatch, frames: list[Any], arrived: int = 0) -> None:
        """Run one batch and send its results; ``arrived``: a direct request's, when it was
        read (its statistics stay here for a DirectStats instead of a BatchDone)."""
        t0 = time.perf_counter_ns()
        items = batch.items
        failed = 0
        times = [t0, t0]
        replies: dict[str, tuple[list[m.InferResult], list[Any]]] = {}
        waiting: list[m.BatchItem] = []   # answered by their response senders, maybe later
        try:
            per_item = [{r.name: self._array(r, frames) for r in it.inputs} for it in items]
            if self.backend.reshape is not None:   # config reshape: the model sees reshape.shape
                per_item = [self.backend.reshape.inputs_for_model(p) for p in per_item]
            if self.sequence_io is not None:       # control and state inputs
                for it, tensors in zip(items, per_item):
                    tensors.update(self.sequence_io.inputs(it.parameters))
            if self.backend.per_request:
                failed = self._run_requests(items, per_item, replies, times, waiting)
            else:
                self._run_batch(items, per_item, replies, times)
        except Exception as e:
            for results, _ in replies.values():     # blocks of results never sent
                self.results.release([(r.segment, r.offset) for res in results for r in res.outputs
                              if r.segment])
            if not isinstance(e, TriremeError):
                log.exception("execution failed")
                e = TriremeError(Code.INTERNAL, str(e))
            replies = {}
            for it in items:
                self._add_error(replies, it, e)
            failed = len(items)
            waiting = []
        if batch.traced:   # sampled requests: their results carry the COMPUTE_* times
            stamp_results(items, replies, (t0, times[0], times[1], time.perf_counter_ns()))
        # Nothing is sent before the batch's fate is known, so each request gets one answer.
        with self.lock:
            steps, step_frames = self.results.flush(replies)
            streaming = []
            for it in waiting:
                key = (it.reply_to, it.req_id)
                if key in self._finals:
                    self._finals.discard(key)
                else:
                    self._streaming.add(key)
                    streaming.append(key)
            t3 = time.perf_counter_ns()
            t1, t2 = times
            if arrived:
                assert self.direct is not None   # (direct requests come through its hub)
                self.direct.record(items[0].batch_size, failed, t0, t1, t2, t3, arrived)
                return
            done = m.BatchDone(batch.batch_id, self.worker_id, t1 - t0, t2 - t1, t3 - t2, failed,
                               self.backend.take_metrics(), streaming, steps)
            if waiting or self._first_at:   # response senders answered: when they began
                done.first = self._first_ages(items, waiting, t3)
            done = self._encoded(done, step_frames)
        self.sock.send(done)

    def _encoded(self, msg: Any, frames: list[Any]) -> list[Any]:
        """A BatchDone or InferResults for the scheduler, encoded; a step result that cannot
        be (a model's value msgpack cannot hold) becomes an error for its request (under
        self.lock)."""
        try:
            return m.encode(msg, frames)
        except m.ENCODE_ERRORS:
            if isinstance(msg, m.BatchDone):
                fixed, _ = self.results.encodable(m.InferResults(msg.results), frames)
                msg.results = fixed.results if isinstance(fixed, m.InferResults) else [fixed]
            else:
                msg, _ = self.results.encodable(msg, frames)
            return m.encode(msg, frames)

    def _run_batch(self, items: list[m.BatchItem], per_item: list[dict], replies: dict,
                   times: list[int]) -> None:
        """A tensor backend: one execution over the whole batch."""
        bio = self.batch_io
        # 1. gather: a single request is used in place; a batch is one copy per input.
        if bio is not None:   # ragged inputs flattened, batch inputs generated
            inputs = bio.gather(per_item)
        elif len(items) == 1:
            inputs = per_item[0]
        else:
            inputs = {name: np.concatenate([p[name] for p in per_item]) for name in per_item[0]}
        times[0] = time.perf_counter_ns()
        # 2. run
        wanted = _union_outputs(items, self.config_outputs)
        seq = self.sequence_io
        if seq is not None and seq.state_outputs:   # computed for the next request, not sent
            wanted += [n for n in seq.state_outputs if n not in wanted]
        outputs = self.backend.execute(inputs, wanted)
        times[1] = time.perf_counter_ns()
        # 3. scatter: split back per request as views; one message per frontend carries
        #    all of its results (a hop costs per message, not per byte).
        if bio is not None:   # batch outputs split by their source input's shapes
            split = bio.scatter(outputs, [it.batch_size for it in items], per_item)
            for it, mine in zip(items, split):
                names = it.outputs or self.config_outputs
                self._add_result(replies, it, [(n, mine[n]) for n in names])
            return
        start = 0
        for it in items:
            stop = start + it.batch_size
            mine = outputs if len(items) == 1 else {k: v[start:stop] for k, v in outputs.items()}
            if seq is not None:
                seq.keep(it.parameters, mine)
            names = it.outputs or self.config_outputs
            self._add_result(replies, it, [(n, mine[n]) for n in names])
            start = stop

    def _run_requests(self, items: list[m.BatchItem], per_item: list[dict], replies: dict,
                      times: list[int], waiting: list[m.BatchItem]) -> int:
        """A per-request backend (Python): each request answered on its own, now or later
        through ``_reply`` (those go to ``waiting``). Returns how many failed."""
        times[0] = time.perf_counter_ns()
        answers = self.backend.execute_requests(items, per_item, lambda i, out, err, final: (
            self._reply(items[i], out, err, final)))
        times[1] = time.perf_counter_ns()
        failed = 0
        for it, answer in zip(items, answers):
            if isinstance(answer, TriremeError):
                self._add_error(replies, it, answer)
                failed += 1
            elif answer is None:   # its response sender answers
                waiting.append(it)
            else:
                try:
                    self._add_result(replies, it, _chosen(it, answer))
                except Exception as e:  # noqa: BLE001 - e.g. no datatype fits: fails this request
                    self._add_error(replies, it, TriremeError(
                        Code.INTERNAL, f"model '{self.model}' returned an output it cannot send: {e}"))
                    failed += 1
        return failed

    def _reply(self, item: m.BatchItem, outputs: dict | None, error: TriremeError | None,
               final: bool) -> None:
        """A response sent by a model through its response sender, from any thread: it
        leaves at once (a decoupled model streams), the sockets and arena under the lock."""
        replies: dict = {}
        if error is not None:
            self._add_error(replies, item, error, final)
        else:
            self._add_result(replies, item, _chosen(item, outputs or {}), final, outputs is None)
        if final and item.trace:   # a sampled request: its trace goes on (without COMPUTE_*)
            stamp_results((item,), replies, ())
        key = (item.reply_to, item.req_id)
        with self.lock:
            steps, step_frames = self.results.flush(replies)
            if steps:   # a decoupled ensemble step's response, on the scheduler connection
                self.sock.send(self._encoded(m.InferResults(steps), step_frames))
            if (error is not None or outputs is not None) and key not in self._first_at:
                self._first_at[key] = time.perf_counter_ns()   # (a flags-only final is none)
            if final:
                if key in self._streaming:   # its batch is done: the scheduler waits for word
                    self._streaming.discard(key)
                    at = self._first_at.pop(key, _REPORTED)
                    first = -1 if at == _REPORTED else time.perf_counter_ns() - at
                    self.sock.send(m.encode(m.StreamsDone(self.worker_id, [key], [first])))
                else:
                    self._finals.add(key)

    def _first_ages(self, items: list[m.BatchItem], waiting: list[m.BatchItem], now: int) -> list[int]:
        """BatchDone.first (under self.lock); what is told is forgotten, but for streaming
        requests, whose later responses must not count as their first."""
        sent, open_ = self._first_at, self._streaming
        if not waiting:   # all answered with the batch: the plain timing (a failed execute)
            for it in items:
                sent.pop((it.reply_to, it.req_id), None)
            return []
        senders = {id(it) for it in waiting}
        ages = []
        for it in items:
            key = (it.reply_to, it.req_id)
            at = sent.pop(key, None)
            if id(it) not in senders:
                ages.append(-2)
            elif at is None:
                ages.append(-1)
            else:
                ages.append(now - at)
                if key in open_:
                    sent[key] = _REPORTED
        return ages

    def _add_error(self, replies: dict, item: m.BatchItem, e: TriremeError, final: bool = True) -> None:
        stream, order = (item.stream, item.order) if final else (0, 0)
        replies.setdefault(item.reply_to, ([], []))[0].append(m.InferResult(
            item.req_id, error=m.ErrorRecord(int(e.code), e.message), stream=stream, order=order,
            final=final))

    def _add_result(self, replies: dict, item: m.BatchItem, outputs: list[tuple[str, np.ndarray]],
                    final: bool = True, empty: bool = False) -> None:
        # Every output is converted before any block is taken: a conversion error leaves
        # nothing allocated and nothing half-added to ``replies``.
        if self.backend.reshape is not None:   # config reshape: clients see dims
            outputs = self.backend.reshape.outputs_for_client(outputs)
        wire = [(name, list(arr.shape), *_to_wire(arr)) for name, arr in outputs]
        dest: dict[str, memoryview] = {}
        if item.out_regions:   # each region mapped and big enough, or this request fails alone
            try:
                dest = self._output_regions(item.out_regions, wire)
            except TriremeError as e:
                self._add_error(replies, item, e, final)
                return
        results, frames = replies.setdefault(item.reply_to, ([], []))
        refs: list[m.TensorRef] = []
        for name, shape, datatype, data in wire:
            nbytes = len(data)
            ref = m.TensorRef(name, datatype, shape, nbytes)
            view = dest.get(name) if dest else None
            if view is not None:   # the client's memory: written there, not sent
                view[:] = data
                region = item.out_regions[name]
                ref.key, ref.offset = region.key, region.offset
            elif nbytes >= self.inline_threshold and self.shm_ok and item.shm:
                try:
                    with self.lock:
                        block = self.arena.alloc(nbytes)
                    block.view[:] = data
                    ref.segment, ref.offset = block.segment, block.offset
                except ShmUnavailable as e:
                    log.warning("output arena unavailable, sending inline: %s", e)
                    self.shm_ok = False   # keep the arena: blocks in use still get released
            if not ref.segment and not ref.key:
                ref.frame = len(frames)
                frames.append(data)
            refs.append(ref)
        # preserve_ordering orders final responses; a decoupled model's earlier ones go at once
        stream, order = (item.stream, item.order) if final else (0, 0)
        results.append(m.InferResult(item.req_id, outputs=refs, stream=stream, order=order,
                                     final=final, empty=empty))


    def _output_regions(self, regions: dict[str, m.OutputRegion], wire: list
                        ) -> dict[str, memoryview]:
        """Where each output the client wants in its shared memory goes (exactly its bytes)."""
        dest = {}
        for name, _, _, data in wire:
            r = regions.get(name)
            if r is not None:
                if len(data) > r.nbytes:
                    raise output_too_small(name, r.nbytes, len(data))
                dest[name] = self.regions.view(r.key, r.offset, len(data))
        return dest


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chosen(item: m.BatchItem, outputs: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """A Python model's outputs that the request asked for (all when it named none)."""
    return [(n, outputs[n]) for n in (item.outputs or outputs) if n in outputs]


def _union_outputs(items: list[m.BatchItem], config_outputs: list[str]) -> list[str]:
    """The outputs one execution computes: each name a request of the batch asked for, and
    the config's outputs for a request that named none; in order of first mention."""
    return list(dict.fromkeys(name for it in items for name in it.outputs or config_outputs))


def _to_wire(arr: np.ndarray) -> tuple[str, memoryview | bytes]:
    """(datatype, raw bytes) of an output: BYTES serialized, others as a byte view."""
    datatype = datatype_of(arr.dtype)
    if datatype == "BYTES":
        return datatype, serialize_bytes_tensor(arr)
    arr = np.ascontiguousarray(arr)
    return datatype, memoryview(arr.reshape(-1).view(np.uint8))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trireme worker",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="one model instance's worker (a scheduler or a "
                                            "worker host starts it)")
    p.add_argument("--scheduler", required=True,
                   help="the scheduler's worker socket address")
    p.add_argument("--worker-id", required=True,
                   help="the id the scheduler gave this worker (its identity on the socket)")
    p.add_argument("--inline-threshold", type=int, default=DEFAULT_INLINE_THRESHOLD,
                   help="outputs smaller than this many bytes travel inline, larger ones in "
                        "shared memory")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process exits (0: none)")
    p.add_argument("--no-shm", action="store_true",
                   help="send every tensor inline (no shared host)")
    logsettings.add_log_args(p)   # (defaults: the settings of the process that started it)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logsettings.configure(logsettings.from_args(args))
    set_title(f"trireme worker {args.worker_id}")
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent coordinates Ctrl-C

    worker = Worker(args.scheduler, args.worker_id, args.inline_threshold, not args.no_shm)

    def on_term(signum, frame):
        # SystemExit wherever the main thread is (every handler around a model's code lets
        # it through), so the worker closes as usual: finalize(), Goodbye to its frontends.
        # Cleanup runs once, in the finally below: close() takes locks a second signal
        # arriving inside it could never re-enter. A model that swallows the SystemExit, or
        # a close() that hangs, is ended by the guard TERM_GRACE_S later.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        arm_guard()
        raise SystemExit(0)

    arm_guard = _exit_if_stuck_after_term()
    signal.signal(signal.SIGTERM, on_term)
    tune_gc()
    try:
        worker.run()
    finally:
        worker.close()
    return 0


_REPORTED = -1   # _first_at: the first response was told in a BatchDone


# SIGTERM is obeyed whatever the model does. The handler (on_term) raises SystemExit, which
# ends a worker at once unless the model's own code catches it (`except BaseException`) or
# the main thread never returns to the interpreter (a model stuck in native code: a
# deadlocked lock, a hung driver call). For those, a thread ends the process TERM_GRACE_S
# after the SIGTERM: the C-level handler writes the signal number to a wakeup fd (also when
# no Python code runs), and on_term writes it too (also when a model took the wakeup fd for
# its own). Whoever stops a worker SIGKILLs it after the same grace, but after a kill -9 of
# the scheduler (the SIGTERM came from PR_SET_PDEATHSIG) nobody would.
def _exit_if_stuck_after_term() -> Callable[[], None]:
    """Start the guard; returns what on_term calls to arm it."""
    from services.common.shm import unlink_segments_of
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def guard() -> None:
        while os.read(r, 1)[0] != signal.SIGTERM:   # (a model's own handlers write here too)
            pass
        time.sleep(TERM_GRACE_S)
        log.error("still running %.0f s after SIGTERM (the model ignores it, or is stuck "
                  "outside Python): exiting", TERM_GRACE_S)
        unlink_segments_of(os.getpid())
        os._exit(1)

    def arm() -> None:
        try:
            os.write(w, bytes([signal.SIGTERM]))
        except OSError:   # the pipe is full: the guard has a byte to read already
            pass

    threading.Thread(target=guard, name="trireme-term-guard", daemon=True).start()
    return arm


if __name__ == "__main__":
    sys.exit(main())
