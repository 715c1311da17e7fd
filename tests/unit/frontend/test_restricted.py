"""Restricted API groups (--http-restricted-api, --grpc-restricted-protocol): parsing with
Triton's texts, the endpoint -> group tables, and both protocols' checks on both servers of
each (over fake data planes: no scheduler, no workers).

Triton's sources: src/command_line_parser.cc (ParseRestrictedFeatureOption,
ParseGenericConfigOption, SplitOptions), src/restricted_features.h, src/http_server.cc
(RespondIfRestricted; Handle routes) and src/grpc/grpc_server.cc (the category of each RPC).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json

import grpc
import pytest

from protos import grpc_service_pb2 as pb
from services.frontend.grpc.methods import rpc_methods, start_grpc
from services.frontend.http.message import Headers
from services.frontend.http.routes import Handlers, start_http
from services.frontend.main import add_frontend_args, frontend_argv, settings_from_args
from services.frontend.restricted import (
    GROUPS,
    GRPC_KEY_PREFIX,
    GRPC_METHOD_GROUPS,
    Restriction,
    RestrictionError,
    Restrictions,
    http_group,
    parse_restrictions,
)
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_grpc_codec import FakeDataPlane, echo_request
from tests.unit.frontend.test_grpc_native import DATA, HEADERS, RawClient, grpc_message, request_headers

SERVICE = "/inference.GRPCInferenceService/"


# ---- parsing ----------------------------------------------------------------------------

def http(*specs: str) -> dict[str, Restriction]:
    return parse_restrictions(specs, "http-restricted-api", "api")


def grpc_(*specs: str) -> dict[str, Restriction]:
    return parse_restrictions(specs, "grpc-restricted-protocol", "protocol", GRPC_KEY_PREFIX)


def test_group_names_are_tritons_in_its_order():
    assert GROUPS == ("health", "metadata", "inference", "shared-memory", "model-config",
                      "model-repository", "statistics", "trace", "logging")


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_alone(group):
    assert http(f"{group}:k=v") == {group: Restriction("k", "v")}


def test_valid_forms():
    assert http() == {}
    assert http("inference,metadata:infer-key=infer-value") == {
        "inference": Restriction("infer-key", "infer-value"),
        "metadata": Restriction("infer-key", "infer-value")}
    # repeated flags, each group with its own header
    assert http("model-repository:admin-key=admin-value", "inference:k=v") == {
        "model-repository": Restriction("admin-key", "admin-value"),
        "inference": Restriction("k", "v")}
    # the groups end at the first ':', the key at the first '=' after it: the value keeps
    # any ':' and '=', the key any ':'
    assert http("health:k=a=b:c") == {"health": Restriction("k", "a=b:c")}
    assert http("health:a:b=c") == {"health": Restriction("a:b", "c")}
    assert http(",".join(GROUPS) + ":k=v") == {g: Restriction("k", "v") for g in GROUPS}


def test_grpc_keys_get_tritons_prefix():
    assert grpc_("inference,health:infer-key=infer-value") == {
        "inference": Restriction("triton-grpc-protocol-infer-key", "infer-value"),
        "health": Restriction("triton-grpc-protocol-infer-key", "infer-value")}


FORMAT = "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got {}"


@pytest.mark.parametrize("spec", ["health", "health=k", "health:k", "health:kv", ":k=v",
                                  "health:=v", "health:k=", "", ":", "=", "health:"])
def test_format_errors(spec):
    with pytest.raises(RestrictionError) as info:
        http(spec)
    assert str(info.value) == FORMAT.format(spec)


def test_format_error_names_the_grpc_flag():
    with pytest.raises(RestrictionError) as info:
        grpc_("inference")
    assert str(info.value) == ("--grpc-restricted-protocol option format is "
                               "'<config name>:<setting>=<value>'. Got inference")


@pytest.mark.parametrize(("spec", "name"), [
    ("model-reposit,health:k1=v1", "model-reposit"),
    ("Health:k=v", "Health"),                    # names are matched exactly, case included
    ("health, metadata:k=v", " metadata"),       # nothing is trimmed
    ("health,,metadata:k=v", ""),                # SplitOptions keeps empty pieces
    ("health,:k=v", ""),
    ("health=x:k=v", "health=x"),
])
def test_unknown_group(spec, name):
    with pytest.raises(RestrictionError) as info:
        http(spec)
    assert str(info.value) == f"unknown restricted api '{name}' "    # Triton's space, too
    with pytest.raises(RestrictionError) as info:
        grpc_(spec)
    assert str(info.value) == f"unknown restricted protocol '{name}' "


@pytest.mark.parametrize("specs", [
    ("model-repository,health:k1=v1", "metadata,health:k2=v2"),   # qa/L0_http/test.sh
    ("health,health:k=v",),
    ("health:k=v", "health:k=v"),
])
def test_group_in_two_groups(specs):
    with pytest.raises(RestrictionError) as info:
        http(*specs)
    assert str(info.value) == "restricted api 'health' can not be specified in multiple config groups"
    with pytest.raises(RestrictionError) as info:
        grpc_(*specs)
    assert str(info.value) == ("restricted protocol 'health' can not be specified in multiple "
                               "config groups")


def frontend_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trireme frontend", exit_on_error=False)
    add_frontend_args(p)
    return p


def test_flags_reach_the_settings_and_are_forwarded_by_serve():
    argv = ["--http-restricted-api", "model-repository:admin-key=admin-value",
            "--http-restricted-api=inference,metadata:infer-key=infer-value",
            "--grpc-restricted-protocol=inference,health:infer-key=infer-value"]
    args = frontend_parser().parse_args(argv)
    settings = settings_from_args(args, "unix:///x")
    assert settings.restricted == Restrictions(
        {"model-repository": Restriction("admin-key", "admin-value"),
         "inference": Restriction("infer-key", "infer-value"),
         "metadata": Restriction("infer-key", "infer-value")},
        {"inference": Restriction("triton-grpc-protocol-infer-key", "infer-value"),
         "health": Restriction("triton-grpc-protocol-infer-key", "infer-value")})
    forwarded = frontend_argv(args)
    again = frontend_parser().parse_args(forwarded)
    assert settings_from_args(again, "unix:///x").restricted == settings.restricted
    none = settings_from_args(frontend_parser().parse_args([]), "unix:///x")
    assert none.restricted == Restrictions() and not none.restricted.http
    assert "--http-restricted-api" not in frontend_argv(frontend_parser().parse_args([]))


@pytest.mark.parametrize(("argv", "text"), [
    (["--http-restricted-api=model-repository,health:k1=v1",
      "--http-restricted-api=metadata,health:k2=v2"],
     "argument --http-restricted-api: restricted api 'health' can not be specified in "
     "multiple config groups"),
    (["--grpc-restricted-protocol=model-reposit,health:k1=v1"],
     "argument --grpc-restricted-protocol: unknown restricted protocol 'model-reposit' "),
    (["--grpc-restricted-protocol", "health"],
     "argument --grpc-restricted-protocol: --grpc-restricted-protocol option format is "
     "'<config name>:<setting>=<value>'. Got health"),
])
def test_bad_flags_stop_the_parse_with_tritons_text(argv, text):
    with pytest.raises(argparse.ArgumentError) as info:
        frontend_parser().parse_args(argv)
    assert str(info.value) == text


# ---- matching: endpoint -> group ----------------------------------------------------------

@pytest.mark.parametrize(("path", "group"), [
    ("/v2", "metadata"),
    ("/v2/health/live", "health"),
    ("/v2/health/ready", "health"),
    ("/v2/models/m", "metadata"),
    ("/v2/models/m/versions/1", "metadata"),
    ("/v2/models/m/ready", "health"),
    ("/v2/models/m/versions/2/ready", "health"),
    ("/v2/models/m/infer", "inference"),
    ("/v2/models/m/versions/1/infer", "inference"),
    ("/v2/models/m/generate", "inference"),
    ("/v2/models/m/generate_stream", "inference"),
    ("/v2/models/m/config", "model-config"),
    ("/v2/models/m/versions/1/config", "model-config"),
    ("/v2/models/stats", "statistics"),
    ("/v2/models/m/stats", "statistics"),
    ("/v2/models/m/versions/1/stats", "statistics"),
    ("/v2/models/m/trace/setting", "trace"),
    ("/v2/trace/setting", "trace"),
    ("/v2/logging", "logging"),
    ("/v2/systemsharedmemory/status", "shared-memory"),
    ("/v2/systemsharedmemory/region/r/register", "shared-memory"),
    ("/v2/systemsharedmemory/region/r/unregister", "shared-memory"),
    ("/v2/cudasharedmemory/status", "shared-memory"),
    ("/v2/cudasharedmemory/region/r/status", "shared-memory"),
    ("/v2/repository/index", "model-repository"),
    ("/v2/repository/r/index", "model-repository"),
    ("/v2/repository/models/m/load", "model-repository"),
    ("/v2/repository/models/m/unload", "model-repository"),
    ("/v2/repository/r/models/m/load", "model-repository"),
    # what Triton answers 404 without a check
    ("/v2/models/m/versions/1/trace/setting", None),
    ("/v2/models/m/versions/x/infer", None),
    ("/v2/models/m/nope", None),
    ("/v2/models/", None),
    ("/v2/health", None),
    ("/v2/repository/models/m/reload", None),
    ("/v2/systemsharedmemory/region/r", None),
    ("/metrics", None),
    ("/", None),
])
def test_http_paths_map_to_tritons_groups(path, group):
    assert http_group(path) == group


def test_every_grpc_method_has_tritons_group():
    methods = rpc_methods(FakeDataPlane(), FrontendSettings(scheduler_addr=""))
    assert set(methods) == set(GRPC_METHOD_GROUPS)
    groups = {}
    for path, group in GRPC_METHOD_GROUPS.items():
        groups.setdefault(group, set()).add(path.rsplit("/", 1)[1])
    assert groups == {
        "health": {"ServerLive", "ServerReady", "ModelReady", "Check"},
        "metadata": {"ServerMetadata", "ModelMetadata"},
        "inference": {"ModelInfer", "ModelStreamInfer"},
        "model-config": {"ModelConfig"},
        "statistics": {"ModelStatistics"},
        "model-repository": {"RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"},
        "shared-memory": {"SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
                          "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus",
                          "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister"},
        "trace": {"TraceSetting"},
        "logging": {"LogSettings"},
    }
    assert "/grpc.health.v1.Health/Check" in GRPC_METHOD_GROUPS


# ---- HTTP: the handlers ---------------------------------------------------------------------

class Request:
    """The handlers' request shape; read() records that the body was read."""

    def __init__(self, method: str, path: str, headers: dict | None = None,
                 body: bytes = b"") -> None:
        self.method, self.path, self.query = method, path, ""
        self.headers = Headers({k.lower(): v for k, v in (headers or {}).items()})
        self.body, self.read_called = body, False

    async def read(self) -> bytes:
        self.read_called = True
        return self.body


