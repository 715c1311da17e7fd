"""Triton's trace extension, the frontend's half that both protocols share: the checks of
an update's values in Triton's words, and the wrapper that traces an inference handler.

The wrapper makes a services.common.trace.RequestTrace for a request whose model may be
traced (the scheduler's TraceLevels, through ``dp.trace_level``) and runs the handler
with it in trace.CURRENT, where the data plane finds it; once the handler has its answer
it stamps the send and writes the trace on the next loop turn, after the server has
written the answer (HTTP_SEND_END / GRPC_SEND_END). A request whose model is not traced
goes straight to the handler: one attribute test.

Where our times differ from Triton's: the request has been read in full before a handler
runs, so HTTP_RECV_START / GRPC_WAITREAD_START is when the handler starts, and
HTTP_RECV_END / GRPC_WAITREAD_END when the body is decoded and the request leaves for
the scheduler (Triton's gRPC WAITREAD_START is when its handler began waiting for a
request); REQUEST_END is when the answer is encoded.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common import messages as m
from services.common.errors import Code, TriremeError, invalid_arg
from services.common.trace import CURRENT, TENSORS, TIMESTAMPS, RequestTrace, stoi, valid_traceparent
from services.dataplane.api import DataPlaneAPI

__all__ = ["FILE_TEXT", "OFF_ALONE_TEXT", "error_record", "level_bits", "parse_count",
           "parse_uint", "runner", "supports_tracing", "trace_headers", "unsupported_file"]

R = TypeVar("R")

# HandleTrace (http_server.cc) and CommonHandler::RegisterTrace (grpc_server.cc)
FILE_TEXT = "trace file location can not be updated through network protocol"   # UNSUPPORTED
OFF_ALONE_TEXT = "Expect only one trace level 'OFF' is specified"                  # INVALID_ARG
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1


def error_record(e: TriremeError) -> m.ErrorRecord:
    return m.ErrorRecord(int(e.code), e.message)


def level_bits(names: list[Any], check: Callable[[Any], str] = str) -> int | None:
    """A trace_level list -> Triton's level bits: OFF alone is 0; TIMESTAMPS and TENSORS
    add up; other names count for nothing; None when nothing was named (no change).
    ``check(name)`` runs on each name as the loop reaches it (HTTP: is it a string)."""
    level: int | None = None
    for value in names:
        name = check(value)
        if name == "OFF":
            if len(names) != 1:
                raise invalid_arg(OFF_ALONE_TEXT)
            level = 0
        elif name == "TIMESTAMPS":
            level = (level or 0) | TIMESTAMPS
        elif name == "TENSORS":
            level = (level or 0) | TENSORS
    return level


def _cut(text: str) -> str:
    return text.partition("\0")[0]   # Triton's texts end where its c_str() does


def parse_uint(name: str, text: str) -> int:
    """trace_rate and log_frequency: std::stoi, stored into a uint32 (so "-1" is
    4294967295, as in Triton)."""
    try:
        return stoi(text) & _UINT32_MAX
    except OverflowError:
        raise invalid_arg(_cut(f"Unable to parse '{name}', value is out of range [ 0, "
                               f"{_UINT32_MAX} ], got: {text}")) from None
    except ValueError:
        raise invalid_arg(_cut(f"Unable to parse '{name}', got: {text}")) from None


def parse_count(text: str, grpc: bool) -> int:
    """trace_count: std::stoi, at least -1 (the gRPC text has a space the HTTP one has not)."""
    try:
        count = stoi(text)
    except OverflowError:
        raise invalid_arg(_cut(f"Unable to parse 'trace_count', value is out of range [ -1, "
                               f"{_INT32_MAX} ], got: {text}")) from None
    except ValueError:
        raise invalid_arg(_cut(f"Unable to parse 'trace_count', got: {text}")) from None
    if count < -1:
        raise invalid_arg(_cut(f"Unable to parse 'trace_count'. Expecting value >= -1, "
                               f"got:{' ' if grpc else ''}{text}"))
    return count


# ---- tracing an inference handler ---------------------------------------------------------

def runner(handler: Callable[..., Awaitable[R]], protocol: str, dp: DataPlaneAPI,
           carrier: Callable[..., dict[str, str]]) -> Callable[..., Awaitable[R]]:
    """``handler`` (an inference handler of ``protocol``, "HTTP" or "GRPC") run for a
    request that may be traced: with its RequestTrace in CURRENT. The protocol modules call
    it only when ``dp.trace_on`` and ``dp.trace_level(model)`` say so (their wrappers take
    the handler's own parameters: a request not traced costs one call and one test).
    ``carrier(*args)``: the request's W3C trace context headers, read in mode
    opentelemetry (a valid one makes the request traced whatever the rate, as in Triton)."""
    async def run(*args: Any) -> R:
        ctx = RequestTrace(protocol)
        if dp.trace_mode == "opentelemetry":
            headers = carrier(*args)
            if valid_traceparent(headers.get("traceparent")):
                ctx.carrier = headers
        token = CURRENT.set(ctx)
        try:
            answer = await handler(*args)
        except Exception:              # answered with an error: still a trace, if sampled
            _answered(ctx)
            raise
        except BaseException:          # the caller went away: no answer goes out
            ctx.finish()
            raise
        finally:
            CURRENT.reset(token)
        _answered(ctx)
        return answer
    return run


def trace_headers(get: Callable[[str], Any]) -> dict[str, str]:
    """traceparent and tracestate from a request's headers or metadata (``get(name)``)."""
    out = {}
    for name in ("traceparent", "tracestate"):
        value = get(name)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if value:
            out[name] = value
    return out


def supports_tracing(dp: DataPlaneAPI) -> bool:
    """A data plane without the trace extension (a test's fake) gets the plain handlers."""
    return hasattr(dp, "trace_level")


def _answered(ctx: RequestTrace) -> None:
    if ctx.head:   # sampled: REQUEST_END and SEND_START now, SEND_END once it is written
        ctx.replied()
        asyncio.get_running_loop().call_soon(ctx.finish)


def unsupported_file() -> TriremeError:
    return TriremeError(Code.UNSUPPORTED, FILE_TEXT)
