"""The one error type every service raises and sends across processes.

Codes are Triton's set. Mapping a code to an HTTP or gRPC status happens once, in each
protocol adapter, never here; across processes an error travels as {code, message}.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TriremeError(Exception):
    """An error with a Triton code; `str(err)` is the client-facing message."""

    def __init__(self, code: Code | int, message: str) -> None:
        super().__init__(message)
        try:
            self.code = Code(code)
        except ValueError:  # a code from a newer peer: keep the message, not the crash
            self.code = Code.UNKNOWN
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"TriremeError({self.code.name}, {self.message!r})"

    def __reduce__(self):  # keep (code, message) when copied or pickled in tests
        return (type(self), (self.code, self.message))


def invalid_arg(msg: str) -> TriremeError:
    return TriremeError(Code.INVALID_ARG, msg)


def not_found(msg: str) -> TriremeError:
    return TriremeError(Code.NOT_FOUND, msg)


def unavailable(msg: str) -> TriremeError:
    return TriremeError(Code.UNAVAILABLE, msg)


def internal(msg: str) -> TriremeError:
    return TriremeError(Code.INTERNAL, msg)


def unsupported(msg: str) -> TriremeError:
    return TriremeError(Code.UNSUPPORTED, msg)
