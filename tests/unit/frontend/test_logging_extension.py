"""Triton's logging extension in the adapters: GET/POST /v2/logging and the LogSettings RPC
over a fake data plane (no scheduler), then over the real servers with tritonclient.

Every answer below is what tritonserver 2.51 answered to the same request (src/http_server.cc
HandleLogging, src/grpc/grpc_server.cc RegisterLogging), but one deliberate difference: an
update with a bad setting changes nothing (Triton applies the settings before it).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import msgspec
import pytest

from protos import grpc_service_pb2 as pb
from services.common import messages as m
from services.common.logsettings import LOG_FILE_TEXT
from services.frontend.grpc.log_methods import settings_to_proto, update_from_proto
from services.frontend.grpc.methods import start_grpc
from services.frontend.http.message import BodyTooLarge
from services.frontend.restricted import Restrictions
from services.frontend.settings import EXTENSIONS, FrontendSettings
from tests.unit.frontend.test_shm_routes import Request, ask, handlers, serving

FILE = "/tmp/lt/tlog.txt"
# tritonserver 2.51's GET /v2/logging, byte for byte (started with --log-file /tmp/lt/tlog.txt)
TRITON_GET = (b'{"log_file":"/tmp/lt/tlog.txt","log_info":true,"log_warning":true,'
              b'"log_error":true,"log_verbose_level":0,"log_format":"default"}')
NOT_BOOL = "attempt to access JSON non-boolean as boolean"
NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"
NOT_STRING = "attempt to access JSON non-string as string"


class LogDataPlane:
    """The scheduler's side in memory: the settings, every update recorded in ``calls``."""

    def __init__(self) -> None:
        self.settings = m.LogConfig(log_file=FILE)
        self.calls: list[dict[str, Any]] = []

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    async def log_settings(self, **changes: Any) -> m.LogConfig:
        self.calls.append(changes)
        self.settings = msgspec.structs.replace(self.settings, **changes)
        return self.settings


def post(dp: LogDataPlane, body: Any) -> tuple[int, Any]:
    status, payload, content_type = ask(handlers(dp), "POST", "/v2/logging", body)
    assert content_type == "application/json"
    return status, json.loads(payload)


# ---- HTTP ------------------------------------------------------------------------------------

def test_get_answers_tritons_bytes():
    dp = LogDataPlane()
    assert ask(handlers(dp), "GET", "/v2/logging") == (200, TRITON_GET, "application/json")
    assert ask(handlers(dp), "GET", "/v2/logging", b"ignored") == (200, TRITON_GET,
                                                                    "application/json")
    assert dp.calls == [{}, {}]


def test_post_updates_and_answers_the_new_settings():
    dp = LogDataPlane()
    status, doc = post(dp, {"log_info": False, "log_warning": False, "log_error": False,
                            "log_verbose_level": 3, "log_format": "ISO8601", "other": 1})
    assert status == 200 and doc == {
        "log_file": FILE, "log_info": False, "log_warning": False, "log_error": False,
        "log_verbose_level": 3, "log_format": "ISO8601"}
    assert list(doc) == ["log_file", "log_info", "log_warning", "log_error",
                         "log_verbose_level", "log_format"]
    assert dp.calls == [{"log_info": False, "log_warning": False, "log_error": False,
                         "log_verbose_level": 3, "log_format": "ISO8601"}]


@pytest.mark.parametrize("body", [b"{}", b"[]", b"null", b"3", b'{"log_file":null}',
                                  b'{"log_info":null,"log_format":null}', b'{"bogus":1}'])
def test_bodies_that_change_nothing(body):
    dp = LogDataPlane()
    assert ask(handlers(dp), "POST", "/v2/logging", body) == (200, TRITON_GET,
                                                               "application/json")
    assert dp.calls == [{}]