class HttpDataPlane(FakeDataPlane):
    async def statistics(self, model: str, version: str) -> list:
        return []


def restricted_settings(**kw) -> FrontendSettings:
    return FrontendSettings(scheduler_addr="", restricted=Restrictions.parse(
        ["model-repository:admin-key=admin-value", "inference,metadata:infer-key=infer-value"],
        ["model-repository:admin-key=admin-value", "inference,health:infer-key=infer-value"]),
        **kw)


def answer(handlers: Handlers, request: Request) -> tuple[int, dict | None]:
    reply = asyncio.run(handlers.dispatch(request))
    return reply.status, json.loads(reply.body) if reply.body else None


def test_unrestricted_server_decides_once_and_checks_nothing():
    h = Handlers(HttpDataPlane(), FrontendSettings(scheduler_addr=""))
    assert h.dispatch == h._route                    # no check in the request path at all
    assert answer(h, Request("GET", "/v2"))[0] == 200
    r = restricted_settings()
    assert Handlers(HttpDataPlane(), r).dispatch != Handlers(HttpDataPlane(), r)._route


def test_http_refusals_have_tritons_status_and_text():
    h = Handlers(HttpDataPlane(), restricted_settings())
    metadata = {"error": "This API is restricted, expecting header 'infer-key'"}
    assert answer(h, Request("GET", "/v2")) == (403, metadata)
    assert answer(h, Request("GET", "/v2", {"infer-key": "wrong"})) == (403, metadata)
    assert answer(h, Request("GET", "/v2", {"infer-key": "infer-value "})) == (403, metadata)
    assert answer(h, Request("GET", "/v2", {"infer-key": "INFER-VALUE"})) == (403, metadata)
    assert answer(h, Request("GET", "/v2", {"admin-key": "admin-value"})) == (403, metadata)
    assert answer(h, Request("GET", "/v2", {"infer-key": "infer-value"}))[0] == 200
    assert answer(h, Request("GET", "/v2", {"Infer-Key": "infer-value"}))[0] == 200  # any case
    assert answer(h, Request("GET", "/v2/models/m", {"infer-key": "wrong"})) == (403, metadata)
    assert answer(h, Request("GET", "/v2/models/m", {"infer-key": "infer-value"}))[0] == 200
    admin = {"error": "This API is restricted, expecting header 'admin-key'"}
    unload = Request("POST", "/v2/repository/models/m/unload", {"infer-key": "infer-value"}, b"{}")
    assert answer(h, unload) == (403, admin)
    assert not unload.read_called                    # refused before the body is read
    ok = Request("POST", "/v2/repository/models/m/unload", {"admin-key": "admin-value"}, b"{}")
    assert answer(h, ok) == (200, None) and ok.read_called
    infer = Request("POST", "/v2/models/m/versions/1/infer", {"test": "1"}, b"not json")
    assert answer(h, infer) == (403, metadata) and not infer.read_called


