"""Frontend settings, one field per `tritonserver` flag that the frontend honours."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from services.dataplane.settings import DataPlaneSettings
from services.frontend.forward import compile_pattern
from services.frontend.grpc.limits import GrpcLimits
from services.frontend.restricted import Restrictions
from services.frontend.tls import TlsConfig

DEFAULT_HTTP_MAX_INPUT_SIZE = 64 * 1024 * 1024
HEALTH_BODIES = ("empty", "json")   # --http-health-body

# Triton's extension list, in Triton's order, restricted to what is implemented.
EXTENSIONS = ["classification", "sequence", "model_repository",
              "model_repository(unload_dependents)", "schedule_policy",
              "model_configuration", "system_shared_memory", "cuda_shared_memory",
              "binary_tensor_data", "parameters", "statistics", "trace", "logging"]


@dataclass
class FrontendSettings(DataPlaneSettings):
    """The data plane's settings (scheduler and result addresses, inline threshold, shared
    memory) and the frontend's own: ports, limits, servers."""
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
    grpc_impl: str = "native"
    """gRPC server: "native" (HTTP/2 on the frontend's own loop) or "aio" (grpc.aio)."""
    http_impl: str = "native"
    """HTTP server: "native" (HTTP/1.1 parsed by httptools on the frontend's own loop) or
    "aiohttp" (aiohttp's low-level server)."""
    restricted: Restrictions = field(default_factory=Restrictions)
    """Restricted API groups (--http-restricted-api, --grpc-restricted-protocol)."""
    http_header_timeout_secs: float = 60.0
    """A request head must arrive within this (--http-header-timeout-secs; 0: off)."""
    http_body_timeout_secs: float = 60.0
    """A request body must arrive within this, plus 1 s per 64 KiB it brings
    (--http-body-timeout-secs; 0: off)."""
    http_idle_timeout_secs: float = 75.0
    """An idle keep-alive connection closes after this (--http-idle-timeout-secs)."""
    http_max_connections: int = 1024
    """Open HTTP connections per frontend; past it, 503 and close (--http-max-connections;
    0: no cap)."""
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)
    """gRPC message size, HTTP/2, timeout and keepalive limits (--grpc-max-message-size,
    --grpc-http2-*, --grpc-keepalive-*, ...; grpc/limits.py has each one and its default)."""
    grpc_tls: TlsConfig | None = None
    """gRPC over TLS (--grpc-use-ssl, --grpc-use-ssl-mutual, --grpc-server-cert,
    --grpc-server-key, --grpc-root-cert; tls.py); None: plain text."""
    http_tls: TlsConfig | None = None
    """HTTPS (--http-use-ssl and the same four under --http-; tls.py); None: plain text."""
    http_header_forward_pattern: str | None = None
    """HTTP infer requests' headers whose names match become request parameters
    (--http-header-forward-pattern; forward.py); None: none do."""
    grpc_header_forward_pattern: str | None = None
    """The same for gRPC inference calls' metadata (--grpc-header-forward-pattern)."""
    http_listen_fd: int = -1
    """A listening socket `trireme serve` bound for its frontends (listen.py); -1: bind
    host:http_port."""
    grpc_listen_fd: int = -1
    """The same for gRPC (native only: grpc.aio binds by address)."""
    reuse_port: bool = False
    """--reuse-port: bind with SO_REUSEPORT, sharing the ports with other frontends (the
    compose topology's); without it a port another process holds fails the start."""
    http_health_body: str = "empty"
    """What GET /v2/health/live, /v2/health/ready and /v2/models/m/ready answer with their
    status (--http-health-body): "empty" (Triton's empty body, which Triton's QA scripts
    compare with curl) or "json" (the Open Inference Protocol's {"live": true},
    {"ready": true}, {"name": m, "ready": true}, which KServe's own client reads)."""

    def server_metadata(self) -> dict:
        return {"name": self.server_name, "version": self.server_version, "extensions": EXTENSIONS}

    def __post_init__(self) -> None:
        if self.grpc_impl not in ("native", "aio"):
            raise ValueError(f"grpc_impl must be 'native' or 'aio', got '{self.grpc_impl}'")
        if self.http_health_body not in HEALTH_BODIES:
            raise ValueError(f"http_health_body must be one of {', '.join(HEALTH_BODIES)}, got "
                             f"'{self.http_health_body}'")
        if self.http_impl not in ("native", "aiohttp"):
            raise ValueError(f"http_impl must be 'native' or 'aiohttp', got '{self.http_impl}'")
        for name in ("http_header_forward_pattern", "grpc_header_forward_pattern"):
            pattern = getattr(self, name)
            if pattern is not None:
                try:
                    compile_pattern(pattern)
                except re.error as e:
                    raise ValueError(f"{name}: invalid regular expression '{pattern}': {e}") \
                        from None
