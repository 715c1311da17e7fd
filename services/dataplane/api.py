"""The interface the protocol adapters (HTTP, gRPC) depend on: the scheduler's client as
they see it. DataPlane implements it; tests drive the adapters with fakes of the same
shape, so an adapter never reaches past these methods."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from services.common.messages import ModelStat
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

    def release(self, resp: CoreResponse) -> None:
        """The adapter has written ``resp``: its output blocks go back to their owner."""
        ...
