"""How a data plane's requests and cancels leave for the scheduler: an object DataPlane
(client.py) owns and hands each request and cancel to.

Every request gets exactly one answer. The requests of one event-loop turn leave as one
message; should that message fail to encode, each request is encoded alone and only those
that cannot be are answered, each with an error naming its field (a client's value that
msgpack cannot hold is a 400). The cancels of one turn leave together at its end, after
that turn's requests.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from services.common import messages as m
from services.common.errors import Code, TriremeError, invalid_arg
from services.dataplane.validation import parameter_range_text

log = logging.getLogger("trireme.dataplane")


class Outbox:
    """The sending side of a data plane: turn batching, the encode fallback, cancels.
    ``send`` writes encoded parts to the scheduler; ``answer`` gives a request that cannot
    be sent its one answer (the data plane's delivery of a result); ``result_addr`` is where
    results come back, as the cancels say."""

    def __init__(self, send: Callable[[Sequence[Any]], None],
                 answer: Callable[[m.InferResult, list[Any]], None], result_addr: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self._answer = answer
        self._result_addr = result_addr
        self._loop = loop
        self._requests: list[tuple[m.InferRequest, list[Any]]] = []
        self._cancels: dict[tuple[str, int], list[int]] = {}   # (model, version) -> req_ids

    def submit(self, msg: m.InferRequest, frames: list[Any]) -> None:
        """Requests made in one event-loop turn leave as one message at its end: under
        load that is one send (and one scheduler receive) for many requests."""
        if not self._requests:
            self._loop.call_soon(self._flush_requests)
        self._requests.append((msg, frames))

    def drop(self) -> None:
        """The scheduler is gone: what has not left yet never will (its callers are
        answered by the data plane)."""
        self._requests = []
        self._cancels = {}

    def _flush_requests(self) -> None:
        box, self._requests = self._requests, []
        if len(box) == 1:
            self._send_alone(*box[0])
            return
        if not box:   # flushed early by _flush_cancels
            return
        frames: list[Any] = []
        for msg, own in box:
            if own:
                base = len(frames)
                if base:
                    for t in msg.inputs:
                        if t.frame >= 0:
                            t.frame += base
                frames.extend(own)
        try:
            parts = m.encode(m.InferRequests([msg for msg, _ in box]), frames)
        except m.ENCODE_ERRORS:
            # One of them carries what msgpack cannot hold: each goes alone, and only
            # those that cannot be encoded fail. Their frame indexes count from 0 again.
            base = 0
            for msg, own in box:
                if own:
                    if base:
                        for t in msg.inputs:
                            if t.frame >= 0:
                                t.frame -= base
                    base += len(own)
                self._send_alone(msg, own)
            return
        self._send(parts)

    def _send_alone(self, msg: m.InferRequest, frames: list[Any]) -> None:
        try:
            parts = m.encode(msg, frames)
        except m.ENCODE_ERRORS as e:
            err = _unsendable(msg, e)
            log.info("request %d not sent: %s", msg.req_id, err.message)
            self._answer(m.InferResult(msg.req_id, error=m.ErrorRecord(int(err.code), err.message)),
                         [])
            return
        self._send(parts)

    def cancel(self, req_id: int, model: str, version: int) -> None:
        """The caller of a request went away before its final response: the scheduler takes
        it out of its queue (answering CANCELLED) or tells its worker. Cancels of one turn
        leave together at its end, after the requests of that turn."""
        if not self._cancels:
            try:
                self._loop.call_soon(self._flush_cancels)
            except RuntimeError:   # a stream finalized after its loop stopped: nothing to tell
                return
        self._cancels.setdefault((model, version), []).append(req_id)

    def _flush_cancels(self) -> None:
        if self._requests:   # a request made and cancelled in this turn leaves before its cancel
            self._flush_requests()
        cancels, self._cancels = self._cancels, {}
        for (model, version), req_ids in cancels.items():
            self._send(m.encode(m.Cancel(self._result_addr, model, version, req_ids)))


def _unsendable(msg: m.InferRequest, exc: Exception) -> TriremeError:
    """The error for a request whose message cannot be encoded: INVALID_ARG naming the
    field when it holds the client's value (validation lets nothing through that it knows
    to be unencodable: this is the net under it), INTERNAL otherwise."""
    why = f"{type(exc).__name__}: {exc}"
    for key, value in msg.parameters.items():
        if m.unencodable(key) or m.unencodable(value):
            if isinstance(exc, OverflowError):
                return invalid_arg(parameter_range_text(key))
            return invalid_arg(f"parameter '{key}' cannot be sent to the model ({why})")
    for t in msg.inputs:
        if m.unencodable(t.shape) or m.unencodable(t.name):
            return invalid_arg(f"input '{t.name}' cannot be sent to the model: its name or "
                               f"shape holds a value out of range ({why})")
    for name in msg.outputs:
        if m.unencodable(name):
            return invalid_arg(f"requested output '{name}' cannot be sent to the model ({why})")
    if m.unencodable(msg.request_id):
        return invalid_arg(f"the request id cannot be sent to the model ({why})")
    return TriremeError(Code.INTERNAL, f"the request could not be sent to the scheduler ({why})")
