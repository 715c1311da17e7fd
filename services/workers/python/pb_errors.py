"""Triton's Python-backend errors (pb_utils.TritonError, pb_utils.TritonModelException),
apart so that every part of pb_utils can raise them."""
from __future__ import annotations


class TritonError(Exception):
    """An error a model returns in an InferenceResponse (or raises from execute)."""
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE = 0, 1, 2, 3, 4
    UNSUPPORTED, ALREADY_EXISTS, CANCELLED = 5, 6, 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """What a failed BLS call or a bad use of this API raises inside a model."""

    def message(self) -> str:
        return str(self)
