"""The interface the protocol adapters (HTTP, gRPC) depend on: the scheduler's client as
they see it. DataPlane implements it; tests drive the adapters with fakes of the same
shape, so an adapter never reaches past these methods."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from services.common.messages import ErrorRecord, LogConfig, ModelStat, TraceUpdate
from services.dataplane.types import CoreRequest, CoreResponse


class DataPlaneAPI(Protocol):
    # -- health and metadata --------------------------------------------------------------
    def live(self) -> bool: ...

    def ready(self) -> bool: ...

    async def model_ready(self, model: str, version: str) -> bool: ...

    async def model_metadata(self, model: str, version: str) -> dict: ...

    async def model_config(self, model: str, version: str) -> dict: ...

    # -- repository and statistics ----------------------------------------------------------
    async def repository_index(self, ready_only: bool) -> list[dict]: ...

    async def load_model(self, model: str, parameters: dict) -> None: ...

    async def unload_model(self, model: str, parameters: dict) -> None: ...

    async def statistics(self, model: str = "", version: str = "") -> list[ModelStat]: ...

    # -- client shared memory (Triton's shared-memory extensions) --------------------------
    # ``kind`` is "system" or "cuda". The registry lives in the scheduler, so every frontend
    # sees every region; each raises TriremeError with Triton's text and code.
    async def shm_status(self, kind: str, name: str = "") -> list[dict]:
        """Registered regions of ``kind`` (all when ``name`` is ""), as Triton lists them:
        system {"name", "key", "offset", "byte_size"}; cuda {"name", "device_id",
        "byte_size"}. An unknown ``name`` raises NOT_FOUND."""
        ...

    async def shm_register(self, kind: str, name: str, key: str = "", offset: int = 0,
                           byte_size: int = 0, device_id: int = 0,
                           raw_handle: bytes = b"") -> None:
        """system: ``key``, ``offset``, ``byte_size``; cuda: ``raw_handle`` (the decoded
        cudaIpcMemHandle_t bytes), ``device_id``, ``byte_size``."""
        ...

    async def shm_unregister(self, kind: str, name: str = "") -> None:
        """One region, or every region of ``kind`` when ``name`` is ""."""
        ...

    # -- logging extension ------------------------------------------------------------------
    async def log_settings(self, *, log_info: bool | None = None,
                           log_warning: bool | None = None, log_error: bool | None = None,
                           log_verbose_level: int | None = None,
                           log_format: str | None = None) -> LogConfig:
        """The scheduler's log settings (every process follows them), after changing the
        ones given (None: unchanged; checked by the adapter in its protocol's words).
        Applied whole or not at all."""
        ...

    # -- trace extension --------------------------------------------------------------------
    # The settings are the scheduler's (one place: trace_rate and trace_count count the
    # server's requests). An adapter marks a request as traceable by running it with a
    # services.common.trace.RequestTrace in trace.CURRENT.
    trace_on: bool
    """Some model may be traced now: only then does trace_level() need asking."""
    trace_mode: str
    """Triton's trace mode: "triton" (trace files) or "opentelemetry" (spans)."""

    def trace_level(self, model: str) -> int:
        """The trace level of requests for ``model`` (0: they are not traced)."""
        ...

    async def trace_settings(self, model: str = "", update: TraceUpdate | None = None,
                             error: ErrorRecord | None = None) -> list[tuple[str, list[str]]]:
        """The trace settings of ``model`` ("": the global ones) after ``update`` (None:
        read only), as Triton lists them: (key, values) pairs. Raises Triton's errors: an
        unknown model first, then ``error`` (the request's own problem, found by the
        adapter), then an invalid setting."""
        ...

    # -- inference --------------------------------------------------------------------------
    async def infer(self, req: CoreRequest, endpoint: str = "HTTP end point") -> CoreResponse:
        """One request, one response (a decoupled model is refused, naming ``endpoint``)."""
        ...

    def infer_stream(self, req: CoreRequest,
                     on_sent: Callable[[], None] | None = None) -> AsyncIterator[CoreResponse]:
        """Every response to one request, as the model sends them. ``on_sent()`` once the
        request is on its way to the scheduler, or refused before (a stream's next request
        waits for it: requests reach the scheduler in the order the client sent them)."""
        ...

    async def metrics_text(self) -> str:
        """The scheduler's /metrics text ("" with metrics off)."""
        ...

    def release(self, resp: CoreResponse) -> None:
        """The adapter has written ``resp``: its output blocks go back to their owner."""
        ...
