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
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common import messages as m
from services.common.errors import Code, TriremeError, invalid_arg
from services.common.trace import (
    COMPUTE_NAMES,
    CURRENT,
    QUEUE_START,
    TENSORS,
    TIMESTAMPS,
    TRACE_ID,
    TRACE_LEVEL,
    RequestTrace,
    model_object,
    stoi,
    timestamp,
    valid_traceparent,
)
from services.dataplane.api import DataPlaneAPI

__all__ = ["CURRENT", "FILE_TEXT", "OFF_ALONE_TEXT", "StreamTrace", "error_record", "level_bits",
           "parse_count", "parse_uint", "runner", "sent", "stream_runner", "supports_tracing",
           "trace_headers", "TracedChunks", "unsupported_file", "valid_traceparent"]

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
           carrier: Callable[..., dict[str, str]],
           kind: type[RequestTrace] = RequestTrace) -> Callable[..., Awaitable[R]]:
    """``handler`` (an inference handler of ``protocol``, "HTTP" or "GRPC") run for a
    request that may be traced: with its RequestTrace in CURRENT. The protocol modules call
    it only when ``dp.trace_on`` and ``dp.trace_level(model)`` say so (their wrappers take
    the handler's own parameters: a request not traced costs one call and one test).
    ``carrier(*args)``: the request's W3C trace context headers, read in mode
    opentelemetry (a valid one makes the request traced whatever the rate, as in Triton)."""
    async def run(*args: Any) -> R:
        ctx = kind(protocol)
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


# ---- a request with a stream of responses: gRPC ModelStreamInfer, HTTP generate -------------

