"""The gRPC method table served by grpc.aio (--grpc-impl aio): the same RpcMethods the
native server serves, registered as grpc.aio generic handlers."""
from __future__ import annotations

from typing import Any

import grpc

from services.common.errors import PortTaken, TriremeError
from services.frontend import tls
from services.frontend.grpc.limits import INT32_MAX, GrpcLimits
from services.frontend.grpc.methods import MAX_GRPC_MESSAGE_SIZE, RpcMethod, address, grpc_status
from services.frontend.settings import FrontendSettings
from services.frontend.tls import TlsConfig


class _Malformed:
    """What a unary call's deserializer returns for a message our decoder refused: grpc.aio
    would answer a raising deserializer INTERNAL; the handler answers the decoder's
    INVALID_ARGUMENT instead, as the native server does."""
    __slots__ = ("error",)

    def __init__(self, error: TriremeError) -> None:
        self.error = error


def _unary(m: RpcMethod) -> tuple[Any, Any]:
    """(deserializer, handler) of a unary method, refused messages answered as the native
    server answers them."""
    decode, handle = m.deserialize, m.handler

    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except TriremeError as e:
            return _Malformed(e)

    async def handler(request: Any, context: Any) -> Any:
        if type(request) is _Malformed:
            await context.abort(grpc_status(request.error.code), request.error.message)
        return await handle(request, context)

    return deserialize, handler


def _aio_handlers(methods: dict[str, RpcMethod]) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    """service name -> method name -> grpc.aio handler."""
    services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for path, m in methods.items():
        service, name = path[1:].split("/")
        if m.streaming:
            handler = grpc.stream_stream_rpc_method_handler(
                m.handler, request_deserializer=m.deserialize, response_serializer=m.serialize)
        else:
            deserialize, handle = _unary(m)
            handler = grpc.unary_unary_rpc_method_handler(
                handle, request_deserializer=deserialize, response_serializer=m.serialize)
        services.setdefault(service, {})[name] = handler
    return services


def server_options(limits: GrpcLimits) -> list[tuple[str, int]]:
    """The grpc core channel arguments for the limits it has one for (grpc/limits.py): the
    keepalive ones exactly as Triton passes them (src/grpc/grpc_server.cc)."""
    options = [
        ("grpc.so_reuseport", 1),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", min(limits.max_message_size, INT32_MAX)),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # grpc core refuses some calls between the soft and the hard limit, all beyond it
        ("grpc.max_metadata_size", limits.max_header_list_size),
        ("grpc.absolute_max_metadata_size", limits.max_header_list_size),
        ("grpc.keepalive_time_ms", limits.keepalive_time_ms or INT32_MAX),
        ("grpc.keepalive_timeout_ms", limits.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(limits.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", limits.max_pings_without_data),
        ("grpc.http2.min_ping_interval_without_data_ms",
         limits.min_recv_ping_interval_without_data_ms),
        ("grpc.http2.max_ping_strikes", limits.max_ping_strikes),
    ]
    if limits.max_connection_age_ms:
        options.append(("grpc.max_connection_age_ms", limits.max_connection_age_ms))
    if limits.max_connection_age_grace_ms:
        options.append(("grpc.max_connection_age_grace_ms", limits.max_connection_age_grace_ms))
    if limits.idle_timeout_s:
        options.append(("grpc.max_connection_idle_ms", int(limits.idle_timeout_s * 1000)))
    if limits.handshake_timeout_s:
        options.append(("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout_s * 1000)))
    return options


def credentials(cfg: TlsConfig) -> grpc.ServerCredentials:
    """Triton's (src/grpc/grpc_server.cc): the key and certificate pair; with mutual TLS the
    root certificate and GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, else no
    client certificate is asked for. grpc core negotiates ALPN h2 itself. The files are
    checked first (tls.load), so a bad one is refused in words rather than by grpc core."""
    files = tls.load(cfg)
    return grpc.ssl_server_credentials([(files.key, files.cert)], root_certificates=files.root,
                                       require_client_auth=cfg.mutual)


async def start_aio(methods: dict[str, RpcMethod], settings: FrontendSettings) -> Any:
    """grpc.aio serving ``methods`` on {host}:{grpc_port}, SO_REUSEPORT on."""
    limits = settings.grpc_limits
    server = grpc.aio.server(options=server_options(limits))
    for service, handlers in _aio_handlers(methods).items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)
    where = address(settings.host, settings.grpc_port)
    try:
        if settings.grpc_tls is None:
            port = server.add_insecure_port(where)
        else:
            port = server.add_secure_port(where, credentials(settings.grpc_tls))
    except RuntimeError:
        raise PortTaken("GRPC", settings.host, settings.grpc_port) from None
    if port == 0:
        raise PortTaken("GRPC", settings.host, settings.grpc_port)
    await server.start()
    server.trireme_port = port
    return server
