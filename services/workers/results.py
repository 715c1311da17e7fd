"""A worker's results on their way to the frontends: an object the Worker (main.py) owns
and hands each batch's results to.

One connection per frontend result address, kept. A connection found broken (its frontend
died; `trireme serve` respawns one on the same address) is replaced and the message sent
once more; an address that cannot be reached is remembered a while, so that the next try
is a quick one. Output blocks sent are tracked until the frontend releases them; those of
a frontend that died unread are freed after a grace period.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from services.common import messages as m
from services.common import transport
from services.common.errors import Code
from services.common.shm import Arena

log = logging.getLogger("trireme.worker")

# How long a worker tries to reach a frontend's result socket: on one host it is there or
# gone at once; across hosts this bounds how long a dead frontend stalls the worker.
_RESULT_CONNECT_S = 2.0
# A reconnect after a broken result connection, or a connect to a frontend that was just
# unreachable: one try (a listening Unix socket accepts at once).
_RESULT_RECONNECT_S = 0.1
_UNREACHABLE_KEPT = 256   # result addresses remembered as unreachable (BLS clients come and go)
# Output blocks sent to a frontend that then died unread are freed this long after its
# connection is found broken: a release it sent before dying may still be on its way
# (through the scheduler), and a block must not be reused before that release is seen.
_ORPHAN_GRACE_S = 10.0


class ResultSender:
    """The worker's result sockets, retries and lent-block tracking. ``sock`` is the
    connection to the scheduler (results relayed through it); ``lock`` is the worker's,
    held by every caller of flush() and push(): a Python model may answer from its own
    threads."""

    def __init__(self, sock: Any, scheduler_addr: str, arena: Arena | None,
                 lock: threading.Lock) -> None:
        self.sock = sock
        self.scheduler_addr = scheduler_addr
        self.arena = arena
        self.lock = lock
        self.pushers: dict[str, Any] = {}   # result address -> connection
        self.unreachable: dict[str, float] = {}   # result address -> when it last failed
        # Output blocks sent and not yet released: block -> the result address it went to;
        # those of a frontend found dead wait out _ORPHAN_GRACE_S in `orphans`.
        self.lent: dict[tuple[str, int], str] = {}
        self.orphans: dict[tuple[str, int], float] = {}
        self.step_addr = ""   # the scheduler's step socket (LoadModel.step_addr)
        self.model = ""       # its name, for the error of a result that cannot be sent

    def close(self) -> None:
        for conn in self.pushers.values():
            conn.close()

    def flush(self, replies: dict) -> tuple[list[m.InferResult], list[Any]]:
        """Send ``replies`` (reply_to -> (results, frames)) on their way; those for the
        scheduler's step socket are returned instead, for BatchDone to carry."""
        steps: tuple[list[m.InferResult], list[Any]] = ([], [])
        for address, (results, frames) in replies.items():
            if address == self.step_addr:
                steps = (results, frames)
            else:
                self.push(address, results[0] if len(results) == 1 else m.InferResults(results),
                           frames)
        return steps

    def push(self, address: str, msg: Any, frames: list[Any] = ()) -> None:
        """Send results to a frontend's result socket (under self.lock). A connection found
        broken (its frontend died; `trireme serve` respawns one on the same address) is
        replaced by a fresh one and the message sent once more, so a respawned frontend
        gets every result meant for it. A message that still cannot go has nobody waiting
        for it: its output blocks are freed here."""
        try:
            parts = m.encode(msg, frames)
        except m.ENCODE_ERRORS:
            msg, parts = self.encodable(msg, frames)
        retried = False
        while True:
            conn = self.pushers.get(address)
            fresh = conn is None
            try:
                if conn is None:
                    # First contact waits for the socket a while; a reconnect, or a frontend
                    # that was unreachable just now, gets one quick try: a result for a
                    # frontend that is listening again connects at once, and one for a
                    # frontend that is gone must not stall this worker's other batches.
                    quick = retried or address in self.unreachable
                    # (the scheduler's step socket is bound to every interface: reached
                    # by our own route to the scheduler)
                    conn = transport.connect_blocking(
                        transport.reachable(address, self.scheduler_addr),
                        timeout=_RESULT_RECONNECT_S if quick else _RESULT_CONNECT_S)
                    self.pushers[address] = conn
                conn.send(parts)
                self.unreachable.pop(address, None)
                if self.arena is not None:
                    self._lend(address, msg)
                return
            except OSError as e:
                gone = self.pushers.pop(address, None)
                if gone is not None:
                    gone.close()
                    self.orphan(address)
                if fresh or retried:   # a fresh connection failed: that frontend is gone
                    log.warning("cannot send results to %s: %s", address, e)
                    break
                log.info("result connection to %s broke (%s); reconnecting", address, e)
                retried = True
        if len(self.unreachable) >= _UNREACHABLE_KEPT:
            self.unreachable.clear()
        self.unreachable[address] = time.monotonic()
        self._relay(address, msg, parts)

    def _relay(self, address: str, msg: Any, parts: list[Any]) -> None:
        """The frontend's result socket cannot be reached from here (another host or
        network, or it is gone): the results take the long way, through the scheduler,
        which passes them to the frontend that announced ``address`` or drops them when
        there is none. Results in shared memory are not sent that way: a frontend that can
        map our segments shares our host, and one there that cannot be reached is gone."""
        if any(ref.segment for r in _results(msg) for ref in r.outputs):
            self._free_unsent(msg)
            return
        try:
            self.sock.send(m.encode(m.Relay(address), parts))
        except OSError as e:
            log.warning("cannot relay results for %s through the scheduler: %s", address, e)

    def encodable(self, msg: Any, frames: list[Any]) -> tuple[Any, list[Any]]:
        """``msg`` failed to encode (a model's value msgpack cannot hold): every result
        that encodes alone goes as it is, each other one becomes an error for its request.
        Returns the message to send and its parts."""
        kept = []
        for r in _results(msg):
            why = m.unencodable(r)
            if why is not None:
                log.error("result of request %d cannot be sent: %s", r.req_id, why)
                self._free_unsent(r)
                r = m.InferResult(r.req_id, error=m.ErrorRecord(
                    int(Code.INTERNAL), f"model '{self.model}' returned a response that "
                                        f"cannot be sent: {type(why).__name__}: {why}"),
                    stream=r.stream, order=r.order, final=r.final)
            kept.append(r)
        msg = kept[0] if len(kept) == 1 else m.InferResults(kept)
        return msg, m.encode(msg, frames)

    def _lend(self, address: str, msg: Any) -> None:
        lent = self.lent
        for r in _results(msg):
            for ref in r.outputs:
                if ref.segment:
                    lent[(ref.segment, ref.offset)] = address
        if self.orphans:
            self._free_orphans(time.monotonic())

    def orphan(self, address: str) -> None:
        """The connection to ``address`` broke: the frontend that got the blocks lent to it
        died and will release none of them (any release it sent first still counts)."""
        if not self.lent:
            return
        deadline = time.monotonic() + _ORPHAN_GRACE_S
        for block in [b for b, a in self.lent.items() if a == address]:
            del self.lent[block]
            self.orphans[block] = deadline

    def _free_orphans(self, now: float) -> None:
        for block in [b for b, t in self.orphans.items() if t <= now]:
            del self.orphans[block]
            self._free(block)

    def _free_unsent(self, msg: Any) -> None:
        """Free the output blocks of results that will never reach their consumer (the
        caller holds self.lock)."""
        if self.arena is None:
            return
        for r in _results(msg):
            for ref in r.outputs:
                if ref.segment:
                    self._free((ref.segment, ref.offset))

    def _free(self, block: tuple[str, int]) -> None:
        assert self.arena is not None   # blocks are lent, orphaned or unsent only from an arena
        try:
            self.arena.free(*block)
        except KeyError:
            log.warning("free of unknown block %s@%d", *block)

    def release(self, blocks: list[tuple[str, int]]) -> None:
        if self.arena is None:
            return
        with self.lock:
            lent, orphans = self.lent, self.orphans
            for segment, offset in blocks:
                block = (segment, offset)
                if lent.pop(block, None) is None and orphans:
                    orphans.pop(block, None)   # released within the grace period
                self._free(block)
            if orphans:
                self._free_orphans(time.monotonic())


def _results(msg: Any) -> list[m.InferResult]:
    """The results one message carries (InferResult or InferResults)."""
    return [msg] if isinstance(msg, m.InferResult) else msg.results
