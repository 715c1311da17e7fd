"""Triton's trace extension, the parts the frontend (its data plane), the scheduler and the
worker share: trace levels, the layout of a sampled request's times as they travel back
with its result, and the pieces of Triton's trace-file JSON.

Who does what:
- the scheduler holds the settings (services/scheduler/trace_settings.py), samples the
  requests a frontend marks as traceable (InferRequest.trace), numbers the traces, stamps
  QUEUE_START (its arrival time) and files each finished trace;
- the worker adds COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START and COMPUTE_END
  to the results of the sampled requests of a batch (``stamp_results``);
- the frontend stamps the protocol's times (HTTP_*, GRPC_*), REQUEST_START,
  INFER_RESPONSE_COMPLETE and REQUEST_END, and writes the trace (``RequestTrace``) once
  the response is sent.

Times are CLOCK_MONOTONIC nanoseconds (time.monotonic_ns, and perf_counter_ns, which is
the same clock on Linux): one clock for every process of a host, and the one Triton uses
(std::chrono::steady_clock), so the numbers compare with Triton's own trace files.
Nothing here runs for a request that is not traced.
"""
from __future__ import annotations

import contextvars
import json
import re
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "CHILDREN_KEY",
    "COMPUTE_NAMES",
    "CURRENT",
    "TENSORS",
    "TIMESTAMPS",
    "RequestTrace",
    "level_names",
    "stoi",
    "model_object",
    "stamp_results",
    "tensor_object",
    "timestamp",
    "valid_traceparent",
]

# TRITONSERVER_InferenceTraceLevel bits (tritonserver.h): DISABLED 0, TIMESTAMPS 0x4,
# TENSORS 0x8 (MIN 0x1 and MAX 0x2 are deprecated aliases of TIMESTAMPS).
TIMESTAMPS = 0x4
TENSORS = 0x8

# InferResult.trace / BatchItem.trace: [trace id, level, QUEUE_START] from the scheduler,
# then the worker's four COMPUTE_* times, in this order.
TRACE_ID, TRACE_LEVEL, QUEUE_START = 0, 1, 2
COMPUTE_NAMES = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")

# Mode opentelemetry: a traced ensemble's answer carries its steps' times in its parameters
# under this reserved key (the frontend takes it out and makes their spans): one list per
# step, [trace id, parent trace id, model, version, request id, REQUEST_START, QUEUE_START,
# COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END, REQUEST_END].
CHILDREN_KEY = "triton_trace_children"

# W3C trace context (https://www.w3.org/TR/trace-context/): version, trace id, parent id,
# flags; all-zero ids are invalid, version ff is forbidden.
_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def valid_traceparent(value: str | None) -> bool:
    return value is not None and _TRACEPARENT.match(value.strip()) is not None

CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "trireme_request_trace", default=None)
"""The trace of the request the running task serves, set by the HTTP and gRPC adapters
around an inference they may trace; the data plane reads it."""


def stoi(text: str, bits: int = 32) -> int:
    """C++'s std::stoi, which Triton parses trace settings with: leading white space, a
    sign, decimal digits, the rest ignored (a NUL ends the text). Raises ValueError (no
    digits: invalid_argument) or OverflowError (outside int32: out_of_range). ``bits`` 64:
    std::stoul's range (its minus sign wraps, as C's does: the caller masks)."""
    s = text.partition("\0")[0].lstrip(" \t\n\v\f\r")
    i = 1 if s[:1] in ("+", "-") else 0
    j = i
    while j < len(s) and "0" <= s[j] <= "9":
        j += 1
    if j == i:
        raise ValueError(text)
    v = int(s[:j])
    limit = 2**(bits - 1) if bits == 32 else 2**bits
    if not -limit <= v < limit:
        raise OverflowError(text)
    return v


def level_names(level: int) -> list[str]:
    """A level as Triton lists it (HandleTrace, TraceSetting): ["OFF"], or its names."""
    if not level:
        return ["OFF"]
    names = []
    if level & TIMESTAMPS:
        names.append("TIMESTAMPS")
    if level & TENSORS:
        names.append("TENSORS")
    return names


