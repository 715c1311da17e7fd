"""Triton's logging extension over HTTP: GET and POST /v2/logging.

The settings are the scheduler's (``dp.log_settings``), which every process follows
(services/common/logsettings.py). This module does what Triton's HTTP layer does: the
method check, the update body checked in its order and words, and the answer as Triton
writes it. Source (triton-inference-server/server v2.51.0, src/http_server.cc):
HTTPAPIServer::HandleLogging and EVBufferToJson; TritonJson's texts (common,
triton_json.h), whose errors are INTERNAL there. Checked against tritonserver 2.51:
an empty body is 500 "The document is empty", a body that is not a JSON object ([],
null) changes nothing, unknown members and null values are ignored, a log_verbose_level
past INT32_MAX wraps as Triton's int32 cast does.

Differs from Triton: an update is applied whole or not at all; Triton applies the
settings that come before the first bad one (log_info, then log_warning, ...) and then
answers the error.
"""
from __future__ import annotations

from typing import Any

from services.common.errors import (
    JSON_NOT_BOOL,
    JSON_NOT_STRING,
    JSON_NOT_UINT,
    TriremeError,
    internal,
    invalid_arg,
    unavailable,
    unsupported,
)
from services.common.logsettings import FORMATS, LOG_FILE_TEXT, as_json, verbose_level
from services.dataplane.api import DataPlaneAPI
from services.frontend.http import json_body
from services.frontend.http.message import BodyTooLarge, Reply
from services.frontend.http.shm_routes import size_limit_text

__all__ = ["LOGGING_PATH", "LoggingRoute", "decode_update"]

LOGGING_PATH = "/v2/logging"

_JSON = "application/json"
_NOT_ALLOWED = Reply(405, json_body.error_body("Method Not Allowed"), _JSON)
_BOOLS = ("log_info", "log_warning", "log_error")
_UINT64_MAX = 2**64 - 1
# TritonJson (INTERNAL): services/common/errors.py
NOT_BOOL_TEXT, NOT_UINT_TEXT, NOT_STRING_TEXT = JSON_NOT_BOOL, JSON_NOT_UINT, JSON_NOT_STRING


def _parse(body: Any) -> Any:
    """EVBufferToJson: the body as JSON, rapidjson's words, INTERNAL (an empty body too:
    2.51 does not allow one here)."""
    try:
        return json_body.decode_json(body)
    except TriremeError as e:
        raise internal(e.message) from None


def decode_update(body: Any) -> dict[str, Any]:
    """An update body -> the settings it changes (logsettings.RUNTIME_FIELDS names),
    checked in Triton's order; the first problem raises, in Triton's words and code."""
    doc = _parse(body)
    if type(doc) is not dict:
        return {}
    if doc.get("log_file") is not None:
        raise unsupported(LOG_FILE_TEXT)
    changes: dict[str, Any] = {}
    for name in _BOOLS:
        value = doc.get(name)
        if value is not None:
            if type(value) is not bool:
                raise internal(NOT_BOOL_TEXT)
            changes[name] = value
    value = doc.get("log_verbose_level")
    if value is not None:
        if type(value) is not int or not 0 <= value <= _UINT64_MAX:
            raise internal(NOT_UINT_TEXT)
        changes["log_verbose_level"] = verbose_level(value)
    value = doc.get("log_format")
    if value is not None:
        if type(value) is not str:
            raise internal(NOT_STRING_TEXT)
        if value not in FORMATS:   # (Triton's text, UNAVAILABLE, cut at a NUL by c_str())
            raise unavailable(f"invalid argument for --log_format, got: {value}"
                              .partition("\0")[0])
        changes["log_format"] = value
    return changes


class LoggingRoute:
    """/v2/logging over the data plane ``dp``; ``limit``: the largest body read
    (--http-max-input-size)."""

    def __init__(self, dp: DataPlaneAPI, limit: int) -> None:
        self.dp = dp
        self.limit = limit

    async def handle(self, request: Any) -> Reply:
        if request.method == "GET":
            changes: dict[str, Any] = {}
        elif request.method == "POST":
            try:
                body = await request.read()
            except BodyTooLarge as e:
                raise invalid_arg(size_limit_text(e.size, self.limit)) from None
            changes = decode_update(body)
        else:
            return _NOT_ALLOWED
        settings = await self.dp.log_settings(**changes)
        return Reply(200, json_body.encode_json(as_json(settings)), _JSON)
