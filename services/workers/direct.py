"""A worker's direct path: requests a frontend sends straight here, on the route the
scheduler published for this instance (messages_direct.py), owned by the Worker (main.py).

    frontend ──InferRequest(epoch)──▶ [direct listener] ─▶ run as a batch of one
             ◀──InferResult / stale refusal / Goodbye── (on the same connection)
    scheduler ──DirectEpoch──▶ ─▶ EpochSet; FlushStats ─▶ DirectStats

A request of another epoch than the one the scheduler set last (0: none) is refused unrun
(InferResult.stale): its frontend sends it through the scheduler. Before each request runs,
whatever has arrived meanwhile is read: a Cancel among it for a request not yet run answers
that request CANCELLED instead (a running one is told through the scheduler's cancel
channel, as on the scheduled path). Every result for a
frontend that opened a direct connection goes back on that connection, so a Goodbye
written last before a clean exit tells it that whatever it has no answer for was never
run. Statistics are kept here and sent in batches (DirectStats), at most DIRECT_STATS_S
apart while traffic lasts, and at once when the scheduler asks (FlushStats), before an
EpochSet, and on leaving.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common import messages as m
from services.common import transport
from services.common.errors import CANCELLED_TEXT, Code
from services.common.transport_hub import Hub, Peer

if TYPE_CHECKING:
    from services.workers.main import Worker

log = logging.getLogger("trireme.worker")

DIRECT_STATS_S = 0.5
_CANCEL = bytes([m.Kind.CANCEL])


def listen_address(scheduler_addr: str, worker_id: str) -> str:
    """Where a worker listens for direct requests: a Unix socket beside the scheduler's
    worker socket; "" when the scheduler is reached otherwise (frontends on other hosts
    could not reach a worker's own address: their requests go through the scheduler)."""
    if not scheduler_addr.startswith("unix://"):
        return ""
    return f"unix://{os.path.join(os.path.dirname(scheduler_addr[len('unix://'):]), worker_id)}.direct.sock"


class DirectSide:
    def __init__(self, worker: Worker, hub: Hub) -> None:
        self.worker = worker
        self.hub = hub
        self.epoch = 0
        self._records: list[m.DirectRecord] = []
        # (reply_to, req_id) of requests read and not run whose caller went away; only those
        # still queued are kept (a Cancel follows its request on the same connection)
        self._cancelled: set[tuple[str, int]] = set()
        self._sent_at = time.monotonic()
        # What a frontend sends on a direct connection, and who handles it: the direct
        # listener's one table
        self._handlers: dict[type, Callable[[Peer, Any, list[Any]], None]] = {
            m.InferRequest: self._run,
            m.InferRequests: self._run_each,
            m.Cancel: self._late_cancel,
        }

    # ------------------------------------------------------------------ requests
    def on_message(self, peer: Peer, parts: list[Any] | None) -> None:
        if parts is None:
            self._lost(peer)
            return
        msg, frames = m.decode(parts, for_worker=True)
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(peer, msg, frames)
        else:
            log.warning("dropped a %s on a direct connection: not a message for a worker",
                        type(msg).__name__)
        if self._cancelled and not any(p is not None for p, _ in self.hub.queued):
            self._cancelled.clear()   # every request read has run or was answered

    def _run_each(self, peer: Peer, msg: m.InferRequests, frames: list[Any]) -> None:
        for req in msg.requests:   # they share the frames (indexes count over them)
            self._run(peer, req, frames)

    def _late_cancel(self, peer: Peer, msg: m.Cancel, frames: list[Any]) -> None:
        """A Cancel read after its requests (it follows them on the same connection, and
        _was_cancelled takes the ones read before a request runs): they ran already."""

    def _run(self, peer: Peer, req: m.InferRequest, frames: list[Any]) -> None:
        arrived = time.perf_counter_ns()
        w = self.worker
        if req.epoch != self.epoch or not self.epoch:
            self._refuse(peer, req.req_id)
            return
        if w.results.pushers.get(req.reply_to) is not peer:
            self._adopt(peer, req.reply_to)
        if self._was_cancelled(req):
            with w.lock:
                w.results.push(req.reply_to, m.InferResult(req.req_id, error=m.ErrorRecord(
                    int(Code.CANCELLED), CANCELLED_TEXT)))
            now = time.perf_counter_ns()
            self._records.append(m.DirectRecord(req.batch_size, 1, 0, 0, 0, now - arrived,
                                                now - arrived, True))
            return
        w.housekeeper.busy = True
        item = m.BatchItem(req.reply_to, req.req_id, req.inputs, req.outputs, req.parameters,
                           req.batch_size, request_id=req.request_id, shm=req.shm)
        w.execute(m.ExecuteBatch(0, [item]), frames, arrived)

    def _was_cancelled(self, req: m.InferRequest) -> bool:
        """Whether ``req``'s caller went away: the Cancels that arrived meanwhile are read
        (one non-blocking poll) and taken out of the queue."""
        hub = self.hub
        hub.read_now()
        cancelled = self._cancelled
        queued = hub.queued
        if queued:
            kept = [(peer, parts) for peer, parts in queued
                    if peer is None or parts is None or bytes(parts[0]) != _CANCEL]
            if len(kept) < len(queued):
                for peer, parts in queued:
                    if peer is not None and parts is not None and bytes(parts[0]) == _CANCEL:
                        msg, _ = m.decode(parts, for_worker=True)
                        assert isinstance(msg, m.Cancel)
                        cancelled.update((msg.reply_to, i) for i in msg.req_ids)
                queued.clear()
                queued.extend(kept)
        if not cancelled:
            return False
        key = (req.reply_to, req.req_id)
        hit = key in cancelled
        cancelled.discard(key)
        return hit

    def _refuse(self, peer: Peer, req_id: int) -> None:
        try:
            peer.send(m.encode(m.InferResult(req_id, stale=True)))
        except OSError:
            pass   # that frontend is gone: nothing waits for the answer

    def _adopt(self, peer: Peer, address: str) -> None:
        """Results for this frontend go back on its direct connection from now on (the
        connection to its result socket, if any, is closed: what it sent is delivered)."""
        w = self.worker
        with w.lock:
            old = w.results.pushers.get(address)
            w.results.pushers[address] = peer
        if old is not None and old is not peer:
            old.close()

    def _lost(self, peer: Peer) -> None:
        """A frontend closed its direct connection (it stopped or died): its results, and
        the output blocks lent to it, are handled as for a broken result connection."""
        w = self.worker
        with w.lock:
            if w.results.pushers.get(peer.name) is peer:
                del w.results.pushers[peer.name]
                w.results.orphan(peer.name)

    # ------------------------------------------------------------------ statistics
    def record(self, rows: int, failed: int, t0: int, t1: int, t2: int, t3: int,
               arrived: int) -> None:
        """One direct execution: arrived (read), t0 (execution began) .. t3 (answered)."""
        self._records.append(m.DirectRecord(rows, failed, t1 - t0, t2 - t1, t3 - t2,
                                            t0 - arrived, t3 - arrived))
        if time.monotonic() - self._sent_at >= DIRECT_STATS_S:
            self.send_stats()

    def send_stats(self, flush_id: int = 0) -> None:
        w = self.worker
        records, self._records = self._records, []
        self._sent_at = time.monotonic()
        metrics = w.backend.take_metrics() if w.backend is not None else None
        if records or metrics is not None or flush_id:
            w.sock.send(m.encode(m.DirectStats(w.worker_id, records, metrics, flush_id)))

    # ------------------------------------------------------------------ scheduler's word
    def set_epoch(self, msg: m.DirectEpoch) -> None:
        """From now on only requests of this epoch run. Everything read before ran already
        (one loop): the statistics go first, then the word that it is in force."""
        self.epoch = msg.epoch
        self.send_stats()
        self.worker.sock.send(m.encode(m.EpochSet(self.worker.worker_id, msg.epoch)))

    # ------------------------------------------------------------------ leaving
    def close(self) -> None:
        """A clean exit: requests already here are refused unrun, each frontend hears
        Goodbye last on its connection, and the statistics go to the scheduler."""
        try:
            for peer, parts in self.hub.pending():
                if peer is None or parts is None:
                    continue
                msg, _ = m.decode(parts, for_worker=True)
                reqs = msg.requests if type(msg) is m.InferRequests else [msg]
                for req in reqs:
                    if type(req) is m.InferRequest:
                        self._refuse(peer, req.req_id)
            for peer in list(self.hub.peers):
                try:
                    peer.send(m.encode(m.Goodbye("the instance is stopping")))
                except OSError:
                    pass
        except Exception:   # leaving must not fail: frontends then see the instance exit
            log.exception("direct connections could not be closed cleanly")
        try:
            self.send_stats()
        except OSError:
            pass
        self.hub.close()


def hub_for(worker: Worker) -> Hub | None:
    """The worker's hub when it can serve the direct path (a Unix scheduler address)."""
    address = listen_address(worker.scheduler_addr, worker.worker_id)
    if not address or not transport.is_stream(worker.scheduler_addr):
        return None
    try:
        return Hub(worker.sock, address)
    except OSError as e:
        log.warning("no direct path for this instance (%s): requests come through the "
                    "scheduler", e)
        return None
