"""Frontend settings, one field per `tritonserver` flag that the frontend honours."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.shm import DEFAULT_INLINE_THRESHOLD

DEFAULT_HTTP_MAX_INPUT_SIZE = 64 * 1024 * 1024


@dataclass
class FrontendSettings:
    scheduler_addr: str
    """ZeroMQ address of the scheduler's frontend socket (tcp:// or ipc://)."""
    result_addr: str = ""
    """Where workers push results to this frontend; empty: an ipc:// path chosen at start."""
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    allow_http: bool = True
    allow_grpc: bool = True
    http_max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE
    """Largest HTTP request body accepted (--http-max-input-size)."""
    server_name: str = "trireme"
    """Name in server metadata; "triton" for test suites written against Triton."""
    server_version: str = "0.1.0"
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD
    """Tensors smaller than this travel as ZeroMQ frames instead of shared memory."""
    use_shm: bool = True
    """Place large tensors in shared memory (off when processes do not share a host)."""
    grpc_impl: str = "native"
    """gRPC server: "native" (HTTP/2 on the frontend's own loop) or "aio" (grpc.aio)."""
