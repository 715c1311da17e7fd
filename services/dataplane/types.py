"""The one internal request/response shape that both protocol adapters convert to and from.

Tensor data is always raw little-endian bytes here (BYTES tensors in Triton's
length-prefixed serialization): the HTTP adapter turns JSON data into bytes, the gRPC
adapter turns typed contents into bytes, and the data plane never sees a wire format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class InputTensor:
    name: str
    datatype: str
    shape: list[int]
    data: bytes | bytearray | memoryview | None = None   # None only with shared memory
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)  # binary_data, classification, ...


@dataclass(slots=True)
class CoreRequest:
    model: str
    version: str = ""                   # "" -> the model's default version
    id: str = ""
    inputs: list[InputTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None  # None -> every output
    parameters: dict[str, Any] = field(default_factory=dict)
    raw: bool = False                   # an HTTP raw binary request (its one input unnamed)


@dataclass(slots=True)
class OutputTensor:
    name: str
    datatype: str
    shape: list[int]
    data: bytes | memoryview
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CoreResponse:
    model_name: str
    model_version: str
    id: str = ""
    outputs: list[OutputTensor] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    # Shared-memory blocks the output data lives in: the data plane's release() hands them
    # back to their owner once the adapter has written the response.
    blocks: list[tuple[str, int]] = field(default_factory=list)
    keep: Any = None                    # keeps received frames alive while data views them
    final: bool = True                  # decoupled streams: the request's last response
    empty: bool = False                 # a final flag that carries no response
    # A decoupled model's error response that is not its last (a TriremeError): the stream
    # goes on, as Triton's does (infer_stream only; a final error is raised).
    error: Any = None
