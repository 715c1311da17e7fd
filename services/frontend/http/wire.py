"""HTTP/1.1 heads on the native server's wire, each piece decoded or built once and kept:
methods, header names and request targets as they arrive; status lines with their
Content-Type and the Date line as they leave. And what shapes an answer's writes: the size
sent in one joined write, the body buffers a connection keeps for its next body.
"""
from __future__ import annotations

import sys
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools

__all__ = ["HEADER_NAMES", "METHODS", "SMALL_WRITE", "SPARE_MAX", "SPARE_MIN", "UNSHARED_REFS",
           "date_line", "split_target", "status_prefix"]

SMALL_WRITE = 64 * 1024        # answers up to this size leave in one joined write
# A body buffer in this size range is kept by its connection for the next body of the same
# size: a fresh multi-MiB buffer costs a page fault per 4 KiB page (glibc maps it afresh)
# on every body. Dropped when the connection goes idle.
SPARE_MIN, SPARE_MAX = 256 * 1024, 16 * 1024 * 1024


def _unshared_refs() -> int:
    """What sys.getrefcount says of a buffer only a local variable holds (the interpreter's
    own count differs between Python versions)."""
    buf = bytearray(1)
    return sys.getrefcount(buf)


UNSHARED_REFS = _unshared_refs()


def date_line() -> bytes:
    now = int(time.time())
    if now != _DATE[0]:
        _DATE[0] = now
        _DATE[1] = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _DATE[1]


_DATE: list[Any] = [0, b""]
_PREFIXES: dict[tuple[int, str | None], bytes] = {}
METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS")}
HEADER_NAMES: dict[bytes, str] = {}      # header name as sent -> lower-case str (bounded below)
_TARGETS: dict[bytes, tuple[str, str]] = {}   # request target -> (path, query), bounded


def status_prefix(status: int, content_type: str | None) -> bytes:
    """Status line and Content-Type, built once per pair."""
    key = (status, content_type)
    prefix = _PREFIXES.get(key)
    if prefix is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        prefix = f"HTTP/1.1 {status} {reason}\r\n".encode()
        if content_type:
            prefix += f"Content-Type: {content_type}\r\n".encode("latin-1")
        if len(_PREFIXES) < 256:
            _PREFIXES[key] = prefix
    return prefix


def split_target(url: bytes) -> tuple[str, str]:
    """Request target -> (path as aiohttp's request.path gives it: percent-decoded, query)."""
    hit = _TARGETS.get(url)
    if hit is not None:
        return hit
    if url[:1] != b"/" and b"://" in url:       # absolute form: keep its path and query
        parsed = httptools.parse_url(url)
        raw_path, raw_query = parsed.path or b"/", parsed.query or b""
    else:
        raw_path, _, raw_query = url.partition(b"?")
    path = raw_path.decode("utf-8", "surrogateescape")
    if "%" in path:
        try:
            path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            pass                               # yarl keeps an invalid escape as it is
    hit = (path, raw_query.decode("latin-1"))
    if len(_TARGETS) >= 1024:
        _TARGETS.clear()
    _TARGETS[url] = hit
    return hit
