"""gRPC adapter: inference.GRPCInferenceService and grpc.health.v1.Health/Check, served by
grpc/native.py (our HTTP/2 on the event loop, the default) or by grpc.aio (--grpc-impl aio).

A thin layer: each RPC converts its message with `codec`, calls one method of the
transport-agnostic data plane `dp`, and converts the answer back. TriremeError codes become
gRPC status codes in exactly one table (`_STATUS`).

ModelInfer and ModelStreamInfer bypass protobuf for tensor bytes: requests are split by
`codec.decode_infer_request` (raw inputs stay views into the received buffer) and
responses are pre-serialized bytes (`encode_infer_response`), so their serializers here are
the identity.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from protos import grpc_service_pb2 as pb
from services.common.errors import REPOSITORY_NAME_UNSUPPORTED, Code, TriremeError, unsupported
from services.dataplane.api import DataPlaneAPI
from services.frontend import forward, stats_codec, tls, trace
from services.frontend.grpc import codec
from services.frontend.grpc.log_methods import LogRpcs
from services.frontend.grpc.shm_methods import SharedMemoryRpcs
from services.frontend.grpc.trace_methods import TraceRpcs, traced_model_infer, traced_stream_one
from services.frontend.restricted import GRPC_METHOD_GROUPS, Restriction, grpc_refusal_text
from services.frontend.settings import FrontendSettings

log = logging.getLogger(__name__)

__all__ = [
    "MAX_GRPC_MESSAGE_SIZE",
    "GrpcService",
    "RpcMethod",
    "grpc_status",
    "rpc_methods",
    "start_grpc",
]

SERVICE_NAME = "inference.GRPCInferenceService"
HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
MAX_GRPC_MESSAGE_SIZE = 2**31 - 1   # INT32_MAX, Triton's MAX_GRPC_MESSAGE_SIZE
STREAM_WINDOW = 128                 # requests in flight per ModelStreamInfer stream

# The one Code -> grpc.StatusCode table (../shared/reference/protocol.md, "Errors").
_STATUS: dict[Code, grpc.StatusCode] = {
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    Code.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Code.CANCELLED: grpc.StatusCode.CANCELLED,
    Code.UNKNOWN: grpc.StatusCode.UNKNOWN,
}

# grpc.health.v1.HealthCheckResponse{ServingStatus status = 1}, hand-encoded.
_HEALTH_SERVING = b"\x08\x01"
_HEALTH_NOT_SERVING = b"\x08\x02"
_HEALTH_UNKNOWN = b""


def grpc_status(code: Code) -> grpc.StatusCode:
    return _STATUS.get(code, grpc.StatusCode.UNKNOWN)


def _as_error(exc: Exception, what: str) -> TriremeError:
    if isinstance(exc, TriremeError):
        return exc
    log.exception("unexpected error in gRPC %s", what)
    return TriremeError(Code.INTERNAL, f"unexpected error in {what}: {exc}")


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _guard(name: str, fn: Handler) -> Handler:
    """Run a unary handler; a raised error ends the RPC with its mapped status."""
    @functools.wraps(fn)
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error leaves as a status
            err = _as_error(exc, name)
            status, message = grpc_status(err.code), err.message
            # err is often exc, whose traceback holds this frame and the request: kept in
            # it, that cycle would wait for the cyclic GC, which an idle frontend hardly runs
            del err
        await context.abort(status, message)
    return handler


def _identity(data: bytes) -> bytes:
    return data


def _tensor_bytes(request: tuple[pb.ModelInferRequest, list[memoryview]]) -> int:
    """The raw tensor bytes of a decoded request (grpc/codec.py decode_infer_request)."""
    return sum(len(v) for v in request[1])


class _StreamBudget:
    """The answers a ModelStreamInfer stream holds between its requests' producers and the
    client: produced, not yet taken by the server's writer (which stops taking them while
    the client does not read: grpc.aio's flow control, or the native server's bounds).
    A producer pauses at ``limit`` bytes; a new request starts only when its tensors, those
    of the requests running and the answers of all of them, at the largest size seen (none
    until a first answer gives it), fit beside what is held (one always may, while less
    than ``limit`` of answers is held). So a client
    that stops reading holds about ``limit`` here, whatever it sends and however many
    answers a decoupled model makes."""
    __slots__ = ("held", "inflight", "largest", "limit", "running_bytes", "_room")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = self.inflight = self.largest = self.running_bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def add(self, n: int) -> None:
        self.held += n
        if n > self.largest:
            self.largest = n
        if self.held >= self.limit:
            self._room.clear()

    def taken(self, n: int) -> None:
        self.held -= n
        self._room.set()

    def done(self, cost: int) -> None:
        self.inflight -= 1
        self.running_bytes -= cost
        if not self.largest:
            self.largest = 1             # answered without a message: small, and known now
        self._room.set()

    async def room(self, out: asyncio.Queue) -> None:
        """Until the answers held are below the limit, or ``out`` (the producer's own
        answers) is empty: the stream writes its requests' answers in order, so the oldest
        producer's, once taken, must never wait for later ones'."""
        while self.held >= self.limit and not out.empty():
            self._room.clear()
            await self._room.wait()

    async def start(self, cost: int) -> None:
        """Until one more request, of ``cost`` bytes of tensors, may start."""
        while self.held >= self.limit or (
                self.inflight and self.held + self.running_bytes + cost
                + (self.inflight + 1) * self.largest > self.limit):
            self._room.clear()
            await self._room.wait()
        self.inflight += 1
        self.running_bytes += cost


class GrpcService:
    """One coroutine per RPC of inference.GRPCInferenceService, over the data plane `dp`.
    The service owns the RPC groups kept in modules of their own, each over the same `dp`:
    the shared-memory RPCs (grpc/shm_methods.py), LogSettings (grpc/log_methods.py) and
    TraceSetting (grpc/trace_methods.py, which also wraps ModelInfer and the stream producer
    for tracing). ``handlers()`` is every RPC of all of them by name: the one table both
    servers serve (rpc_methods)."""

    def __init__(self, dp: DataPlaneAPI, settings: FrontendSettings) -> None:
        self._dp = dp
        self._settings = settings
        self._forward = forward.maybe(settings.grpc_header_forward_pattern)
        self.shm_rpcs = SharedMemoryRpcs(dp)
        self.log_rpcs = LogRpcs(dp)
        self.trace_rpcs = TraceRpcs(dp)
        # what ModelStreamInfer runs per request: _stream_one, traced where tracing can be
        self._produce = traced_stream_one(self._stream_one, dp)

    def handlers(self) -> dict[str, Handler]:
        """RPC name -> handler: every RPC this service implements, built once."""
        return {
            "ServerLive": self.ServerLive,
            "ServerReady": self.ServerReady,
            "ModelReady": self.ModelReady,
            "ServerMetadata": self.ServerMetadata,
            "ModelMetadata": self.ModelMetadata,
            "ModelConfig": self.ModelConfig,
            "ModelStatistics": self.ModelStatistics,
            "RepositoryIndex": self.RepositoryIndex,
            "RepositoryModelLoad": self.RepositoryModelLoad,
            "RepositoryModelUnload": self.RepositoryModelUnload,
            "ModelInfer": traced_model_infer(self.ModelInfer, self._dp),
            "ModelStreamInfer": self.ModelStreamInfer,
            **self.shm_rpcs.handlers(),
            **self.log_rpcs.handlers(),
            **self.trace_rpcs.handlers(),
        }

    # -- health and metadata --------------------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._dp.live())

    async def ServerReady(self, request: pb.ServerReadyRequest,
                          context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._dp.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest,
                         context) -> pb.ModelReadyResponse:
        ready = await self._dp.model_ready(request.name, request.version)
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context) -> pb.ServerMetadataResponse:
        return codec.server_metadata_to_proto(self._settings.server_metadata())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context) -> pb.ModelMetadataResponse:
        md = await self._dp.model_metadata(request.name, request.version)
        return codec.model_metadata_to_proto(md)

    async def ModelConfig(self, request: pb.ModelConfigRequest,
                          context) -> pb.ModelConfigResponse:
        config = await self._dp.model_config(request.name, request.version)
        return codec.model_config_to_proto(config)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest,
                              context) -> pb.ModelStatisticsResponse:
        stats = await self._dp.statistics(request.name, request.version)
        return stats_codec.stats_to_proto(stats)

    # -- model repository -----------------------------------------------------------------
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                              context) -> pb.RepositoryIndexResponse:
        if request.repository_name:
            raise unsupported(REPOSITORY_NAME_UNSUPPORTED)
        items = await self._dp.repository_index(request.ready)
        return codec.repository_index_to_proto(items)

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context) -> pb.RepositoryModelLoadResponse:
        params = codec.load_parameters(request)
        await self._dp.load_model(request.model_name, params)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context) -> pb.RepositoryModelUnloadResponse:
        params = codec.unload_parameters(request)
        await self._dp.unload_model(request.model_name, params)
        return pb.RepositoryModelUnloadResponse()

    # -- inference ------------------------------------------------------------------------
    async def ModelInfer(self, request: tuple[pb.ModelInferRequest, list[memoryview]],
                         context) -> bytes:
        msg, raw = request
        core = codec.request_from_proto(msg, raw)
        if self._forward is not None:
            self._forward.apply(core.parameters, forward.grpc_metadata(context))
        resp = await self._dp.infer(core, "ModelInfer RPC")
        try:
            if not resp.id:
                resp.id = core.id
            return codec.encode_infer_response(resp)
        finally:
            self._dp.release(resp)

    async def _stream_one(self, request: tuple[pb.ModelInferRequest, list[memoryview]],
                          out: asyncio.Queue, after: asyncio.Event | None,
                          sent: asyncio.Event, metadata: list[tuple[str, str]],
                          budget: _StreamBudget, cost: int) -> None:
        """Every response to one stream request, serialized, onto ``out``; then None. Errors
        become an error_message (with the request id) and never end the stream. Every
        response carries triton_final_response; a decoupled model's bare final flag is
        written only when the client asked for it (parameter
        triton_enable_empty_final_response), as Triton does. The request goes to
        the scheduler only after the one before it (``after``) has: a stream's requests run
        concurrently but arrive in order (a sequence's requests must), even when one of them
        waits for model metadata the next finds cached. ``metadata``: the stream's headers
        that each request forwards (--grpc-header-forward-pattern). ``budget``: the
        stream's answers held; a decoupled model's next response waits for room. ``cost``:
        the request's tensor bytes, as budget.start counted them."""
        msg, raw = request

        def put(data: bytes) -> None:
            budget.add(len(data))
            out.put_nowait(data)

        try:
            if after is not None:
                await after.wait()
            core = codec.request_from_proto(msg, raw)
            if self._forward is not None:
                self._forward.apply(core.parameters, metadata)
            want_empty = bool(core.parameters.pop("triton_enable_empty_final_response", False))
            async for resp in self._dp.infer_stream(core, sent.set):
                try:
                    if resp.error is not None:   # not the last: the request goes on
                        put(codec.encode_stream_error(resp.error.message, core.id))
                        trace.sent()
                        continue
                    if resp.empty and not want_empty:
                        continue
                    # Triton marks every stream response (stream_infer_handler.cc), the
                    # bare final flag only when asked for it.
                    resp.parameters = {**resp.parameters, "triton_final_response": resp.final}
                    if not resp.id:
                        resp.id = core.id
                    put(codec.encode_stream_response(resp))
                    trace.sent()   # (a traced request's GRPC_SEND_*)
                finally:
                    self._dp.release(resp)
                if budget.held >= budget.limit:
                    await budget.room(out)
        except Exception as exc:  # noqa: BLE001
            put(codec.encode_stream_error(_as_error(exc, "ModelStreamInfer").message, msg.id))
        finally:
            sent.set()
            out.put_nowait(None)
            budget.done(cost)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any],
                               context) -> AsyncIterator[bytes]:
        """Requests run concurrently (at most STREAM_WINDOW in flight); responses are
        written request by request in arrival order, as Triton does for non-decoupled
        models (a decoupled model's responses to one request are written as they come).

        1. a reader task starts a producer per incoming request, each with its own queue,
           queued in arrival order; 2. this generator drains the head queue to its end
           marker; 3. on client cancel or stream error, every producer is cancelled.
        """
        window = asyncio.Semaphore(STREAM_WINDOW)
        budget = _StreamBudget(self._settings.grpc_limits.max_pending_stream_bytes)
        metadata = forward.grpc_metadata(context) if self._forward is not None else []
        sources: asyncio.Queue[tuple[asyncio.Task, asyncio.Queue] | None] = asyncio.Queue()

        async def read() -> None:
            before: asyncio.Event | None = None
            try:
                async for request in request_iterator:
                    await window.acquire()
                    cost = _tensor_bytes(request)
                    await budget.start(cost)
                    out: asyncio.Queue = asyncio.Queue()
                    sent = asyncio.Event()
                    sources.put_nowait((asyncio.ensure_future(
                        self._produce(request, out, before, sent, metadata, budget, cost)),
                        out))
                    before = sent
            finally:
                sources.put_nowait(None)  # end of requests (also on a read error)

        reader = asyncio.ensure_future(read())
        source = None
        try:
            while (source := await sources.get()) is not None:
                out = source[1]
                while (response := await out.get()) is not None:
                    yield response
                    budget.taken(len(response))
                window.release()
            await reader  # re-raise a read error as the stream's status
        finally:
            reader.cancel()
            if source is not None:
                source[0].cancel()
            while not sources.empty():
                source = sources.get_nowait()
                if source is not None:
                    source[0].cancel()


