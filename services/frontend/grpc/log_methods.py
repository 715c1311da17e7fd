"""Triton's logging extension over gRPC: the LogSettings RPC (an empty request reads the
settings, one with settings changes them).

The settings are the scheduler's (``dp.log_settings``), which every process follows
(services/common/logsettings.py). What is left here is what Triton's gRPC layer checks:
each setting's oneof case, in its order and words. Source (triton-inference-server/server
v2.51.0, src/grpc/grpc_server.cc): CommonHandler::RegisterLogging. Checked against
tritonserver 2.51: a log_file key is refused whatever it holds (an empty value too),
unknown keys are ignored, a uint32 level past INT32_MAX is 0 (Triton's int32 cast).

Differs from Triton: an update is applied whole or not at all; Triton applies the
settings that come before the first bad one and then answers the error.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from protos import grpc_service_pb2 as pb
from services.common import messages as m
from services.common.errors import invalid_arg, unsupported
from services.common.logsettings import FORMATS, LOG_FILE_TEXT, verbose_level
from services.dataplane.api import DataPlaneAPI

__all__ = ["LogRpcs", "settings_to_proto", "update_from_proto"]

_BOOLS = ("log_info", "log_warning", "log_error")


def update_from_proto(request: pb.LogSettingsRequest) -> dict[str, Any]:
    """The settings a request changes (logsettings.RUNTIME_FIELDS names), checked in
    Triton's order; the first problem raises, in Triton's words and code."""
    settings = request.settings
    if not settings:
        return {}
    if "log_file" in settings:
        raise unsupported(LOG_FILE_TEXT)
    changes: dict[str, Any] = {}
    for name in _BOOLS:
        if name in settings:
            value = settings[name]
            if value.WhichOneof("parameter_choice") != "bool_param":
                raise invalid_arg(f"expect boolean for '{name}'")
            changes[name] = value.bool_param
    if "log_verbose_level" in settings:
        value = settings["log_verbose_level"]
        if value.WhichOneof("parameter_choice") != "uint32_param":
            raise invalid_arg("expect int32 for 'log_verbose_level'")
        changes["log_verbose_level"] = verbose_level(value.uint32_param)
    if "log_format" in settings:
        value = settings["log_format"]
        if value.WhichOneof("parameter_choice") != "string_param":
            raise invalid_arg("expect string for 'log_format'")
        if value.string_param not in FORMATS:   # (cut at a NUL, as Triton's c_str())
            raise invalid_arg(f"invalid argument for log_format, got: {value.string_param}"
                              .partition("\0")[0])
        changes["log_format"] = value.string_param
    return changes


def settings_to_proto(settings: m.LogConfig) -> pb.LogSettingsResponse:
    resp = pb.LogSettingsResponse()
    out = resp.settings
    out["log_file"].string_param = settings.log_file
    out["log_info"].bool_param = settings.log_info
    out["log_warning"].bool_param = settings.log_warning
    out["log_error"].bool_param = settings.log_error
    out["log_verbose_level"].uint32_param = settings.log_verbose_level
    out["log_format"].string_param = settings.log_format
    return resp


class LogRpcs:
    """LogSettings over the data plane ``dp`` (methods.GrpcService owns one)."""

    __slots__ = ("_dp",)

    def __init__(self, dp: DataPlaneAPI) -> None:
        self._dp = dp

    def handlers(self) -> dict[str, Callable[[Any, Any], Awaitable[Any]]]:
        """RPC name -> handler, for the service's method table."""
        return {"LogSettings": self.LogSettings}

    async def LogSettings(self, request: pb.LogSettingsRequest,
                          context: Any) -> pb.LogSettingsResponse:
        return settings_to_proto(await self._dp.log_settings(**update_from_proto(request)))
