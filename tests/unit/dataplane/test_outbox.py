"""The requests of one event-loop turn leave as one InferRequests message; when that message
cannot be encoded, each request goes alone and only those that cannot be encoded fail, each
with an error naming its field. Nothing one request carries fails the requests it travels
with. Over Unix sockets to a fake scheduler."""
from __future__ import annotations

import asyncio
import struct

import pytest

from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.dataplane.types import CoreRequest, InputTensor
from tests.unit.dataplane.fake_scheduler import plane, until

HUGE = 18446744073709551616          # 2**64: msgpack holds [-2**63, 2**64 - 1]


def _request(i: int, n: int = 2, **parameters) -> CoreRequest:
    data = struct.pack(f"<{n}f", *(float(i * 10 + k) for k in range(n)))
    return CoreRequest("m", inputs=[InputTensor("X", "FP32", [n], data)], parameters=parameters)


def _deep(depth: int) -> list:
    """A nested list deeper than the msgpack encoder goes (every int in it fits)."""
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


def _answer(sched, req: m.InferRequest) -> None:
    sched.send(m.InferResult(req.req_id, 1))


def _check_frames(received) -> None:
    """Each request's input frame, looked up by its index in the message it came in, holds
    that request's own data (the tag in its parameters)."""
    for req, frames in received:
        (ref,) = req.inputs
        first = struct.unpack_from("<f", frames[ref.frame])[0]
        assert first == req.parameters["tag"] * 10, (req, first)


def test_a_turn_of_well_formed_requests_is_one_message(tmp_path):
    async def run():
        async with plane(tmp_path) as (sched, dp):
            await dp.model_metadata("m", "")       # model info cached: one turn, no awaits
            calls = [asyncio.ensure_future(dp.infer(_request(i, 1 + i % 3, tag=i)))
                     for i in range(6)]
            received = await until(lambda: len(sched.requests()) == 6 and sched.requests())
            assert len(sched.of(m.InferRequests)) == 1 and not sched.of(m.InferRequest)
            _check_frames(received)
            for req, _ in received:
                _answer(sched, req)
            await asyncio.gather(*calls)

    asyncio.run(run())


def test_an_unencodable_request_fails_alone(tmp_path):
    """A parameter that passes validation but not msgpack (nesting deeper than the encoder
    goes) among good requests of the same turn: the good ones reach the scheduler with
    their own data, the bad one is answered 400 naming its parameter."""
    async def run():
        async with plane(tmp_path) as (sched, dp):
            await dp.model_metadata("m", "")
            good = [asyncio.ensure_future(dp.infer(_request(i, 1 + i % 3, tag=i)))
                    for i in range(4)]
            bad = asyncio.ensure_future(dp.infer(_request(9, tag=9, nested=_deep(100_000))))
            good += [asyncio.ensure_future(dp.infer(_request(i, 2, tag=i))) for i in (4, 5)]
            with pytest.raises(TriremeError) as e:
                await bad
            assert e.value.code == Code.INVALID_ARG
            assert "parameter 'nested'" in e.value.message
            received = await until(lambda: len(sched.requests()) == 6 and sched.requests())
            assert sorted(r.parameters["tag"] for r, _ in received) == [0, 1, 2, 3, 4, 5]
            _check_frames(received)
            for req, _ in received:
                _answer(sched, req)
            assert all(r.outputs == [] for r in await asyncio.gather(*good))
            assert not dp._pending

    asyncio.run(run())


def test_every_unencodable_request_of_a_turn_fails_and_only_those(tmp_path):
    async def run():
        async with plane(tmp_path) as (sched, dp):
            await dp.model_metadata("m", "")
            calls = [asyncio.ensure_future(dp.infer(
                _request(i, 2, tag=i, nested=_deep(100_000)) if i % 2 else _request(i, 2, tag=i)))
                for i in range(10)]
            received = await until(lambda: len(sched.requests()) == 5 and sched.requests())
            assert sorted(r.parameters["tag"] for r, _ in received) == [0, 2, 4, 6, 8]
            _check_frames(received)
            for req, _ in received:
                _answer(sched, req)
            results = await asyncio.gather(*calls, return_exceptions=True)
            for i, r in enumerate(results):
                if i % 2:
                    assert isinstance(r, TriremeError) and r.code == Code.INVALID_ARG, r
                else:
                    assert not isinstance(r, BaseException), r

    asyncio.run(run())


