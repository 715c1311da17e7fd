"""Frontend settings, one field per `tritonserver` flag that the frontend honours."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.shm import DEFAULT_INLINE_THRESHOLD

DEFAULT_HTTP_MAX_INPUT_SIZE = 64 * 1024 * 1024


@dataclass
class FrontendSettings:
    scheduler_addr: str
    """The scheduler's frontend listener (unix://, stream://, or ZeroMQ's ipc:// / tcp://)."""
    result_addr: str = ""
    """Where workers send results to this frontend; empty: a socket path chosen at start,
    on the scheduler address's wire."""
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
    http_impl: str = "native"
    """HTTP server: "native" (HTTP/1.1 parsed by httptools on the frontend's own loop) or
    "aiohttp" (aiohttp's low-level server)."""

    def __post_init__(self) -> None:
        if self.grpc_impl not in ("native", "aio"):
            raise ValueError(f"grpc_impl must be 'native' or 'aio', got '{self.grpc_impl}'")
        if self.http_impl not in ("native", "aiohttp"):
            raise ValueError(f"http_impl must be 'native' or 'aiohttp', got '{self.http_impl}'")