def _unimplemented(name: str) -> Handler:
    async def handler(request: Any, context) -> Any:
        raise TriremeError(Code.UNSUPPORTED, f"'{name}' is not implemented")
    return handler


@dataclass(frozen=True)
class RpcMethod:
    """One RPC as both gRPC servers (grpc.aio and grpc/native.py) serve it."""
    streaming: bool
    handler: Callable[..., Any]
    deserialize: Callable[[Any], Any]
    serialize: Callable[[Any], bytes]


def rpc_methods(dp: DataPlaneAPI, settings: FrontendSettings) -> dict[str, RpcMethod]:
    """'/package.Service/Method' -> RpcMethod, for every RPC in protos/grpc_service.proto and
    grpc.health.v1.Health/Check: the one table, built once, that grpc/native.py looks a
    call's :path up in and that grpc.aio registers."""
    handlers = GrpcService(dp, settings).handlers()
    methods: dict[str, RpcMethod] = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        name = method.name
        path = f"/{SERVICE_NAME}/{name}"
        impl = handlers.pop(name, None) or _unimplemented(name)
        if name == "ModelInfer":
            methods[path] = RpcMethod(False, _guard(name, impl), codec.decode_infer_request,
                                      _identity)
        elif name == "ModelStreamInfer":
            methods[path] = RpcMethod(True, impl, codec.decode_infer_request, _identity)
        else:
            methods[path] = RpcMethod(False, _guard(name, impl),
                                      getattr(pb, method.input_type.name).FromString,
                                      getattr(pb, method.output_type.name).SerializeToString)
    if handlers:
        raise ValueError(f"no such RPC in protos/grpc_service.proto: {sorted(handlers)}")
    methods[f"/{HEALTH_SERVICE_NAME}/Check"] = RpcMethod(False, _health_check(dp), _identity,
                                                         _identity)
    return methods


