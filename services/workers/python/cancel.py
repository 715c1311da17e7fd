"""Which running requests of this worker were cancelled (their callers went away).

    scheduler ──Cancel──▶ [cancel connection] ─▶ reader thread ─▶ Flag.cancelled = True
                                                                    ▲ read by is_cancelled()

The worker's loop is synchronous: while a Python model's execute() runs, nobody reads the
main socket. So cancels come on a connection of their own (messages.CANCEL_CHANNEL), read
by a thread that only flips flags, and a model that polls request.is_cancelled() inside
execute(), or response_sender.is_cancelled() from its own threads (decoupled), sees the
cancel at its next poll. The hot path pays nothing: no message, no thread hand-off, unless
a cancel happens. Only workers whose backend can act on a cancel open the connection;
other backends run every request to completion, as Triton's ONNX Runtime and PyTorch do.

A cancel can overtake the ExecuteBatch of its request (two connections, and the main
thread may still be decoding it), and the scheduler sends the cancel of a running request
to every instance of its version (a decoupled request still streams after its batch is
done, and only its worker knows): ids not running here are remembered, the most recent
EARLY_MAX of them, and applied if their request arrives later.
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from services.common import messages as m
from services.common import transport

log = logging.getLogger("trireme.worker")

EARLY_MAX = 4096

Key = tuple[str, int]          # (the frontend's reply_to, its req_id): unique per request


class Flag:
    """Shared by a request and its response sender; set once, from the reader thread."""
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


class Cancels:
    """The flags of the requests running here; listen() starts the reader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Key, Flag] = {}
        self._early: collections.OrderedDict[Key, bool] = collections.OrderedDict()

    def listen(self, scheduler_addr: str, worker_id: str) -> None:
        conn = transport.connect_blocking(scheduler_addr, worker_id.encode() + m.CANCEL_CHANNEL)
        # Never closed from the main thread (a blocked reader would hold the close up): the
        # thread ends when the scheduler closes its side, the socket with the process.
        threading.Thread(target=self._read, args=(conn,), name="trireme-cancel",
                         daemon=True).start()

    def track(self, key: Key) -> Flag:
        """The flag of a request that starts running here, until done(key)."""
        flag = Flag()
        with self._lock:
            self._running[key] = flag
            if self._early:
                flag.cancelled = self._early.pop(key, False)
        return flag

    def done(self, key: Key) -> None:
        """The request's final response is sent (idempotent)."""
        self._running.pop(key, None)

    def cancel(self, keys: list[Key]) -> None:
        with self._lock:
            for key in keys:
                flag = self._running.get(key)
                if flag is not None:
                    flag.cancelled = True
                    continue
                self._early[key] = True
                if len(self._early) > EARLY_MAX:
                    self._early.popitem(last=False)

    def _read(self, conn: Any) -> None:
        # What the scheduler sends on the cancel channel, and who handles it: its one table
        handlers: dict[type, Callable[[Any], None]] = {m.Cancel: self._on_cancel}
        while True:
            try:
                parts = conn.recv()
            except Exception:  # noqa: BLE001 - EOF or a closed socket: the scheduler is gone
                return
            try:
                msg, _ = m.decode(parts, for_worker=True)
            except m.DecodeError as e:
                log.warning("ignoring a message on the cancel channel: %s", e)
                continue
            handler = handlers.get(type(msg))
            if handler is None:   # the scheduler sends only Cancel here
                log.warning("unexpected %s on the cancel channel", type(msg).__name__)
                continue
            handler(msg)

    def _on_cancel(self, msg: m.Cancel) -> None:
        self.cancel([(msg.reply_to, i) for i in msg.req_ids])