def test_a_lone_unencodable_request_fails(tmp_path):
    async def run():
        async with plane(tmp_path) as (sched, dp):
            with pytest.raises(TriremeError) as e:
                await dp.infer(_request(1, nested=_deep(100_000)))
            assert e.value.code == Code.INVALID_ARG and "'nested'" in e.value.message
            assert not sched.requests() and not dp._pending

    asyncio.run(run())


def test_a_stream_request_that_cannot_be_encoded_gets_its_final_error(tmp_path):
    async def run():
        async with plane(tmp_path) as (sched, dp):
            stream = dp.infer_stream(_request(1, nested=_deep(100_000)))
            with pytest.raises(TriremeError) as e:
                await stream.__anext__()
            assert e.value.code == Code.INVALID_ARG
            assert not dp._pending and not dp._inflight

    asyncio.run(run())


@pytest.mark.parametrize("params, name", [
    ({"timeout": HUGE}, "timeout"),
    ({"priority": -(1 << 63) - 1}, "priority"),
    ({"ok": 1, "list": [1, [2, HUGE]]}, "list"),
    ({"obj": {"k": {"deeper": -HUGE}}}, "obj"),
])
def test_an_integer_beyond_64_bits_is_refused_before_it_is_queued(tmp_path, params, name):
    async def run():
        async with plane(tmp_path) as (sched, dp):
            await dp.model_metadata("m", "")
            good = asyncio.ensure_future(dp.infer(_request(0, tag=0)))
            with pytest.raises(TriremeError) as e:
                await dp.infer(_request(1, **params))
            assert e.value.code == Code.INVALID_ARG
            assert e.value.message.startswith(f"parameter '{name}' is out of range")
            (req, _), = await until(sched.requests)
            assert req.parameters == {"tag": 0}
            _answer(sched, req)
            await good

    asyncio.run(run())


@pytest.mark.parametrize("value", [(1 << 64) - 1, -(1 << 63), 0, True, 1.5, "s", None,
                                   [1, {"a": (1 << 64) - 1}]])
def test_values_within_64_bits_cross(tmp_path, value):
    async def run():
        async with plane(tmp_path) as (sched, dp):
            call = asyncio.ensure_future(dp.infer(_request(0, p=value)))
            (req, _), = await until(sched.requests)
            assert req.parameters == {"p": value}
            _answer(sched, req)
            await call

    asyncio.run(run())


def test_a_shape_dimension_beyond_int64_is_refused(tmp_path):
    """A zero-sized tensor passes the byte-size check whatever its other dimensions are."""
    async def run():
        async with plane(tmp_path) as (sched, dp):
            req = CoreRequest("m", inputs=[InputTensor("X", "FP32", [0, HUGE], b"")])
            with pytest.raises(TriremeError) as e:
                await dp.infer(req)
            assert e.value.code == Code.INVALID_ARG and "input 'X'" in e.value.message

    asyncio.run(run())


def test_an_unencodable_field_the_validation_does_not_know_is_named(tmp_path, monkeypatch):
    """The net under validation: a shape that reached the outbox anyway is named too."""
    import services.dataplane.client as client

    async def run():
        async with plane(tmp_path) as (sched, dp):
            await dp.model_metadata("m", "")
            monkeypatch.setattr(client, "validate_infer", lambda info, req: 1)
            good = asyncio.ensure_future(dp.infer(_request(0, tag=0)))
            with pytest.raises(TriremeError) as e:
                await dp.infer(CoreRequest("m", inputs=[InputTensor("X", "FP32", [0, HUGE], b"")]))
            assert e.value.code == Code.INVALID_ARG and "input 'X'" in e.value.message
            (req, _), = await until(sched.requests)
            _answer(sched, req)
            await good

    asyncio.run(run())