def _health_check(dp: DataPlaneAPI) -> Handler:
    """grpc.health.v1.Health/Check: SERVING when the server is ready (as Triton)."""
    async def check(request: bytes, context) -> bytes:
        try:
            return _HEALTH_SERVING if dp.ready() else _HEALTH_NOT_SERVING
        except Exception:
            log.exception("health check failed")
            return _HEALTH_UNKNOWN
    return check


def address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


async def start_grpc(dp: DataPlaneAPI, settings: FrontendSettings) -> Any:
    """Start the gRPC server on {host}:{grpc_port} and return it (stop with `.stop(grace)`).

    ``settings.grpc_impl`` picks the server: "native" (grpc/native.py, the default: HTTP/2 on
    this event loop, on the socket `trireme serve` handed down or its own: listen.py) or "aio"
    (grpc.aio, whose frontends share the port by SO_REUSEPORT). The bound port (useful with
    grpc_port=0) is available as `server.trireme_port`.
    """
    methods = rpc_methods(dp, settings)
    restricted = _restricted_methods(methods, settings.restricted.grpc)
    if settings.grpc_impl == "native":
        if restricted:
            server = _restricted_native_server(methods, restricted, settings)
        else:
            from services.frontend.grpc.native import NativeGrpcServer
            server = NativeGrpcServer(methods, settings.grpc_limits,
                                      settings.grpc_header_forward_pattern is not None)
        ssl_context = None
        if settings.grpc_tls is not None:
            ssl_context = tls.server_context(settings.grpc_tls, "h2")
        await server.start(settings.host, settings.grpc_port, ssl_context,
                           fd=settings.grpc_listen_fd, reuse_port=settings.reuse_port)
    else:
        from services.frontend.grpc.aio_server import start_aio
        if restricted:
            methods = _restricted_aio_methods(methods, restricted)
        server = await start_aio(methods, settings)
    log.info("Started GRPCInferenceService at %s%s", address(settings.host, server.trireme_port),
             tls.describe(settings.grpc_tls))
    return server


