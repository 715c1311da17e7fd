"""The lean HTTP/1.1 path: each request encoded once, as tritonclient.http would send it (the
KServe v2 binary-tensor body: JSON header, `Inference-Header-Content-Length`, raw bytes), and a
keep-alive connection that writes those bytes and reads back only what a measurement needs:
the status line, the body's length (`Content-Length`) and whether the server closes.

    LeanLoad ──send(i)──▶ HttpConnection ──pre-built bytes──▶ server
        ▲                     │ data_received ─▶ ResponseParser.feed
        └── done / failed ────┘   (status 200: done; else the server's "error" text)

The client's time split on this path: "send" is handing the pre-built bytes to the socket
(transport.write), "receive" is from the first byte of the response to its last; no output
is decoded (trireme perf does not validate outputs).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from services.perf.inputs import Sample
from services.perf.worker_core import WorkerSpec, now_ns

USER_AGENT = "trireme-perf"
MAX_HEAD = 64 * 1024   # a response head larger than this is not an inference response


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response this parser reads."""


def target(url: str, https: bool) -> tuple[str, int, str]:
    """(host, port, base path) of a `-u` value (host:port[/path]), as tritonclient reads it."""
    parts = urlsplit(("https://" if https else "http://") + url)
    host = parts.hostname or "localhost"
    return host, parts.port or (443 if https else 80), parts.path.rstrip("/")


def _infer_inputs(spec: WorkerSpec, sample: Sample) -> list[Any]:
    import tritonclient.http as httpclient  # type: ignore[import-untyped]
    dtypes = {t.name: t.datatype for t in spec.inputs}
    out = []
    for name, arr in sample.items():
        t = httpclient.InferInput(name, list(arr.shape), dtypes[name])
        t.set_data_from_numpy(arr, binary_data=not spec.input_json)
        out.append(t)
    return out


def http_request(spec: WorkerSpec, sample: Sample) -> bytes:
    """One whole request (head and body), the bytes tritonclient.http's infer() sends for
    these inputs and settings (its own encoder makes the body; the User-Agent is ours)."""
    import tritonclient.http as httpclient
    from tritonclient.http._utils import _get_inference_request  # type: ignore[import-untyped]
    outputs = [httpclient.InferRequestedOutput(t.name, binary_data=False)
               for t in spec.outputs] if spec.output_json else None
    body, json_size = _get_inference_request(
        inputs=_infer_inputs(spec, sample), request_id="", outputs=outputs, sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=None,
        custom_parameters=spec.parameters or None)
    host, port, base = target(spec.url, spec.ssl.https)
    path = f"v2/models/{quote(spec.model)}" + (f"/versions/{spec.version}" if spec.version
                                               else "") + "/infer"
    headers = {"User-Agent": USER_AGENT, **spec.headers}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    authority = f"[{host}]" if ":" in host else host
    headers["Host"] = authority if port in (80, 443) else f"{authority}:{port}"
    headers["Content-Length"] = str(len(body))
    head = f"POST {base}/{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in
                                                        headers.items()) + "\r\n"
    return head.encode("latin-1") + body


def _head(head: bytes) -> tuple[int, int, bool]:
    """(status, body length, the server closes after it) of a response head (no CRLFCRLF)."""
    if not head.startswith(b"HTTP/1.") or len(head) < 12 or head[8:9] != b" ":
        raise ProtocolError(f"not an HTTP/1.x response: {bytes(head[:40])!r}")
    try:
        status = int(head[9:12])
    except ValueError:
        raise ProtocolError(f"bad status line: {bytes(head[:40])!r}") from None
    low = head.lower()
    close = b"\r\nconnection: close" in low or \
        (head[7:8] == b"0" and b"\r\nconnection: keep-alive" not in low)
    if status < 200 or status in (204, 304):
        return status, 0, close
    i = low.find(b"\r\ncontent-length:")
    if i < 0:
        what = "chunked transfer encoding" if b"\r\ntransfer-encoding:" in low else \
            "no Content-Length"
        raise ProtocolError(f"a response with {what} (the lean HTTP path reads responses with "
                            "a Content-Length; use --load-impl tritonclient)")
    j = low.find(b"\r\n", i + 17)
    try:
        length = int(low[i + 17:j if j >= 0 else len(low)])
    except ValueError:
        raise ProtocolError("bad Content-Length") from None
    if length < 0:
        raise ProtocolError("bad Content-Length")
    return status, length, close


