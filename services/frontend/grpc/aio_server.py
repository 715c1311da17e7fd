"""The gRPC method table served by grpc.aio (--grpc-impl aio): the same RpcMethods the
native server serves, registered as grpc.aio generic handlers."""
from __future__ import annotations

from typing import Any

import grpc

from services.common.errors import socket_in_use
from services.frontend.grpc.methods import MAX_GRPC_MESSAGE_SIZE, RpcMethod, address
from services.frontend.settings import FrontendSettings


def _aio_handlers(methods: dict[str, RpcMethod]) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    """service name -> method name -> grpc.aio handler."""
    services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for path, m in methods.items():
        service, name = path[1:].split("/")
        make = (grpc.stream_stream_rpc_method_handler if m.streaming
                else grpc.unary_unary_rpc_method_handler)
        services.setdefault(service, {})[name] = make(
            m.handler, request_deserializer=m.deserialize, response_serializer=m.serialize)
    return services


async def start_aio(methods: dict[str, RpcMethod], settings: FrontendSettings) -> Any:
    """grpc.aio serving ``methods`` on {host}:{grpc_port}, SO_REUSEPORT on."""
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 1),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    ])
    for service, handlers in _aio_handlers(methods).items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)
    where = address(settings.host, settings.grpc_port)
    try:
        port = server.add_insecure_port(where)
    except RuntimeError as e:
        raise socket_in_use(where, e) from e
    if port == 0:
        raise socket_in_use(where)
    await server.start()
    server.trireme_port = port
    return server