# ---- restricted protocols (--grpc-restricted-protocol) -----------------------------------
# Triton checks a call's metadata before it runs (CommonCallData::ExecutePrecondition,
# InferHandler and ModelStreamInferHandler): the first value of the key (prefix included)
# must equal the configured value, else UNAVAILABLE "This protocol is restricted, expecting
# header '<key>'". A stream is refused as it opens, before any request is read. The check is
# installed only for the restricted methods, and only when a restriction is configured.

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _restricted_methods(methods: dict[str, RpcMethod],
                        restricted: Mapping[str, Restriction]) -> dict[str, Restriction]:
    """path -> Restriction for every method of ``methods`` in a restricted group."""
    if not restricted:
        return {}
    rules = {}
    for path in methods:
        group = GRPC_METHOD_GROUPS.get(path)
        if group is not None and group in restricted:
            rules[path] = restricted[group]
    return rules


def _unbase64(value: bytes) -> bytes | None:
    """A "-bin" metadata value as gRPC hands it to a server: base64-decoded (padding
    optional); None when it is not base64."""
    try:
        return base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None


def _restricted_native_server(methods: dict[str, RpcMethod], rules: dict[str, Restriction],
                              settings: FrontendSettings) -> Any:
    """A NativeGrpcServer that refuses a call to a restricted method from its HEADERS frame,
    before a byte of its body is read (its messages are dropped as they come)."""
    from services.frontend.grpc import native

    # :path -> (metadata key in lower case as HTTP/2 carries it, value, Trailers-Only block)
    checks = {
        path.encode(): (r.header.lower().encode("latin-1"), r.value.encode("utf-8"),
                        r.header.lower().endswith("-bin"),
                        native._status_block(_UNAVAILABLE.value[0], grpc_refusal_text(r.header),
                                             False))
        for path, r in rules.items()}

    class RestrictedNativeGrpcServer(native.NativeGrpcServer):
        def _open_stream(self, conn: Any, sid: int, headers: list) -> Any:
            path = content_type = b""
            for name, value in headers:
                if name == b":path":
                    path = value
                elif name == b"content-type":
                    content_type = value
            check = checks.get(path)
            # not gRPC at all: the plain server's answer (415), as grpc core gives it first
            if check is not None and content_type.startswith(b"application/grpc"):
                key, expected, binary, refusal = check
                for name, value in headers:
                    if name == key:                 # the first value counts
                        if (_unbase64(value) if binary else value) == expected:
                            return super()._open_stream(conn, sid, headers)
                        break
                conn.send_headers(sid, refusal, True)
                return native._REFUSED
            return super()._open_stream(conn, sid, headers)

    return RestrictedNativeGrpcServer(methods, settings.grpc_limits,
                                      settings.grpc_header_forward_pattern is not None)