class ResponseParser:
    """Responses on one keep-alive connection, fed as the bytes come: calls
    ``on_response(status, body, close)`` for each whole one. ``body`` is kept only for a
    status other than 200 (the error's text), or with ``keep_body``; else a 200's body is
    counted, never copied. Interim (1xx) responses are skipped."""

    __slots__ = ("_body", "_buf", "_close", "_keep", "_left", "_status", "on_response")

    def __init__(self, on_response: Callable[[int, bytes | None, bool], None],
                 keep_body: bool = False) -> None:
        self.on_response = on_response
        self._keep = keep_body
        self._buf = b""                  # a head not yet whole
        self._left = -1                  # body bytes still to come; -1: reading a head
        self._status = 0
        self._close = False
        self._body: list[bytes] | None = None

    @property
    def idle(self) -> bool:
        """No response partly read."""
        return self._left < 0 and not self._buf

    def feed(self, data: bytes) -> None:
        while True:
            if self._left < 0:
                buf = self._buf + data if self._buf else data
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise ProtocolError(f"a response head over {MAX_HEAD} bytes")
                    self._buf = buf
                    return
                self._buf = b""
                status, length, close = _head(buf[:end])
                data = buf[end + 4:]
                if status < 200:
                    continue
                self._status, self._left, self._close = status, length, close
                self._body = None if status == 200 and not self._keep else []
            n = self._left
            if len(data) < n:
                if self._body is not None:
                    self._body.append(data)
                self._left = n - len(data)
                return
            body = None
            if self._body is not None:
                self._body.append(data[:n])
                body = b"".join(self._body)
                self._body = None
            self._left = -1
            self.on_response(self._status, body, self._close)
            data = data[n:]
            if not data:
                return


def error_text(status: int, body: bytes | None) -> str:
    """tritonclient's text for an error response: "[status] the server's error"."""
    try:
        msg = json.loads(body)["error"] if body else \
            "client received an empty response from the server."
    except (ValueError, KeyError, TypeError):
        msg = f"an exception occurred in the client while decoding the response: {body!r}"
    return f"[{status}] {msg}"


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection, one request in flight. ``done(conn, token, start, end,
    send_ns, recv_ns)`` when a request succeeded, ``failed(conn, token, text)`` when it did
    not (or the connection ended under it)."""

    capacity = 1

    def __init__(self, requests: list[bytes], done: Callable, failed: Callable) -> None:
        self.requests, self.done, self.failed = requests, done, failed
        self.transport: Any = None
        self.parser = ResponseParser(self._on_response)
        self.open = False
        self.in_flight = 0
        self.token: Any = None
        self.t0 = self.sent = self.first = self.now = 0

    # ---- asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport, self.open = transport, True

    def data_received(self, data: bytes) -> None:
        t = self.now = now_ns()
        if not self.first:
            self.first = t
        try:
            self.parser.feed(data)
        except ProtocolError as e:
            self._lost(str(e))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self.in_flight:
            self._lost(f"the server closed the connection{f': {exc}' if exc else ''}")

    # ---- the load's side
    def send(self, data: int, token: Any) -> None:
        self.token, self.in_flight, self.first = token, 1, 0
        t0 = now_ns()
        self.transport.write(self.requests[data])
        self.t0, self.sent = t0, now_ns() - t0

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def _on_response(self, status: int, body: bytes | None, close: bool) -> None:
        if close:
            self.close()
        if not self.in_flight:
            raise ProtocolError(f"a response ({status}) to no request")
        self.in_flight = 0
        if status == 200:
            self.done(self, self.token, self.t0, self.now, self.sent, self.now - self.first)
        else:
            self.failed(self, self.token, error_text(status, body))

    def _lost(self, text: str) -> None:
        self.close()
        if self.in_flight:
            self.in_flight = 0
            self.failed(self, self.token, text)