@pytest.mark.parametrize("body, status, text", [
    (b"", 500, "failed to parse the request JSON buffer: The document is empty. at 0"),
    (b"xx", 500, "failed to parse the request JSON buffer: Invalid value. at 0"),
    (b'{"log_file":"x"}', 501, LOG_FILE_TEXT),
    (b'{"log_file":""}', 501, LOG_FILE_TEXT),
    (b'{"log_format":1,"log_file":"x"}', 501, LOG_FILE_TEXT),          # log_file first
    (b'{"log_info":1}', 500, NOT_BOOL),
    (b'{"log_warning":"false"}', 500, NOT_BOOL),
    (b'{"log_error":0}', 500, NOT_BOOL),
    (b'{"log_verbose_level":-1}', 500, NOT_UINT),
    (b'{"log_verbose_level":"1"}', 500, NOT_UINT),
    (b'{"log_verbose_level":1.5}', 500, NOT_UINT),
    (b'{"log_verbose_level":1.0}', 500, NOT_UINT),
    (b'{"log_verbose_level":true}', 500, NOT_UINT),
    (b'{"log_verbose_level":18446744073709551616}', 500, NOT_UINT),
    (b'{"log_format":1}', 500, NOT_STRING),
    (b'{"log_format":"iso8601"}', 503, "invalid argument for --log_format, got: iso8601"),
    (b'{"log_format":"a\\u0000b"}', 503, "invalid argument for --log_format, got: a"),
    # Triton applies log_info before it finds the bad level; here nothing changes
    (b'{"log_info":false,"log_verbose_level":"x"}', 500, NOT_UINT),
])
def test_post_errors_are_tritons(body, status, text):
    dp = LogDataPlane()
    assert post(dp, body) == (status, {"error": text})
    assert dp.calls == []


@pytest.mark.parametrize("value, level", [(4294967296, 0), (2147483648, 0),
                                          (18446744073709551615, 0), (4294967297, 1)])
def test_verbose_levels_past_int32_wrap_as_tritons(value, level):
    dp = LogDataPlane()
    status, doc = post(dp, {"log_verbose_level": value})
    assert status == 200 and doc["log_verbose_level"] == level


@pytest.mark.parametrize("method", ["PUT", "DELETE", "HEAD", "PATCH"])
def test_other_methods_are_405(method):
    assert ask(handlers(LogDataPlane()), method, "/v2/logging")[:2] == (
        405, b'{"error":"Method Not Allowed"}')


def test_body_over_the_limit():
    h = handlers(LogDataPlane())
    reply = asyncio.run(h.dispatch(Request("POST", "/v2/logging",
                                           too_large=BodyTooLarge(100))))
    assert reply.status == 400
    assert "request JSON size of 100 bytes exceeds the maximum allowed input size" in \
        json.loads(bytes(reply.body))["error"]


def test_restricted_logging_is_refused_first():
    dp = LogDataPlane()
    h = handlers(dp, restricted=Restrictions.parse(["logging:k=v"], ()))
    assert ask(h, "GET", "/v2/logging")[0] == 403
    assert ask(h, "GET", "/v2/logging", headers={"k": "v"})[0] == 200
    assert dp.calls == [{}]


def test_server_metadata_lists_logging_in_tritons_order():
    status, body, _ = ask(handlers(LogDataPlane()), "GET", "/v2")
    assert status == 200 and "logging" in json.loads(body)["extensions"]
    assert EXTENSIONS[-1] == "logging"      # last in Triton's list (after trace)


@pytest.mark.parametrize("impl", ["native", "aiohttp"])
def test_tritonclient_http_round_trip(impl):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    dp = LogDataPlane()
    with serving(impl, dp) as port:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert c.get_log_settings() == json.loads(TRITON_GET)
            got = c.update_log_settings({"log_verbose_level": 2, "log_format": "ISO8601"})
            assert (got["log_verbose_level"], got["log_format"]) == (2, "ISO8601")
            with pytest.raises(InferenceServerException) as info:
                c.update_log_settings({"log_file": "other.log"})
            assert LOG_FILE_TEXT in str(info.value)
            assert c.get_log_settings()["log_file"] == FILE
        finally:
            c.close()


# ---- gRPC ------------------------------------------------------------------------------------