def _aio_allowed(context: Any, key: str, expected: str) -> bool:
    for k, v in context.invocation_metadata() or ():
        if k == key:                                # the first value counts
            if isinstance(v, bytes):
                return v == expected.encode("utf-8")
            return v == expected
    return False


def _restricted_aio_methods(methods: dict[str, RpcMethod],
                            rules: dict[str, Restriction]) -> dict[str, RpcMethod]:
    """``methods`` with the restricted ones checked first on grpc.aio: a unary request is
    deserialized only once its call is allowed; a stream is refused before it is read."""
    out = dict(methods)
    for path, rule in rules.items():
        m = methods[path]
        key, expected = rule.header.lower(), rule.value
        text = grpc_refusal_text(rule.header)
        if m.streaming:
            out[path] = RpcMethod(True, _aio_checked_stream(m.handler, key, expected, text),
                                  m.deserialize, m.serialize)
        else:
            out[path] = RpcMethod(False, _aio_checked_unary(m, key, expected, text),
                                  _identity, m.serialize)
    return out


def _aio_checked_unary(m: RpcMethod, key: str, expected: str, text: str) -> Handler:
    handler, deserialize = m.handler, m.deserialize

    async def checked(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        if not _aio_allowed(context, key, expected):
            await context.abort(_UNAVAILABLE, text)
        try:
            request = deserialize(raw)
        except TriremeError as e:   # our decoder: the client's fault, as the native server says
            await context.abort(grpc_status(e.code), e.message)
        except Exception:  # noqa: BLE001 - grpc's own answer to an undecodable request
            await context.abort(grpc.StatusCode.INTERNAL, "Exception deserializing request!")
        return await handler(request, context)
    return checked


def _aio_checked_stream(handler: Callable[..., Any], key: str, expected: str,
                        text: str) -> Callable[..., Any]:
    async def checked(request_iterator: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if not _aio_allowed(context, key, expected):
            await context.abort(_UNAVAILABLE, text)
        async for response in handler(request_iterator, context):
            yield response
    return checked
