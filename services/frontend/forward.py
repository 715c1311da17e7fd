"""Request headers forwarded to the model as request parameters (--http-header-forward-pattern,
--grpc-header-forward-pattern), as Triton's HTTPAPIServer::ForwardHeaders and gRPC
InferHandler::ForwardHeadersAsParameters do it:

- the pattern is Triton's: "(?i)" + the flag's value, in RE2 syntax, and a header whose name
  it matches anywhere (RE2::PartialMatch) is forwarded; "(?-i)" at its start turns the case
  back on. An empty value ("") forwards every header, as Triton's "(?i)" does.
- names keep the case they came in (HTTP; gRPC metadata is lower case), values are strings,
  and they are added after the request's own parameters: one of the same name is replaced
  (Triton keeps both in its list, and the last one wins where the model reads the JSON).
- a name among Triton's reserved parameter keys, or starting "triton_", fails the request
  (Triton main; 2.51 forwarded them): here a forwarded "sequence_id" would be taken for one.
- HTTP: the infer endpoint only (not generate); gRPC: ModelInfer and every request of a
  ModelStreamInfer stream (the stream's metadata), in name order (gRPC's metadata map).
"""
from __future__ import annotations

import argparse
import base64
import binascii
import re
from collections.abc import Iterable
from typing import Any

from services.common.errors import invalid_arg, reserved_header_text

# Triton's kReservedParameterKeys (server src/common.h).
RESERVED = frozenset(("sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                      "headers", "binary_data_output"))

_FLAG_GROUP = re.compile(r"\(\?([a-zA-Z]*(?:-[a-zA-Z]*)?)\)")


def _scoped_flags(pattern: str) -> str:
    """RE2's bare flag groups ("(?-i)", anywhere) as Python's scoped ones ("(?-i:...)", up to
    the end of the enclosing group, reopened after each "|" there): Python takes bare flags
    only at the very start, and never "-i"."""
    out: list[str] = []
    open_flags: list[list[str]] = [[]]     # scoped groups opened, per nesting depth
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":                       # a class: copied as it is, to its "]"
            j = i + 1
            if pattern.startswith("^", j):
                j += 1
            if pattern.startswith("]", j):
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i:j + 1])
            i = j + 1
            continue
        if c == "(":
            m = _FLAG_GROUP.match(pattern, i)
            if m is not None:
                out.append(f"(?{m.group(1)}:")
                open_flags[-1].append(m.group(1))
                i = m.end()
                continue
            open_flags.append([])
        elif c == ")" and len(open_flags) > 1:
            out.append(")" * len(open_flags.pop()))
        elif c == "|" and open_flags[-1]:
            flags = open_flags[-1]
            out.append(")" * len(flags) + "|" + "".join(f"(?{f}:" for f in flags))
            i += 1
            continue
        out.append(c)
        i += 1
    out.append(")" * len(open_flags[0]))
    return "".join(out)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Triton's header pattern ("(?i)" + ``pattern``) as a Python regex; re.error when
    Python's re cannot take it (RE2 syntax it lacks, or no regex at all)."""
    return re.compile(_scoped_flags("(?i)" + pattern))


class HeaderForward:
    """One protocol's pattern: ``apply(parameters, headers)`` adds the matching headers."""
    __slots__ = ("_search",)

    def __init__(self, pattern: str) -> None:
        self._search = compile_pattern(pattern).search

    def apply(self, parameters: dict[str, Any], headers: Iterable[tuple[str, str]]) -> None:
        search = self._search
        for name, value in headers:
            if search(name) is not None:
                if name in RESERVED or name.startswith("triton_"):
                    raise invalid_arg(reserved_header_text(name))
                parameters[name] = value


# Headers gRPC itself reads, which Triton's client_metadata() does not show.
_GRPC_TRANSPORT = frozenset(("te", "content-type"))


def grpc_metadata(context: Any) -> list[tuple[str, str]]:
    """A gRPC call's metadata as Triton's ServerContext::client_metadata() has it: no pseudo,
    transport or "grpc-" headers, "-bin" values decoded (and cut at a NUL: Triton reads them
    as C strings), in name order (a multimap)."""
    items = []
    read = getattr(context, "invocation_metadata", None)   # (none: a call without headers)
    for key, value in (read() if read is not None else None) or ():
        if key[:1] == ":" or key in _GRPC_TRANSPORT or key.startswith("grpc-"):
            continue
        if key.endswith("-bin"):
            if not isinstance(value, bytes):   # (the native server passes them as sent)
                try:
                    value = base64.b64decode(value + "=" * (-len(value) % 4))
                except (binascii.Error, ValueError):
                    value = b""
            value = value.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif isinstance(value, bytes):
            value = value.decode("latin-1")
        items.append((key, value))
    items.sort(key=lambda kv: kv[0])
    return items


def pattern_arg(value: str) -> str:
    """The flags' argparse type: a pattern Python's re cannot take stops the server at the
    command line (Triton starts, logs RE2's error and forwards nothing)."""
    try:
        compile_pattern(value)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"invalid regular expression '{value}': {e}") from None
    return value


def maybe(pattern: str | None) -> HeaderForward | None:
    """The forwarder for a flag's value; None (not given): nothing is forwarded."""
    return None if pattern is None else HeaderForward(pattern)
