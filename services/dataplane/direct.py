"""The direct path, a data plane's side (owned by DataPlane, client.py): requests to a
version whose ModelInfo lists routes go to an instance's worker over a connection of their
own, and come back on it (messages_direct.py).

    pick: the route with the fewest requests waiting ─▶ send (one message per route and
    event-loop turn: an Outbox per route) ─▶ the worker answers on the same connection

Every request sent on a route is kept (its message and frames) until its final answer:
    stale (the worker refused it unrun: a revoked or newer epoch) ─▶ resent through the
        scheduler, whose queue decides;
    Goodbye (the worker stops cleanly; every answer it gave came before) ─▶ all still
        waiting are resent the same way;
    the connection breaks without a Goodbye (the worker died) ─▶ each fails once, with the
        error the scheduler announces for it (RepositoryChanged.exits: the instance-exit
        text with its exit code, or why it was killed), or after EXIT_WAIT_S without one,
        the instance-exit text alone; one that cannot connect at all ─▶ resent (none ran).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from services.common import messages as m
from services.common.errors import Code, instance_exited_text
from services.common.transport_stream import Connection
from services.dataplane.outbox import Outbox

log = logging.getLogger("trireme.dataplane")

CONNECT_S = 1.0   # a worker's listener accepts at once: a route that does not is not used
_DEAD_KEPT = 1024   # routes remembered as unusable (until the next repository change)
EXIT_WAIT_S = 2.0   # how long a dead worker's requests wait for the scheduler's word on it
_EXITS_KEPT = 256


class Route:
    """One instance's route, as this data plane uses it."""
    __slots__ = ("cancelled", "conn", "connected", "goodbye", "key", "model", "outbox", "route",
                 "shm", "timer", "waiting")

    def __init__(self, route: m.Route, model: str, shm: bool) -> None:
        self.route = route
        self.key = (route.address, route.epoch)
        self.model = model
        self.shm = shm                   # this data plane can map the worker's segments
        self.waiting: dict[int, tuple[m.InferRequest, list[Any]]] = {}
        self.cancelled: set[int] = set()   # of those, the ones whose caller went away
        self.connected = False
        self.goodbye = False
        self.conn: Connection | None = None
        self.outbox: Outbox | None = None
        self.timer: asyncio.TimerHandle | None = None


