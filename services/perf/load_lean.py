"""A lean load-generating process (HTTP/1.1 or gRPC): every request encoded once, sent as
bytes over our own connections on uvloop, each response read for its status and its end
only (lean_http, lean_h2). The default wherever it applies (`why_not_lean` says where it
does not: those runs keep tritonclient, load_http / load_grpc).

    profiler ──pipe──▶ control reader (load_async)
                          │ apply(): start the slots / the rate schedule
                          ▼
    slot i ──one connection──▶ send ─▶ … ─▶ done(): record, then the slot's next request,
                                            straight from the response's callback
    rate_schedule ──fire──▶ a connection with room (HTTP/1.1: an idle one; HTTP/2: one with
                            a free stream), a new one when none has
"""
from __future__ import annotations

import asyncio
import random
import ssl
from typing import Any

from services.perf import load_async
from services.perf.flags import PerfSettings, SslSettings
from services.perf.lean_h2 import H2Connection, grpc_message, request_block
from services.perf.lean_http import HttpConnection, http_request, target
from services.perf.load_async import DRAIN_S, rate_schedule
from services.perf.model import ModelInfo
from services.perf.worker_core import Planned, WorkerSpec, WorkerState

CONNECT_TIMEOUT_S = 60.0


def why_not_lean(s: PerfSettings, model: ModelInfo) -> str | None:
    """None where the lean path serves these settings; else the flag or model it leaves to
    tritonclient."""
    if s.shared_memory != "none":
        return f"--shared-memory {s.shared_memory}"
    if s.streaming:
        return "--streaming"
    if model.is_sequence:
        return "a sequence model (per-request sequence ids and flags)"
    if model.decoupled:
        return "a decoupled model"
    return None


