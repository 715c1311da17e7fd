"""Triton's trace extension in the adapters: GET/POST /v2/trace/setting and
/v2/models/{m}/trace/setting, and the TraceSetting RPC, over a data plane whose scheduler
side is the real settings store (services/scheduler/trace_settings.py) in memory; then over
the real servers with tritonclient.

HTTP_CASES and GRPC_CASES are what tritonserver 2.51 answered to the same requests, in the
same order, from the same start (src/http_server.cc HandleTrace, src/grpc/grpc_server.cc
RegisterTrace, src/tracer.cc UpdateTraceSetting). Two answers differ on purpose, noted where
they are checked: every Trireme 404 is JSON (Triton's says text/plain), and rapidjson's
words for one malformed body.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from protos import grpc_service_pb2 as pb
from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.common.trace import TIMESTAMPS
from services.frontend.grpc.methods import GrpcService, grpc_status, start_grpc
from services.frontend.grpc.trace_methods import update_from_proto
from services.frontend.http.message import BodyTooLarge
from services.frontend.http.trace_routes import decode_update, encode_settings
from services.frontend.restricted import Restrictions
from services.frontend.settings import EXTENSIONS, FrontendSettings
from services.scheduler.trace_config import TraceConfig
from services.scheduler.trace_settings import TraceManager
from tests.unit.frontend.test_shm_routes import Request, ask, handlers, serving

FILE = "/tmp/tt/trace.json"   # never written: nothing is traced here


def ok(level: str, rate: str, count: str, log_frequency: str) -> tuple[int, dict]:
    """A 200 answer as Triton writes it (the keys in its order)."""
    return 200, {"trace_level": level.split("+"), "trace_rate": rate, "trace_count": count,
                 "log_frequency": log_frequency, "trace_file": FILE, "trace_mode": "triton"}


class TraceDataPlane:
    """A data plane whose scheduler is a TraceManager in this process; each request and
    answer goes through the message encoding, as between the processes."""

    trace_on = False

    def __init__(self, config: TraceConfig | None = None, models: tuple[str, ...] = ("add_sub",)):
        self.manager = TraceManager(config or TraceConfig(level=TIMESTAMPS, rate=1, file=FILE),
                                    lambda identity, msg: None, lambda: [], b"steps")
        self.models = set(models)
        self.requests: list[m.TraceSettingsRequest] = []

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def trace_level(self, model: str) -> int:
        return 0

    async def trace_settings(self, model: str = "", update: m.TraceUpdate | None = None,
                             error: m.ErrorRecord | None = None) -> list[tuple[str, list[str]]]:
        req, _ = m.decode(m.encode(m.TraceSettingsRequest(1, model, update, error)))
        assert isinstance(req, m.TraceSettingsRequest)
        self.requests.append(req)
        reply, _ = m.decode(m.encode(self.manager.answer(req, model in self.models)))
        assert isinstance(reply, m.TraceSettings)
        if reply.error is not None:
            raise TriremeError(reply.error.code, reply.error.message)
        return [(k, list(v)) for k, v in reply.settings]


def http(dp: TraceDataPlane, method: str, path: str, body: str | None) -> tuple[int, Any]:
    status, payload, content_type = ask(handlers(dp), method, path,
                                        b"" if body is None else body.encode())
    assert content_type == "application/json"
    doc = json.loads(payload)
    return status, doc if status == 200 else doc["error"]


def grpc_call(dp: TraceDataPlane, model: str, settings: dict[str, list[str]]) -> tuple[Any, Any]:
    req = pb.TraceSettingRequest(model_name=model)
    for key, values in settings.items():
        req.settings[key].value.extend(values)
    service = GrpcService(dp, FrontendSettings(scheduler_addr=""))  # type: ignore[arg-type]
    try:
        resp = asyncio.run(service.trace_rpcs.TraceSetting(req, None))
    except TriremeError as e:
        return grpc_status(e.code).name, e.message
    got = {k: list(v.value) for k, v in resp.settings.items()}
    return 200, {**got, "trace_level": got["trace_level"],
                 **{k: v[0] for k, v in got.items() if k != "trace_level"}}


HTTP_CASES = [
    ('GET', '/v2/trace/setting', None, ok('TIMESTAMPS', '1', '-1', '1')),
    ('PUT', '/v2/trace/setting', None, (405, 'Method Not Allowed')),
    ('DELETE', '/v2/models/add_sub/trace/setting', None, (405, 'Method Not Allowed')),
    ('GET', '/v2/models/add_sub/trace/setting', None, ok('TIMESTAMPS', '1', '-1', '1')),
    ('GET', '/v2/models/nope/trace/setting', None, (400, 'Request for unknown model : nope')),
    ('POST', '/v2/models/nope/trace/setting', '{"trace_rate":"5"}',
     (400, 'Request for unknown model : nope')),
    ('GET', '/v2/models/add_sub/versions/1/trace/setting', None, (404, 'Not Found')),
    ('GET', '/v2/trace/setting/', None, (404, 'Not Found')),
    ('POST', '/v2/trace/setting', '',
     (500, 'failed to parse the request JSON buffer: The document is empty. at 0')),
    ('POST', '/v2/trace/setting', '{}', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', '[]', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', 'null', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', '{bad',
     (500, 'failed to parse the request JSON buffer: Missing a name for object member. at 1')),
    ('POST', '/v2/trace/setting', '{"trace_file":"x"}',
     (501, 'trace file location can not be updated through network protocol')),
    ('POST', '/v2/trace/setting', '{"trace_file":null}',
     (501, 'trace file location can not be updated through network protocol')),
    ('POST', '/v2/trace/setting', '{"trace_level":"TIMESTAMPS"}',
     (500, 'attempt to access JSON non-array as array')),
    ('POST', '/v2/trace/setting', '{"trace_level":[1]}',
     (500, 'attempt to access JSON non-string as string')),
    ('POST', '/v2/trace/setting', '{"trace_level":["OFF","TIMESTAMPS"]}',
     (400, "Expect only one trace level 'OFF' is specified")),
    ('POST', '/v2/trace/setting', '{"trace_level":["TIMESTAMPS","OFF"]}',
     (400, "Expect only one trace level 'OFF' is specified")),
    ('POST', '/v2/trace/setting', '{"trace_level":["BOGUS"]}', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', '{"trace_level":[]}', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', '{"trace_rate":5}',
     (500, 'attempt to access JSON non-string as string')),
    ('POST', '/v2/trace/setting', '{"trace_rate":"abc"}',
     (400, "Unable to parse 'trace_rate', got: abc")),
    ('POST', '/v2/trace/setting', '{"trace_rate":"99999999999"}',
     (400, "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], got: 99999999999")),
    ('POST', '/v2/trace/setting', '{"trace_rate":"-1"}', ok('TIMESTAMPS', '4294967295', '-1', '1')),
    ('POST', '/v2/trace/setting', '{"trace_rate":" 12abc"}', ok('TIMESTAMPS', '12', '-1', '1')),
    ('POST', '/v2/trace/setting', '{"trace_rate":"0"}',
     (400, 'Attempting to set invalid trace setting :sample rate must be non-zero')),
    ('POST', '/v2/trace/setting', '{"trace_rate":"1"}', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', '{"trace_count":"-2"}',
     (400, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2")),
    ('POST', '/v2/trace/setting', '{"trace_count":"x"}', (400, "Unable to parse 'trace_count', got: x")),
    ('POST', '/v2/trace/setting', '{"trace_count":"3000000000"}',
     (400, "Unable to parse 'trace_count', value is out of range [ -1, 2147483647 ], got: 3000000000")),
    ('POST', '/v2/trace/setting', '{"trace_count":"0"}',
     (400, 'Attempting to set invalid trace setting :')),
    ('POST', '/v2/trace/setting', '{"trace_count":"-1"}', ok('TIMESTAMPS', '1', '-1', '1')),
    ('POST', '/v2/trace/setting', '{"log_frequency":"x"}',
     (400, "Unable to parse 'log_frequency', got: x")),
    ('POST', '/v2/trace/setting', '{"log_frequency":"99999999999"}',
     (400, "Unable to parse 'log_frequency', value is out of range [ 0, 4294967295 ], got: 99999999999")),
    ('POST', '/v2/trace/setting', '{"log_frequency":"-3"}', ok('TIMESTAMPS', '1', '-1', '4294967293')),
    ('POST', '/v2/trace/setting', '{"log_frequency":"0"}', ok('TIMESTAMPS', '1', '-1', '0')),
    ('POST', '/v2/trace/setting', '{"trace_rate":"abc","trace_count":"x"}',
     (400, "Unable to parse 'trace_rate', got: abc")),
    ('POST', '/v2/trace/setting', '{"trace_level":["OFF"],"trace_rate":"0"}', ok('OFF', '0', '-1', '0')),
    ('POST', '/v2/trace/setting', '{"trace_level":["TIMESTAMPS"],"trace_rate":"0"}',
     (400, 'Attempting to set invalid trace setting :sample rate must be non-zero')),
    ('POST', '/v2/trace/setting', '{"trace_level":["TIMESTAMPS"],"trace_rate":"1"}',
     ok('TIMESTAMPS', '1', '-1', '0')),
    ('POST', '/v2/trace/setting',
     '{"trace_level":null,"trace_rate":null,"trace_count":null,"log_frequency":null}',
     ok('TIMESTAMPS', '1', '-1', '0')),
    ('POST', '/v2/trace/setting', '{"trace_level":["TIMESTAMPS","TENSORS"]}',
     ok('TIMESTAMPS+TENSORS', '1', '-1', '0')),
    ('POST', '/v2/models/add_sub/trace/setting', '{"trace_rate":"7"}',
     ok('TIMESTAMPS+TENSORS', '7', '-1', '0')),
    ('GET', '/v2/models/add_sub/trace/setting', None, ok('TIMESTAMPS+TENSORS', '7', '-1', '0')),
    ('POST', '/v2/trace/setting', '{"trace_rate":"3","trace_count":"10"}',
     ok('TIMESTAMPS+TENSORS', '3', '10', '0')),
    ('GET', '/v2/models/add_sub/trace/setting', None, ok('TIMESTAMPS+TENSORS', '7', '10', '0')),
    ('POST', '/v2/models/add_sub/trace/setting', '{"trace_rate":null}',
     ok('TIMESTAMPS+TENSORS', '3', '10', '0')),
    ('GET', '/v2/models/add_sub/trace/setting', None, ok('TIMESTAMPS+TENSORS', '3', '10', '0')),
    ('POST', '/v2/models/add_sub/trace/setting', '{"trace_level":["OFF"]}', ok('OFF', '3', '10', '0')),
    ('POST', '/v2/trace/setting', '{"trace_level":["TIMESTAMPS"]}', ok('TIMESTAMPS', '3', '10', '0')),
    ('GET', '/v2/models/add_sub/trace/setting', None, ok('OFF', '3', '10', '0')),
    ('POST', '/v2/models/add_sub/trace/setting', '{"trace_level":null, "trace_unknown":"1"}',
     ok('TIMESTAMPS', '3', '10', '0')),
    ('GET', '/v2/models/add_sub/trace/setting', None, ok('TIMESTAMPS', '3', '10', '0')),
    ('POST', '/v2/trace/setting', '{"trace_level":["OFF"],"trace_rate":"1000","trace_count":"-1"}',
     ok('OFF', '1000', '-1', '0')),
]
GRPC_CASES = [
    ('', {}, ok('OFF', '1000', '-1', '0')),
    ('add_sub', {}, ok('OFF', '1000', '-1', '0')),
    ('nope', {}, ('INVALID_ARGUMENT', 'Request for unknown model : nope')),
    ('nope', {'trace_rate': ['5']}, ('INVALID_ARGUMENT', 'Request for unknown model : nope')),
    ('', {'trace_file': ['x']},
     ('UNIMPLEMENTED', 'trace file location can not be updated through network protocol')),
    ('', {'trace_file': []},
     ('UNIMPLEMENTED', 'trace file location can not be updated through network protocol')),
    ('', {'trace_level': ['OFF', 'TIMESTAMPS']},
     ('INVALID_ARGUMENT', "Expect only one trace level 'OFF' is specified")),
    ('', {'trace_level': ['BOGUS']}, ok('OFF', '1000', '-1', '0')),
    ('', {'trace_level': ['TIMESTAMPS']}, ok('TIMESTAMPS', '1000', '-1', '0')),
    ('', {'trace_rate': ['a']}, ('INVALID_ARGUMENT', "Unable to parse 'trace_rate', got: a")),
    ('', {'trace_rate': ['1', '2']}, ('INVALID_ARGUMENT', "expect only 1 value for 'trace_rate'")),
    ('', {'trace_rate': ['99999999999']},
     ('INVALID_ARGUMENT', "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], "
                          "got: 99999999999")),
    ('', {'trace_rate': ['-1']}, ok('TIMESTAMPS', '4294967295', '-1', '0')),
    ('', {'trace_rate': ['0']},
     ('INVALID_ARGUMENT', 'Attempting to set invalid trace setting :sample rate must be non-zero')),
    ('', {'trace_rate': ['1']}, ok('TIMESTAMPS', '1', '-1', '0')),
    ('', {'trace_count': ['-2']},
     ('INVALID_ARGUMENT', "Unable to parse 'trace_count'. Expecting value >= -1, got: -2")),
    ('', {'trace_count': ['x']}, ('INVALID_ARGUMENT', "Unable to parse 'trace_count', got: x")),
    ('', {'trace_count': ['3000000000']},
     ('INVALID_ARGUMENT', "Unable to parse 'trace_count', value is out of range [ -1, 2147483647 ], "
                          "got: 3000000000")),
    ('', {'trace_count': ['0']}, ('INVALID_ARGUMENT', 'Attempting to set invalid trace setting :')),
    ('', {'trace_count': ['1', '2']}, ('INVALID_ARGUMENT', "expect only 1 value for 'trace_count'")),
    ('', {'trace_count': ['-1']}, ok('TIMESTAMPS', '1', '-1', '0')),
    ('', {'log_frequency': ['x']}, ('INVALID_ARGUMENT', "Unable to parse 'log_frequency', got: x")),
    ('', {'log_frequency': ['1', '2']}, ('INVALID_ARGUMENT', "expect only 1 value for 'log_frequency'")),
    ('', {'log_frequency': ['99999999999']},
     ('INVALID_ARGUMENT', "Unable to parse 'log_frequency', value is out of range [ 0, 4294967295 ], "
                          "got: 99999999999")),
    ('', {'log_frequency': ['5']}, ok('TIMESTAMPS', '1', '-1', '5')),
    ('', {'trace_rate': [], 'trace_level': [], 'trace_count': [], 'log_frequency': []},
     ok('TIMESTAMPS', '1', '-1', '0')),
    ('add_sub', {'trace_rate': ['7']}, ok('TIMESTAMPS', '7', '-1', '0')),
    ('add_sub', {}, ok('TIMESTAMPS', '7', '-1', '0')),
    ('', {'trace_count': ['10']}, ok('TIMESTAMPS', '1', '10', '0')),
    ('add_sub', {}, ok('TIMESTAMPS', '7', '10', '0')),
    ('add_sub', {'trace_rate': []}, ok('TIMESTAMPS', '1', '10', '0')),
    ('add_sub', {}, ok('TIMESTAMPS', '1', '10', '0')),
    ('add_sub', {'trace_rate': ['2'], 'trace_level': [], 'trace_count': ['3'], 'log_frequency': ['4']},
     ok('TIMESTAMPS', '2', '3', '4')),
    ('add_sub', {'trace_level': ['OFF']}, ok('OFF', '2', '3', '4')),
    ('add_sub', {'trace_rate': [], 'trace_level': [], 'trace_count': [], 'log_frequency': []},
     ok('TIMESTAMPS', '1', '10', '0')),
    ('', {'trace_rate': ['1000'], 'trace_level': ['OFF'], 'trace_count': ['-1'], 'log_frequency': ['0']},
     ok('OFF', '1000', '-1', '0')),
    ('', {'unknown': ['1']}, ok('OFF', '1000', '-1', '0')),
]


# ---- Triton's answers, request by request ------------------------------------------------------

def test_http_answers_are_tritons():
    dp = TraceDataPlane()
    assert http(dp, "POST", "/v2/trace/setting", '{"log_frequency":"1"}')[0] == 200
    for method, path, body, answer in HTTP_CASES:
        got = http(dp, method, path, body)
        assert got == answer, (method, path, body)


def test_grpc_answers_are_tritons():
    dp = TraceDataPlane()
    for method, path, body, _ in [("POST", "/v2/trace/setting", '{"log_frequency":"1"}', None),
                                  *HTTP_CASES]:
        http(dp, method, path, body)        # the state the gRPC calls started from
    for model, settings, answer in GRPC_CASES:
        assert grpc_call(dp, model, settings) == answer, (model, settings)


def test_http_answer_bytes_are_tritons():
    status, body, _ = ask(handlers(TraceDataPlane()), "GET", "/v2/trace/setting")
    assert (status, body) == (200, b'{"trace_level":["TIMESTAMPS"],"trace_rate":"1",'
                                   b'"trace_count":"-1","log_frequency":"0",'
                                   b'"trace_file":"/tmp/tt/trace.json","trace_mode":"triton"}')


def test_the_model_is_checked_before_the_body():
    dp = TraceDataPlane()
    for body in ("", "{bad", '{"trace_file":"x"}', '{"trace_rate":"x"}'):
        assert http(dp, "POST", "/v2/models/other/trace/setting", body) == (
            400, "Request for unknown model : other")
    assert grpc_call(dp, "other", {"trace_file": ["x"]}) == (
        "INVALID_ARGUMENT", "Request for unknown model : other")
    # the request's own error travels with it and is answered after the model check
    assert dp.requests[-1].error == m.ErrorRecord(
        int(Code.UNSUPPORTED), "trace file location can not be updated through network protocol")


def test_body_over_the_limit_is_answered_after_the_model_check():
    h = handlers(TraceDataPlane(), http_max_input_size=8)
    reply = asyncio.run(h.dispatch(Request("POST", "/v2/trace/setting", b"",
                                           too_large=BodyTooLarge(100))))
    assert reply.status == 400 and b"exceeds the maximum allowed input size of 8" in reply.body
    reply = asyncio.run(h.dispatch(Request("POST", "/v2/models/x/trace/setting", b"",
                                           too_large=BodyTooLarge(100))))
    assert (reply.status, json.loads(reply.body)) == (
        400, {"error": "Request for unknown model : x"})


def test_restricted_trace_is_refused_first():
    h = handlers(TraceDataPlane(), restricted=Restrictions.parse(["trace:k=v"], []))
    for path in ("/v2/trace/setting", "/v2/models/add_sub/trace/setting"):
        status, body, _ = ask(h, "GET", path)
        assert status == 403 and b"This API is restricted" in body


def test_server_metadata_lists_trace_in_tritons_order():
    assert EXTENSIONS.index("trace") == EXTENSIONS.index("logging") - 1
    assert EXTENSIONS.index("trace") == EXTENSIONS.index("statistics") + 1


# ---- the parsers alone ---------------------------------------------------------------------------

def test_decode_update():
    assert decode_update(b"[]") == m.TraceUpdate()
    assert decode_update(b'{"trace_level":["TENSORS","TIMESTAMPS","X"],"trace_rate":"+5",'
                         b'"trace_count":null,"log_frequency":"\\t7 frames"}') == m.TraceUpdate(
        {"level": 12, "rate": 5, "log_frequency": 7}, ["count"])
    assert decode_update(b'{"trace_level":["OFF"]}') == m.TraceUpdate({"level": 0})
    # a NUL ends Triton's text (its c_str())
    with pytest.raises(TriremeError) as info:
        decode_update(b'{"trace_rate":"x\\u0000y"}')
    assert info.value.message == "Unable to parse 'trace_rate', got: x"


def test_update_from_proto():
    assert update_from_proto(pb.TraceSettingRequest()) is None
    req = pb.TraceSettingRequest()
    req.settings["trace_level"].value.extend(["TIMESTAMPS"])
    req.settings["trace_count"]    # no value: clear
    req.settings["bogus"].value.extend(["1"])
    assert update_from_proto(req) == m.TraceUpdate({"level": TIMESTAMPS}, ["count"])


def test_encode_settings_repeats_a_key_per_value():
    assert encode_settings([("trace_level", ["OFF"]), ("trace_rate", ["1"]),
                            ("resource", ["a=1", "b=2"])]) == (
        b'{"trace_level":["OFF"],"trace_rate":"1","resource":"a=1","resource":"b=2"}')


# ---- over the real servers --------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["native", "aiohttp"])
def test_tritonclient_http_round_trip(impl):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    dp = TraceDataPlane()
    with serving(impl, dp) as port:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert c.get_trace_settings() == ok("TIMESTAMPS", "1", "-1", "0")[1]
            got = c.update_trace_settings(model_name="add_sub",
                                          settings={"trace_rate": "4", "trace_count": "2"})
            assert got == ok("TIMESTAMPS", "4", "2", "0")[1]
            assert c.get_trace_settings()["trace_rate"] == "1"
            got = c.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
            assert (got["trace_rate"], got["trace_count"]) == ("1", "2")
            with pytest.raises(InferenceServerException) as info:
                c.get_trace_settings(model_name="does-not-exist")
            assert "Request for unknown model : does-not-exist" in str(info.value)
        finally:
            c.close()


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_tritonclient_grpc_round_trip(impl):
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException

    dp = TraceDataPlane()

    async def main():
        server = await start_grpc(dp, FrontendSettings(  # type: ignore[arg-type]
            scheduler_addr="", host="127.0.0.1", grpc_port=0, grpc_impl=impl))
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.trireme_port}")
        try:
            got = await c.get_trace_settings(as_json=True)
            assert got["settings"]["trace_rate"] == {"value": ["1"]}
            got = await c.update_trace_settings(
                model_name="add_sub", settings={"trace_level": ["TENSORS"], "log_frequency": "3"},
                as_json=True)
            assert got["settings"]["trace_level"] == {"value": ["TENSORS"]}
            assert got["settings"]["log_frequency"] == {"value": ["3"]}
            got = await c.update_trace_settings(model_name="add_sub",
                                                settings={"trace_level": None}, as_json=True)
            assert got["settings"]["trace_level"] == {"value": ["TIMESTAMPS"]}
            with pytest.raises(InferenceServerException) as info:
                await c.update_trace_settings(settings={"trace_rate": ["1", "2"]})
            assert "expect only 1 value for 'trace_rate'" in str(info.value)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        finally:
            await c.close()
            await server.stop(1.0)
    asyncio.run(main())