# ---- Triton's trace-file JSON (src/tracer.cc: TraceActivity, TraceTensorActivity) ----------

def _text(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def timestamp(trace_id: int, name: str, ns: int) -> str:
    return f'{{"id":{trace_id},"timestamps":[{{"name":"{name}","ns":{ns}}}]}}'


def model_object(trace_id: int, model: str, version: int, request_id: str = "",
                 parent_id: int = 0) -> str:
    """The object Triton writes at REQUEST_START: the model, its version, the request's id
    when it has one, the parent trace of an ensemble step."""
    out = f'{{"id":{trace_id},"model_name":{_text(model)},"model_version":{version}'
    if request_id:
        out += f',"request_id":{_text(request_id)}'
    if parent_id:
        out += f',"parent_id":{parent_id}'
    return out + "}"


def tensor_object(trace_id: int, activity: str, name: str, datatype: str,
                  shape: Iterable[int], data: bytes) -> str:
    """One TENSOR_QUEUE_INPUT / TENSOR_BACKEND_OUTPUT entry, ``data`` the tensor's raw bytes
    (BYTES: Triton's length-prefixed elements)."""
    return (f'{{"id":{trace_id},"activity":"{activity}","tensor":{{"name":{_text(name)},'
            f'"data":{_text(_tensor_data(datatype, data))},'
            f'"shape":"{",".join(str(d) for d in shape)}","dtype":"{datatype}"}}}}')


_STRUCT = {"BOOL": "?", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT16": "h", "INT32": "i",
           "INT64": "q", "FP32": "f", "FP64": "d"}


def _tensor_data(datatype: str, data: bytes) -> str:
    """The elements as Triton's std::stringstream prints them: integers in decimal, bools
    as 1/0, floats as "%g" (6 significant digits), INT8/UINT8 as the characters they are,
    BYTES elements quoted; FP16/BF16 not at all (Triton leaves them out)."""
    if datatype in ("UINT8", "INT8"):
        return ",".join(chr(b) for b in data)
    if datatype == "BYTES":
        out, off = [], 0
        while off + 4 <= len(data):
            (n,) = struct.unpack_from("<I", data, off)
            off += 4
            if off + n > len(data):
                break
            out.append('"' + data[off:off + n].decode("utf-8", "replace") + '"')
            off += n
        return ",".join(out)
    code = _STRUCT.get(datatype)
    if code is None:   # FP16, BF16
        return ""
    n = len(data) // struct.calcsize(code)
    values = struct.unpack_from(f"<{n}{code}", data)
    if datatype in ("FP32", "FP64"):
        return ",".join(f"{v:g}" for v in values)
    return ",".join(str(int(v)) for v in values)


# ---- the worker: its compute times onto the sampled requests' results ----------------------

def stamp_results(items: Iterable[Any], replies: dict[str, tuple[list[Any], list[Any]]],
                  times: tuple[int, ...]) -> None:
    """Give each result of ``replies`` (reply_to -> (results, frames)) whose BatchItem was
    sampled its trace: the item's [id, level, QUEUE_START] and the batch's COMPUTE_START,
    COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END. Called only for a batch whose
    ExecuteBatch says it has a traced item."""
    traced = {(it.reply_to, it.req_id): it.trace for it in items if it.trace}
    for reply_to, (results, _) in replies.items():
        for r in results:
            head = traced.get((reply_to, r.req_id))
            if head is not None and r.final:
                r.trace = [*head, *times]


# ---- the frontend: one request's trace ------------------------------------------------------

class RequestTrace:
    """A request the frontend may trace: made by the protocol adapter (its times), carried
    by CURRENT into the data plane (REQUEST_START, the sampled result's times), finished by
    the adapter once the response is sent: ``finish()`` hands the trace's JSON to ``sink``
    if the scheduler sampled the request (``head`` set), else does nothing.

    ``protocol`` "HTTP" or "GRPC" picks Triton's names and order for the protocol's times:
    HTTP_RECV_START/END before the model object, HTTP_SEND_START/END at the end; the gRPC
    frontend writes GRPC_WAITREAD_START/END, INFER_RESPONSE_COMPLETE and GRPC_SEND_START/END
    after REQUEST_END (it writes them when the call ends, as Triton's does)."""

    __slots__ = ("carrier", "children", "head", "inputs", "model", "outputs", "protocol",
                 "recv_end", "recv_start", "request_end", "request_id", "request_start",
                 "response", "send_end", "send_start", "sink", "version")

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.recv_start = time.monotonic_ns()
        self.recv_end = self.request_start = self.response = self.request_end = 0
        self.send_start = self.send_end = 0
        self.model, self.version, self.request_id = "", 0, ""
        self.inputs: list[tuple[str, str, list[int], bytes]] | None = None
        self.outputs: list[tuple[str, str, list[int], bytes]] | None = None
        self.head: list[int] = []
        self.sink: Callable[[int, RequestTrace], None] | None = None
        # mode opentelemetry: the request's W3C trace context headers (traceparent,
        # tracestate) when it brings a valid one, and its ensemble steps' times
        self.carrier: dict[str, str] | None = None
        self.children: list[list[Any]] = []

    def begin(self, model: str, version: int, request_id: str,
              inputs: list[tuple[str, str, list[int], bytes]] | None,
              sink: Callable[[int, RequestTrace], None]) -> None:
        """The data plane sends the request: the body has been read and decoded."""
        self.recv_end = time.monotonic_ns()
        self.model, self.version, self.request_id = model, version, request_id
        self.inputs, self.sink = inputs, sink
        self.request_start = time.monotonic_ns()

    def arrived(self, head: list[int],
                outputs: list[tuple[str, str, list[int], bytes]] | None) -> None:
        """The sampled request's result is back (INFER_RESPONSE_COMPLETE)."""
        self.response = time.monotonic_ns()
        self.head = head
        self.outputs = outputs

    def replied(self) -> None:
        """The adapter has its answer (REQUEST_END) and starts sending it."""
        self.request_end = time.monotonic_ns()
        self.send_start = time.monotonic_ns()

    def finish(self) -> None:
        """The answer is sent (or the call ended without one): the sink writes the trace
        (its text(), or its spans)."""
        if not self.head or self.sink is None:
            return
        if self.send_start and not self.send_end:
            self.send_end = time.monotonic_ns()
        sink, self.sink = self.sink, None
        sink(self.head[TRACE_ID], self)

    def text(self) -> str:
        """Triton's activity objects of this trace, comma-joined."""
        h = self.head
        tid, level = h[TRACE_ID], h[TRACE_LEVEL]
        out: list[str] = []
        stamps = bool(level & TIMESTAMPS)
        http, grpc = self.protocol == "HTTP", self.protocol == "GRPC"

        def t(name: str, ns: int) -> None:
            if ns:
                out.append(timestamp(tid, name, ns))

        if stamps:
            if http:
                t("HTTP_RECV_START", self.recv_start)
                t("HTTP_RECV_END", self.recv_end)
            out.append(model_object(tid, self.model, self.version, self.request_id))
            t("REQUEST_START", self.request_start)
            t("QUEUE_START", h[QUEUE_START])
        if level & TENSORS:
            for activity, tensors in (("TENSOR_QUEUE_INPUT", self.inputs),
                                      ("TENSOR_BACKEND_OUTPUT", self.outputs)):
                for name, datatype, shape, data in tensors or ():
                    out.append(tensor_object(tid, activity, name, datatype, shape, data))
        if stamps:
            for name, ns in zip(COMPUTE_NAMES, h[QUEUE_START + 1:]):
                t(name, ns)
            if http:
                t("INFER_RESPONSE_COMPLETE", self.response)
                t("REQUEST_END", self.request_end)
                t("HTTP_SEND_START", self.send_start)
                t("HTTP_SEND_END", self.send_end)
            else:
                t("REQUEST_END", self.request_end or self.response)
                if grpc:
                    t("GRPC_WAITREAD_START", self.recv_start)
                    t("GRPC_WAITREAD_END", self.recv_end)
                    t("INFER_RESPONSE_COMPLETE", self.response)
                    t("GRPC_SEND_START", self.send_start)
                    t("GRPC_SEND_END", self.send_end)
        return ",".join(out)