def request(**settings: tuple[str | None, Any]) -> pb.LogSettingsRequest:
    """name=(oneof field or None for an empty value, value)."""
    req = pb.LogSettingsRequest()
    for name, (field, value) in settings.items():
        entry = req.settings[name]
        if field is not None:
            setattr(entry, field, value)
    return req


def as_dict(resp: pb.LogSettingsResponse) -> dict[str, Any]:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in resp.settings.items()}


def test_response_carries_each_setting_in_its_type():
    resp = settings_to_proto(m.LogConfig(log_file="f", log_verbose_level=7))
    assert {k: v.WhichOneof("parameter_choice") for k, v in resp.settings.items()} == {
        "log_file": "string_param", "log_info": "bool_param", "log_warning": "bool_param",
        "log_error": "bool_param", "log_verbose_level": "uint32_param",
        "log_format": "string_param"}
    assert as_dict(resp) == {"log_file": "f", "log_info": True, "log_warning": True,
                             "log_error": True, "log_verbose_level": 7, "log_format": "default"}


def test_update_from_proto():
    assert update_from_proto(pb.LogSettingsRequest()) == {}
    assert update_from_proto(request(log_info=("bool_param", False),
                                     log_verbose_level=("uint32_param", 4294967295),
                                     log_format=("string_param", "ISO8601"),
                                     bogus=("uint32_param", 1))) == {
        "log_info": False, "log_verbose_level": 0, "log_format": "ISO8601"}


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_log_settings_rpc(impl):
    dp = LogDataPlane()

    async def main():
        server = await start_grpc(dp, FrontendSettings(
            scheduler_addr="", host="127.0.0.1", grpc_port=0, grpc_impl=impl))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
                call = ch.unary_unary("/inference.GRPCInferenceService/LogSettings",
                                      request_serializer=pb.LogSettingsRequest.SerializeToString,
                                      response_deserializer=pb.LogSettingsResponse.FromString)

                async def fails(req):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(req)
                    return info.value.code(), info.value.details()

                assert as_dict(await call(pb.LogSettingsRequest())) == json.loads(TRITON_GET)
                invalid = grpc.StatusCode.INVALID_ARGUMENT
                # tritonserver 2.51's answers
                for req, answer in [
                    (request(log_file=("string_param", "x")),
                     (grpc.StatusCode.UNIMPLEMENTED, LOG_FILE_TEXT)),
                    (request(log_file=(None, None)), (grpc.StatusCode.UNIMPLEMENTED, LOG_FILE_TEXT)),
                    (request(log_file=("string_param", "")),
                     (grpc.StatusCode.UNIMPLEMENTED, LOG_FILE_TEXT)),
                    (request(log_info=(None, None)), (invalid, "expect boolean for 'log_info'")),
                    (request(log_warning=("string_param", "true")),
                     (invalid, "expect boolean for 'log_warning'")),
                    (request(log_error=("uint32_param", 0)),
                     (invalid, "expect boolean for 'log_error'")),
                    (request(log_verbose_level=("bool_param", True)),
                     (invalid, "expect int32 for 'log_verbose_level'")),
                    (request(log_format=("string_param", "iso8601")),
                     (invalid, "invalid argument for log_format, got: iso8601")),
                    (request(log_format=("uint32_param", 1)),
                     (invalid, "expect string for 'log_format'")),
                    (request(log_info=("bool_param", False), log_format=("string_param", "x")),
                     (invalid, "invalid argument for log_format, got: x")),
                ]:
                    assert await fails(req) == answer
                assert dp.calls == [{}]
                got = as_dict(await call(request(log_warning=("bool_param", False),
                                                 log_verbose_level=("uint32_param", 2),
                                                 bogus=("bool_param", True))))
                assert got == {**json.loads(TRITON_GET), "log_warning": False,
                               "log_verbose_level": 2}
                assert dp.calls[-1] == {"log_warning": False, "log_verbose_level": 2}
        finally:
            await server.stop(None)
    asyncio.run(main())
