"""The base of every cross-process message (msgspec Structs encoded as msgpack arrays) and
the error record they carry; services/common/messages.py registers and encodes them."""
from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class ErrorRecord(Msg):
    """An error crossing a process boundary: a services.common.errors.Code and its text."""
    code: int
    message: str