def test_http_restriction_comes_before_the_method_check_and_404s():
    h = Handlers(HttpDataPlane(), restricted_settings())
    metadata = {"error": "This API is restricted, expecting header 'infer-key'"}
    # Triton checks the restriction first, then the method
    assert answer(h, Request("POST", "/v2")) == (403, metadata)
    assert answer(h, Request("POST", "/v2", {"infer-key": "infer-value"}))[0] == 405
    assert answer(h, Request("GET", "/v2/models/m/infer")) == (403, metadata)
    assert answer(h, Request("POST", "/v2/models/m/generate")) == (403, metadata)
    # paths of no group, and unrestricted groups, pass untouched
    assert answer(h, Request("GET", "/v2/nope")) == (404, {"error": "Not Found"})
    assert answer(h, Request("GET", "/v2/health/ready")) == (200, None)
    assert answer(h, Request("GET", "/v2/models/m/ready")) == (200, None)
    assert answer(h, Request("GET", "/v2/models/stats"))[0] == 200


@pytest.mark.parametrize("impl", ["native", "aiohttp"])
def test_http_servers_refuse_without_waiting_for_the_body(impl):
    """A request that declares a large body and sends none is refused at once, on both
    servers, and the connection keeps serving."""
    async def main():
        server = await start_http(HttpDataPlane(), restricted_settings(
            host="127.0.0.1", http_port=0, http_impl=impl))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /v2/repository/models/m/load HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000000\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 403")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = await reader.readexactly(length)
            assert json.loads(body) == {
                "error": "This API is restricted, expecting header 'admin-key'"}
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        finally:
            await server.stop(1.0)
    asyncio.run(main())