class StreamTrace(RequestTrace):
    """A request whose responses are written one by one: each of a ModelStreamInfer stream
    (protocol "GRPC") and a generate or generate_stream request (protocol "HTTP"). The data
    plane calls ``got(decoupled)`` for every response (or bare final flag) of the request,
    its adapter ``sent()`` for each one it writes.

    The layouts are the ones tritonserver 2.51 writes (stream_infer_handler.cc,
    http_server.cc's GenerateRequestClass), in the order the times happen where Triton's
    order is a race between its frontend and its backend:
    - a stream request to a plain model: ModelInfer's;
    - to a decoupled model: the model object, REQUEST_START, QUEUE_START,
      GRPC_WAITREAD_START/END, INFER_RESPONSE_COMPLETE (the first response's only),
      GRPC_SEND_START/END for each response written, the COMPUTE_* times, REQUEST_END
      (when the final flag came);
    - generate: HTTP_RECV_START/END, the model object, REQUEST_START, QUEUE_START,
      COMPUTE_*, INFER_RESPONSE_COMPLETE for each response (and bare final flag),
      REQUEST_END, then HTTP_SEND_START and HTTP_SEND_END for each response written, both
      0 (Triton's evhtp does not time chunked sends: its FIXME)."""

    __slots__ = ("decoupled", "received", "sends")

    def __init__(self, protocol: str) -> None:
        super().__init__(protocol)
        self.decoupled = False
        self.received: list[int] = []           # INFER_RESPONSE_COMPLETE, each response
        self.sends: list[list[int]] = []         # [SEND_START, SEND_END], each written

    def got(self, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.received.append(time.monotonic_ns())

    def arrived(self, head: list[int],
                outputs: list[tuple[str, str, list[int], bytes]] | None) -> None:
        super().arrived(head, outputs)
        self.request_end = self.response   # the final flag
        if self.received:
            self.response = self.received[0]

    def replied(self) -> None:
        super().replied()
        if self.protocol == "HTTP" and not self.sends:   # generate: its one answer
            self.sends.append([0, 0])

    def sent(self) -> None:
        """A response is handed to the server: SEND_END once the loop turns (written)."""
        pair = [time.monotonic_ns(), 0]
        self.sends.append(pair)
        asyncio.get_running_loop().call_soon(_stamp_end, pair)

    def text(self) -> str:
        level = self.head[TRACE_LEVEL]
        if self.protocol == "GRPC" and not self.decoupled or not level & TIMESTAMPS:
            if self.sends:
                self.send_start, self.send_end = self.sends[0]
            return super().text()
        tid, h = self.head[TRACE_ID], self.head
        grpc = self.protocol == "GRPC"
        tensors = ""
        if level & TENSORS:   # the timestamps of RequestTrace.text, then the tensors alone
            self.head = [tid, TENSORS, *h[2:]]
            tensors = super().text()
            self.head = h
        out = [] if grpc else [timestamp(tid, "HTTP_RECV_START", self.recv_start),
                               timestamp(tid, "HTTP_RECV_END", self.recv_end)]
        out += [model_object(tid, self.model, self.version, self.request_id),
                timestamp(tid, "REQUEST_START", self.request_start),
                timestamp(tid, "QUEUE_START", h[QUEUE_START])]
        if tensors:
            out.append(tensors)
        compute = [timestamp(tid, n, ns) for n, ns in zip(COMPUTE_NAMES, h[QUEUE_START + 1:])]
        end = timestamp(tid, "REQUEST_END", self.request_end or self.response)
        if grpc:
            out += [timestamp(tid, "GRPC_WAITREAD_START", self.recv_start),
                    timestamp(tid, "GRPC_WAITREAD_END", self.recv_end),
                    timestamp(tid, "INFER_RESPONSE_COMPLETE", self.response)]
            for start, stop in self.sends:
                out += [timestamp(tid, "GRPC_SEND_START", start),
                        timestamp(tid, "GRPC_SEND_END", stop)]
            return ",".join([*out, *compute, end])
        out += compute
        out += [timestamp(tid, "INFER_RESPONSE_COMPLETE", ns) for ns in self.received]
        out.append(end)
        for _ in self.sends:
            out += [timestamp(tid, "HTTP_SEND_START", 0), timestamp(tid, "HTTP_SEND_END", 0)]
        return ",".join(out)


def _stamp_end(pair: list[int]) -> None:
    pair[1] = time.monotonic_ns()


def sent() -> None:
    """The running request writes a response: a SEND pair if it is a traced stream."""
    ctx = CURRENT.get()
    if isinstance(ctx, StreamTrace):
        ctx.sent()


def stream_runner(handler: Callable[..., Awaitable[None]],
                  dp: DataPlaneAPI) -> Callable[..., Awaitable[None]]:
    """``handler`` (one ModelStreamInfer request's producer) run with a StreamTrace in
    CURRENT; the trace is written once its last response is handed to the stream."""
    async def run(*args: Any) -> None:
        ctx = StreamTrace("GRPC")
        token = CURRENT.set(ctx)
        try:
            await handler(*args)
        finally:
            CURRENT.reset(token)
            if ctx.head:
                if not ctx.request_end:
                    ctx.request_end = ctx.response
                asyncio.get_running_loop().call_soon(ctx.finish)
    return run


class TracedChunks:
    """A generate_stream body (``chunks``, an async iterator with aclose) of the traced
    request ``ctx``: its responses are read with the trace in CURRENT (the data plane
    finds it), each chunk counts as a send, and the trace is written when the body ends."""

    def __init__(self, chunks: Any, ctx: StreamTrace) -> None:
        self._chunks, self._ctx = chunks, ctx

    def __aiter__(self) -> TracedChunks:
        return self

    async def __anext__(self) -> bytes:
        token = CURRENT.set(self._ctx)
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        finally:
            CURRENT.reset(token)
        self._ctx.sent()
        return chunk

    async def aclose(self) -> None:
        token = CURRENT.set(self._ctx)
        try:
            await self._chunks.aclose()
        finally:
            CURRENT.reset(token)
            self._end()

    def _end(self) -> None:
        if self._ctx.head and self._ctx.sink is not None:
            asyncio.get_running_loop().call_soon(self._ctx.finish)