def _https_context(t: SslSettings) -> ssl.SSLContext:
    """The --ssl-https-* flags, as clients.http_client applies them to tritonclient."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if t.https_ca_certificates_file:
        ctx.load_verify_locations(cafile=t.https_ca_certificates_file)
    else:
        ctx.load_default_certs()
    if not t.https_verify_host or not t.https_verify_peer:
        ctx.check_hostname = False
    if not t.https_verify_peer:
        ctx.verify_mode = ssl.CERT_NONE
    if t.https_client_certificate_file:
        ctx.load_cert_chain(t.https_client_certificate_file, t.https_private_key_file)
    return ctx


def _grpc_context(t: SslSettings) -> ssl.SSLContext:
    """The --ssl-grpc-* flags, as grpc.ssl_channel_credentials takes them; ALPN h2."""
    ctx = ssl.create_default_context(cafile=t.grpc_root_certifications_file or None)
    if t.grpc_certificate_chain_file:
        ctx.load_cert_chain(t.grpc_certificate_chain_file, t.grpc_private_key_file)
    ctx.set_alpn_protocols(["h2"])
    return ctx


class LeanLoad:
    """The slots and the rate schedule over lean connections. A request's token is its
    slot (>= 0), or -1 - its flags in request-rate mode."""

    def __init__(self, spec: WorkerSpec, state: WorkerState) -> None:
        self.spec, self.state = spec, state
        self.loop = asyncio.get_running_loop()
        self.rng = random.Random(spec.seed * 104729 + spec.index)
        self.host, self.port, _ = target(spec.url, spec.ssl.https)
        if spec.protocol == "http":
            requests = [http_request(spec, s) for s in spec.requests]
            self.ssl = _https_context(spec.ssl) if spec.ssl.https else None
            self.factory: Any = lambda: HttpConnection(requests, self._done, self._failed)
        else:
            messages = [grpc_message(spec, s) for s in spec.requests]
            block = request_block(spec, self.host, self.port)
            self.ssl = _grpc_context(spec.ssl) if spec.ssl.grpc_use_ssl else None
            self.factory = lambda: H2Connection(messages, block, self._done, self._failed,
                                                self.loop)
        self.conns: set[Any] = set()
        self.slot_conns: dict[int, Any] = {}
        self.cursors: dict[int, Any] = {}
        self.running: set[int] = set()
        self.free: list[Any] = []               # request-rate mode: connections with room
        self.in_flight = 0                      # requests started and not ended
        self.tasks: set[asyncio.Task] = set()   # connections being opened
        self.scheduler: asyncio.Task | None = None
        self.idle: asyncio.Future | None = None

    # ---- connections
    async def _open(self) -> Any:
        kw: dict[str, Any] = {"ssl": self.ssl, "server_hostname": self.host} if self.ssl else {}
        _, conn = await asyncio.wait_for(self.loop.create_connection(
            self.factory, self.host, self.port, **kw), CONNECT_TIMEOUT_S)
        if isinstance(conn, H2Connection):
            await asyncio.wait_for(conn.ready, CONNECT_TIMEOUT_S)
        self.conns = {c for c in self.conns if c.open}   # (those the server closed: gone)
        self.conns.add(conn)
        return conn

    async def _open_then_send(self, token: int, data: int) -> None:
        try:
            conn = await self._open()
        except Exception as e:   # noqa: BLE001  (refused, TLS, timeout: the run ends with it)
            self._failed(None, token, f"failed to connect to {self.host}:{self.port}: "
                                      f"{str(e) or type(e).__name__}")
            return
        if token >= 0:
            self.slot_conns[token] = conn
        if self.state.stopping and token >= 0:   # (stopped while connecting: nothing sent)
            self.in_flight -= 1
            self._ended(token)
            return
        self._send(conn, data, token)
        if token < 0 and conn.in_flight < conn.capacity:
            self.free.append(conn)

    def _spawn(self, token: int, data: int) -> None:
        task = self.loop.create_task(self._open_then_send(token, data))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _send(self, conn: Any, data: int, token: int) -> None:
        try:
            conn.send(data, token)
        except Exception as e:   # noqa: BLE001  (the transport is closing under us)
            self._failed(conn, token, f"{type(e).__name__}: {e}")

    # ---- concurrency mode: each slot sends its next request from the last one's callback
    def _next(self, slot: int) -> None:
        state = self.state
        if slot >= state.concurrency or not state.may_start():
            self.running.discard(slot)
            self._check_idle()
            return
        cursor = self.cursors.get(slot)
        if cursor is None:
            cursor = self.cursors[slot] = state.source.slot(slot)
        data = cursor.next().data
        self.in_flight += 1
        conn = self.slot_conns.get(slot)
        if conn is not None and conn.open:
            self._send(conn, data, slot)
        else:
            self._spawn(slot, data)

    # ---- request-rate mode
    def _fire(self, plan: Planned, flags: int) -> None:
        token = -1 - flags
        self.in_flight += 1
        free = self.free
        while free:
            conn = free[-1]
            if conn.open and conn.in_flight < conn.capacity:
                self._send(conn, plan.data, token)
                if conn.in_flight >= conn.capacity:
                    free.pop()
                return
            free.pop()
        self._spawn(token, plan.data)

    async def _schedule(self) -> None:
        await rate_schedule(self.state, self.spec, self.rng, self._fire,
                            lambda: self.in_flight)

    # ---- the connections' callbacks
    def _done(self, conn: Any, token: int, start: int, end: int, send: int, recv: int) -> None:
        self.in_flight -= 1
        if token >= 0:
            self.state.record(start, end, send, recv, 1, 0)
            self._next(token)
            return
        self.state.record(start, end, send, recv, 1, -1 - token)
        if conn.open and conn.in_flight == conn.capacity - 1:
            self.free.append(conn)
        self._check_idle()

    def _failed(self, conn: Any, token: int, text: str) -> None:
        self.in_flight -= 1
        self.state.fail(text)
        self._ended(token)

    def _ended(self, token: int) -> None:
        if token >= 0:
            self.running.discard(token)
        self._check_idle()

    def _check_idle(self) -> None:
        if self.idle is not None and not self.idle.done() and self.in_flight <= 0 \
                and not self.running:
            self.idle.set_result(None)

    # ---- the control loop's side
    def apply(self) -> None:
        for i in range(self.state.concurrency):
            if i not in self.running:
                self.running.add(i)
                self._next(i)
        if self.state.rate > 0 and (self.scheduler is None or self.scheduler.done()):
            self.scheduler = self.loop.create_task(self._schedule())

    async def drain(self) -> None:
        """Wait for the requests in flight (at most DRAIN_S), then close every connection."""
        if self.scheduler is not None:
            self.scheduler.cancel()
        self.idle = self.loop.create_future()
        self._check_idle()
        try:
            await asyncio.wait_for(self.idle, DRAIN_S)
        except TimeoutError:
            pass
        for task in list(self.tasks):
            task.cancel()
        for conn in self.conns:
            conn.close()


async def _make(spec: WorkerSpec, state: WorkerState) -> tuple[LeanLoad, None]:
    return LeanLoad(spec, state), None


def serve(conn: Any, spec: WorkerSpec) -> None:
    load_async.serve(conn, spec, _make)