# ---- gRPC: both servers ---------------------------------------------------------------------

INFER_KEY = (("triton-grpc-protocol-infer-key", "infer-value"),)
ADMIN_KEY = (("triton-grpc-protocol-admin-key", "admin-value"),)
REFUSED_INFER = "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
REFUSED_ADMIN = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"


def run_grpc(body, impl: str, settings: FrontendSettings | None = None):
    async def main():
        dp = FakeDataPlane()
        s = settings or restricted_settings()
        s.host, s.grpc_port, s.grpc_impl = "127.0.0.1", 0, impl
        server = await start_grpc(dp, s)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
                await asyncio.wait_for(body(ch, dp, server), 20)
        finally:
            await server.stop(None)
    asyncio.run(main())


def unary(ch, name, req_cls, resp_cls):
    return ch.unary_unary(SERVICE + name, request_serializer=req_cls.SerializeToString,
                          response_deserializer=resp_cls.FromString)


async def refused(call, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == text


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_refusals_have_tritons_code_and_text(impl):
    async def body(ch, dp, server):
        live = unary(ch, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse)
        await refused(live(pb.ServerLiveRequest()), REFUSED_INFER)
        await refused(live(pb.ServerLiveRequest(), metadata=(
            ("triton-grpc-protocol-infer-key", "wrong"),)), REFUSED_INFER)
        await refused(live(pb.ServerLiveRequest(), metadata=(("infer-key", "infer-value"),)),
                      REFUSED_INFER)                    # the key without Triton's prefix
        await refused(live(pb.ServerLiveRequest(), metadata=ADMIN_KEY), REFUSED_INFER)
        assert (await live(pb.ServerLiveRequest(), metadata=INFER_KEY)).live
        # the first value of a repeated key counts (grpc's multimap find)
        assert (await live(pb.ServerLiveRequest(), metadata=(
            *INFER_KEY, ("triton-grpc-protocol-infer-key", "x")))).live
        await refused(live(pb.ServerLiveRequest(), metadata=(
            ("triton-grpc-protocol-infer-key", "x"), *INFER_KEY)), REFUSED_INFER)
        health = ch.unary_unary("/grpc.health.v1.Health/Check")
        await refused(health(b""), REFUSED_INFER)
        assert await health(b"", metadata=INFER_KEY) == b"\x08\x01"
        ready = unary(ch, "ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse)
        await refused(ready(pb.ModelReadyRequest(name="m")), REFUSED_INFER)

        infer = unary(ch, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        await refused(infer(echo_request("m", "a")), REFUSED_INFER)
        assert (await infer(echo_request("m", "a"), metadata=INFER_KEY)).id == "a"

        unload = unary(ch, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest,
                       pb.RepositoryModelUnloadResponse)
        await refused(unload(pb.RepositoryModelUnloadRequest(model_name="m"),
                             metadata=INFER_KEY), REFUSED_ADMIN)
        assert dp.calls == []
        await unload(pb.RepositoryModelUnloadRequest(model_name="m"), metadata=ADMIN_KEY)
        assert dp.calls == [("unload", "m", {"unload_dependents": False})]

        # unrestricted groups: no header needed
        md = unary(ch, "ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse)
        assert (await md(pb.ServerMetadataRequest())).name == "trireme"
        meta = unary(ch, "ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse)
        assert (await meta(pb.ModelMetadataRequest(name="m"), metadata=INFER_KEY)).name == "m"
    run_grpc(body, impl)


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_refusal_comes_before_the_message_is_decoded(impl):
    """An undecodable request to a restricted method is refused (UNAVAILABLE), not failed
    as undecodable: the message is never parsed for a caller without the key."""
    async def body(ch, dp, server):
        raw = ch.unary_unary(SERVICE + "ModelInfer")
        await refused(raw(b"\xff\xff\xff"), REFUSED_INFER)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff", metadata=INFER_KEY)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("malformed ModelInferRequest: ")
    run_grpc(body, impl)


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_stream_is_refused_as_it_opens(impl):
    async def body(ch, dp, server):
        stream = ch.stream_stream(SERVICE + "ModelStreamInfer",
                                  request_serializer=pb.ModelInferRequest.SerializeToString,
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        call = stream()                                 # nothing written
        assert await call.code() == grpc.StatusCode.UNAVAILABLE
        assert await call.details() == REFUSED_INFER
        call = stream(metadata=INFER_KEY)
        await call.write(echo_request("m", "s1"))
        await call.done_writing()
        got = [r async for r in call]
        assert [r.infer_response.id for r in got] == ["s1"]
        assert await call.code() == grpc.StatusCode.OK
    run_grpc(body, impl)


def test_native_refuses_from_the_headers_frame():
    """The native server answers a restricted unary call as soon as its HEADERS arrive, with
    Trailers-Only, and drops the body that follows; the connection serves on."""
    async def body(ch, dp, server):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, 4, 1, request_headers())      # END_HEADERS, the body still to come
        headers, data, trailers = await c.response(1)
        assert data == b""
        assert headers[b":status"] == b"200"
        assert trailers[b"grpc-status"] == b"14"
        assert trailers[b"grpc-message"] == REFUSED_INFER.encode()
        c.frame(DATA, 1, 1, grpc_message(b"\xff" * 100))   # ignored
        c.frame(HEADERS, 5, 3, request_headers(content_type=b"application/json"))
        headers, _, _ = await c.response(3)                   # not gRPC: as unrestricted
        assert headers[b":status"] == b"415"
        key = (b"triton-grpc-protocol-infer-key", b"infer-value")
        c.frame(HEADERS, 4, 5, request_headers(extra=(key,)))
        c.frame(DATA, 1, 5, grpc_message(echo_request("m", "x").SerializeToString()))
        _, data, trailers = await c.response(5)
        assert trailers[b"grpc-status"] == b"0" and data
        c.close()
    run_grpc(body, "native")


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_binary_keys_compare_decoded_values(impl):
    settings = FrontendSettings(scheduler_addr="", restricted=Restrictions.parse(
        (), ["health:key-bin=secret"]))

    async def body(ch, dp, server):
        live = unary(ch, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse)
        assert (await live(pb.ServerLiveRequest(), metadata=(
            ("triton-grpc-protocol-key-bin", b"secret"),))).live
        await refused(live(pb.ServerLiveRequest(), metadata=(
            ("triton-grpc-protocol-key-bin", b"other"),)),
            "This protocol is restricted, expecting header 'triton-grpc-protocol-key-bin'")
    run_grpc(body, impl, settings)


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_unrestricted_server_is_the_plain_one(impl):
    async def body(ch, dp, server):
        from services.frontend.grpc.native import NativeGrpcServer
        if impl == "native":
            assert type(server) is NativeGrpcServer
        live = unary(ch, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse)
        assert (await live(pb.ServerLiveRequest())).live
    run_grpc(body, impl, FrontendSettings(scheduler_addr=""))


# ---- the start-up warning (services/cli.py) ----------------------------------------------

def cli_args(*argv: str) -> argparse.Namespace:
    from services import cli
    p = argparse.ArgumentParser()
    cli._add_scheduler_args(p)
    add_frontend_args(p)
    return p.parse_args(["--model-repository", "/tmp", *argv])


def warnings_at_start(caplog, args: argparse.Namespace, frontends_here: bool = True) -> list[str]:
    from services import cli
    caplog.clear()
    with caplog.at_level("WARNING", logger="trireme"):
        cli._warn_open_repository_api(args, frontends_here)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


HTTP_REPO = "--http-restricted-api=model-repository:k=v"
GRPC_REPO = "--grpc-restricted-protocol=model-repository,inference:k=v"


def test_start_up_warns_when_the_repository_api_is_open_in_explicit_mode(caplog):
    both = warnings_at_start(caplog, cli_args("--model-control-mode", "explicit"))
    assert len(both) == 1
    assert both[0].startswith("explicit model control: the model-repository API is not "
                              "restricted on HTTP and gRPC; it lets callers load models from "
                              "files they send (the 'file:' parameters of a load request "
                              "write model.py")
    assert "run code" in both[0] and "--http-restricted-api model-repository:" in both[0]
    [grpc_only] = warnings_at_start(caplog, cli_args("--model-control-mode=explicit", HTTP_REPO))
    assert "not restricted on gRPC;" in grpc_only
    [http_only] = warnings_at_start(caplog, cli_args("--model-control-mode=explicit", GRPC_REPO))
    assert "not restricted on HTTP;" in http_only
    # a protocol that is not served is not open
    assert warnings_at_start(caplog, cli_args("--model-control-mode=explicit", HTTP_REPO,
                                              "--allow-grpc", "false")) == []
    assert warnings_at_start(caplog, cli_args("--model-control-mode=explicit", HTTP_REPO,
                                              GRPC_REPO)) == []
    # other restrictions do not close it
    assert len(warnings_at_start(caplog, cli_args(
        "--model-control-mode=explicit", "--http-restricted-api=inference:k=v",
        "--grpc-restricted-protocol=health:k=v"))) == 1


def test_no_warning_where_the_repository_api_cannot_load(caplog):
    assert warnings_at_start(caplog, cli_args()) == []
    assert warnings_at_start(caplog, cli_args("--model-control-mode", "poll")) == []


def test_scheduler_alone_always_warns_in_explicit_mode(caplog):
    [warning] = warnings_at_start(caplog, cli_args("--model-control-mode=explicit"), False)
    assert "every frontend that connects to this scheduler" in warning
    assert "run code" in warning
    assert warnings_at_start(caplog, cli_args(), False) == []
