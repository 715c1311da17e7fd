"""How DataPlane's requests and cancels leave for the scheduler: a mixin of DataPlane
(client.py), whose state it uses.

Every request gets exactly one answer. The requests of one event-loop turn leave as one
message; should that message fail to encode, each request is encoded alone and only those
that cannot be are answered, each with an error naming its field (a client's value that
msgpack cannot hold is a 400). The cancels of one turn leave together at its end, after
that turn's requests.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common import messages as m
from services.common import transport
from services.common.errors import Code, TriremeError, invalid_arg
from services.dataplane.validation import parameter_range_text

log = logging.getLogger("trireme.dataplane")


class Outbox:
    """DataPlane's sending side: turn batching, the encode fallback, cancels."""

    result_addr: str
    _loop: asyncio.AbstractEventLoop
    _sched: transport.Connection
    _outbox: list[tuple[m.InferRequest, list[Any]]]
    _cancels: dict[tuple[str, int], list[int]]

    if TYPE_CHECKING:
        def _send(self, msg: Any, frames: Sequence[Any] = ()) -> None: ...
        def _deliver(self, msg: m.InferResult, frames: list[Any]) -> None: ...

    def _submit(self, msg: m.InferRequest, frames: list[Any]) -> None:
        """Requests made in one event-loop turn leave as one message at its end: under
        load that is one ZeroMQ send (and one scheduler receive) for many requests."""
        if not self._outbox:
            self._loop.call_soon(self._flush_outbox)
        self._outbox.append((msg, frames))

    def _flush_outbox(self) -> None:
        box, self._outbox = self._outbox, []
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
        self._sched.send(parts)

    def _send_alone(self, msg: m.InferRequest, frames: list[Any]) -> None:
        try:
            parts = m.encode(msg, frames)
        except m.ENCODE_ERRORS as e:
            err = _unsendable(msg, e)
            log.info("request %d not sent: %s", msg.req_id, err.message)
            self._deliver(m.InferResult(msg.req_id, error=m.ErrorRecord(int(err.code), err.message)),
                          [])
            return
        self._sched.send(parts)

    def _cancel(self, req_id: int, model: str, version: int) -> None:
        """The caller of a request went away before its final response: the scheduler takes
        it out of its queue (answering CANCELLED) or tells its worker. Cancels of one turn
        leave together at its end, after the requests of that turn."""
        if not self._cancels:
            try:
                asyncio.get_running_loop().call_soon(self._flush_cancels)
            except RuntimeError:   # a stream finalized after its loop stopped: nothing to tell
                return
        self._cancels.setdefault((model, version), []).append(req_id)

    def _flush_cancels(self) -> None:
        if self._outbox:   # a request made and cancelled in this turn leaves before its cancel
            self._flush_outbox()
        cancels, self._cancels = self._cancels, {}
        for (model, version), req_ids in cancels.items():
            self._send(m.Cancel(self.result_addr, model, version, req_ids))


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