class DirectPath:
    def __init__(self, loop: asyncio.AbstractEventLoop, result_addr: str, domain: str,
                 on_results: Callable[[Any, list[Any]], None],
                 deliver: Callable[[m.InferResult, list[Any]], None],
                 resend: Callable[[m.InferRequest, list[Any]], None]) -> None:
        self._loop = loop
        self._result_addr = result_addr
        self._domain = domain
        self._on_results = on_results    # a worker's results, as the result socket's are
        self._deliver = deliver          # a request's final answer made here (its failure)
        self._resend = resend            # through the scheduler
        self._routes: dict[tuple[str, int], Route] = {}
        self._dead: set[tuple[str, int]] = set()
        self._exits: dict[str, m.ErrorRecord] = {}   # address -> its worker's end, told early
        self._orphans: dict[str, Route] = {}         # address -> broken, awaiting that word
        self.by_req: dict[int, Route] = {}   # every request waiting on a route
        self._handlers = self._handler_table()

    def pick(self, info: m.ModelInfo, version: int) -> Route | None:
        """The route of ``version`` with the fewest requests waiting; None: use the
        scheduler (no route, or none usable)."""
        best = None
        for r in info.routes:
            if r.version != version:
                continue
            route = self._routes.get((r.address, r.epoch))
            if route is None:
                if (r.address, r.epoch) in self._dead:
                    continue
                route = self._open(r, info.name)
            if route.goodbye:
                continue
            if best is None or len(route.waiting) < len(best.waiting):
                best = route
        return best

    def send(self, route: Route, msg: m.InferRequest, frames: list[Any]) -> None:
        msg.epoch, msg.shm = route.route.epoch, route.shm
        route.waiting[msg.req_id] = (msg, frames)
        self.by_req[msg.req_id] = route
        assert route.outbox is not None   # (made by _open)
        route.outbox.submit(msg, frames)

    def cancel(self, req_id: int, model: str, version: int) -> None:
        """The caller of ``req_id`` went away: its worker answers it CANCELLED instead of
        running it, if it has not begun."""
        route = self.by_req.get(req_id)
        if route is not None and route.outbox is not None:
            route.cancelled.add(req_id)
            route.outbox.cancel(req_id, model, version)

    def answered(self, req_id: int) -> None:
        """``req_id`` has its final answer."""
        route = self.by_req.pop(req_id, None)
        if route is not None:
            route.waiting.pop(req_id, None)
            if route.cancelled:
                route.cancelled.discard(req_id)

    def stale(self, req_id: int) -> None:
        """The worker refused ``req_id`` unrun: the scheduler's queue takes it."""
        route = self.by_req.pop(req_id, None)
        if route is not None:
            waiting = route.waiting.pop(req_id, None)
            if waiting is not None:
                self._resend(*_rebased(*waiting))

    def waiting(self) -> dict[str, int]:
        """Route address -> requests sent there and not answered yet, but those cancelled
        (their worker answers them without running them): GetPending."""
        out: dict[str, int] = {}
        for route in self._routes.values():
            if route.waiting:
                address = route.route.address
                out[address] = out.get(address, 0) + len(route.waiting) - len(route.cancelled)
        return out

    def exits(self, exits: dict[str, m.ErrorRecord]) -> None:
        """The scheduler's word on workers that were killed or exited: the error of the
        requests sent them directly (now, or when their connection closes)."""
        for address, error in exits.items():
            route = self._orphans.pop(address, None)
            if route is not None:
                self._fail(route, error)
            else:   # (its connection has not closed yet; the first word stands)
                if len(self._exits) >= _EXITS_KEPT:
                    self._exits.clear()
                self._exits.setdefault(address, error)

    def forget(self) -> None:
        """The scheduler connection broke: every caller was answered (UNAVAILABLE), so
        nothing waits on a route any more; what comes for them is dropped."""
        self.by_req.clear()
        for route in (*self._routes.values(), *self._orphans.values()):
            route.waiting.clear()
            if route.timer is not None:
                route.timer.cancel()
                route.timer = None
        self._orphans.clear()

    def clear_dead(self) -> None:
        self._dead.clear()

    def close(self) -> None:
        for route in list(self._routes.values()):
            self._drop(route)

    # ------------------------------------------------------------------ connections
    def _open(self, r: m.Route, model: str) -> Route:
        route = Route(r, model, bool(self._domain) and r.shm_domain == self._domain)
        self._routes[route.key] = route
        self._exits.pop(r.address, None)   # (an earlier worker's at this address)
        conn = route.conn = Connection(
            r.address, lambda parts: self._on_message(route, parts),
            self._result_addr.encode(), lambda up: self._on_state(route, up))
        route.outbox = Outbox(conn.send, self._deliver, self._result_addr, self._loop)
        conn.start()
        route.timer = self._loop.call_later(CONNECT_S, self._not_connected, route)
        return route

    def _on_message(self, route: Route, parts: list[Any]) -> None:
        msg, frames = m.decode(parts)
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("dropped a %s on the direct connection to %s: not a message a worker "
                        "sends there", type(msg).__name__, route.route.address)
            return
        handler(route, msg, frames)

    def _handler_table(self) -> dict[type, Callable[[Route, Any, list[Any]], None]]:
        """What a worker sends on a route's connection, and who handles it: the one table."""
        def results(route: Route, msg: Any, frames: list[Any]) -> None:
            self._on_results(msg, frames)

        return {
            m.InferResult: results,
            m.InferResults: results,
            m.Goodbye: lambda route, msg, frames: self._bye(route),
        }

    def _on_state(self, route: Route, up: bool) -> None:
        if up:
            route.connected = True
            if route.timer is not None:
                route.timer.cancel()
                route.timer = None
            return
        # Broken. After a Goodbye nothing waits; without one the worker died: what it held
        # fails once, with the error the scheduler gives what it dispatched there.
        self._drop(route)
        if not route.waiting:
            return
        address = route.route.address
        error = self._exits.pop(address, None)
        if error is not None:
            self._fail(route, error)
            return
        stale = self._orphans.pop(address, None)
        if stale is not None:   # (an earlier worker's at this address: no word came)
            self._fail(stale, _exited(stale))
        self._orphans[address] = route
        route.timer = self._loop.call_later(EXIT_WAIT_S, self._no_word, route)

    def _no_word(self, route: Route) -> None:
        route.timer = None
        if self._orphans.get(route.route.address) is route:
            del self._orphans[route.route.address]
            self._fail(route, _exited(route))

    def _fail(self, route: Route, error: m.ErrorRecord) -> None:
        if route.timer is not None:
            route.timer.cancel()
            route.timer = None
        waiting, route.waiting = route.waiting, {}
        for req_id in waiting:
            self.by_req.pop(req_id, None)
            self._deliver(m.InferResult(req_id, error=error), [])

    def _not_connected(self, route: Route) -> None:
        route.timer = None
        if not route.connected:
            log.warning("direct route to %s did not connect: requests go through the "
                        "scheduler", route.route.address)
            self._bye(route)
            self._drop(route)

    def _bye(self, route: Route) -> None:
        """The worker answered everything it will: the rest goes through the scheduler."""
        route.goodbye = True
        if route.outbox is not None:
            route.outbox.drop()
        waiting, route.waiting = route.waiting, {}
        for req_id, entry in waiting.items():
            self.by_req.pop(req_id, None)
            self._resend(*_rebased(*entry))

    def _drop(self, route: Route) -> None:
        if self._routes.get(route.key) is route:
            del self._routes[route.key]
            if len(self._dead) >= _DEAD_KEPT:
                self._dead.clear()
            self._dead.add(route.key)
        if route.timer is not None:
            route.timer.cancel()
            route.timer = None
        if route.conn is not None:
            route.conn.close()


def _exited(route: Route) -> m.ErrorRecord:
    return m.ErrorRecord(int(Code.INTERNAL),
                         instance_exited_text(route.route.instance, route.model))


def _rebased(msg: m.InferRequest, frames: list[Any]) -> tuple[m.InferRequest, list[Any]]:
    """``msg`` for the scheduler: no epoch, its frame indexes from 0 again (a route's Outbox
    shifted them when it sent several requests in one message)."""
    msg.epoch, msg.shm = 0, False
    if frames:
        base = min(t.frame for t in msg.inputs if t.frame >= 0)
        if base:
            for t in msg.inputs:
                if t.frame >= 0:
                    t.frame -= base
    return msg, frames
