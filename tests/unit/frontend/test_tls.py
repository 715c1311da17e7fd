"""TLS in one process (services/frontend/tls.py): the flags (Triton's --grpc-use-ssl family,
the same five under --http-), the start-up refusals in words, and both servers of each
protocol over TLS: ALPN "h2" required on the native gRPC server, mutual TLS, a plain-text
client refused without hurting the others, and the handshake / header / body timeouts
counting under TLS. Certificates are made here with trustme. The real `trireme serve` with
the official clients: tests/e2e/test_tls.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme

from protos import grpc_service_pb2 as pb
from services.frontend import tls
from services.frontend.grpc.h2_frames import PREFACE, SETTINGS, frame_header
from services.frontend.grpc.limits import GrpcLimits
from services.frontend.grpc.methods import start_grpc
from services.frontend.http.engine import NativeHttpServer
from services.frontend.http.message import Reply
from services.frontend.http.routes import start_http
from services.frontend.main import add_frontend_args, checked_settings, frontend_argv, settings_from_args
from services.frontend.settings import FrontendSettings
from services.frontend.tls import TlsConfig, TlsError
from tests.unit.frontend.test_grpc_codec import FakeDataPlane, echo_request, method
from tests.unit.frontend.test_http1 import FakeDataPlane as HttpDataPlane
from tests.unit.frontend.test_http1 import infer_body, post, response


@dataclass
class Pki:
    dir: Path
    ca: Path           # root certificate (clients trust it; --*-root-cert)
    cert: Path         # server certificate chain, for localhost and 127.0.0.1
    key: Path
    client_cert: Path  # a client certificate issued by the same CA
    client_key: Path
    stranger_cert: Path  # a client certificate from another CA
    stranger_key: Path

    def config(self, protocol: str = "grpc", mutual: bool = False) -> TlsConfig:
        return TlsConfig(protocol, str(self.cert), str(self.key),
                         str(self.ca) if mutual else "", mutual)

    def client_context(self, alpn: list[str] | None = None, cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if alpn:
            ctx.set_alpn_protocols(alpn)
        if cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx

    def grpc_credentials(self, cert: Path | None = None, key: Path | None = None):
        return grpc.ssl_channel_credentials(
            self.ca.read_bytes(), key.read_bytes() if key else None,
            cert.read_bytes() if cert else None)


def make_pki(where: Path) -> Pki:
    where.mkdir(parents=True, exist_ok=True)
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("client.example")
    stranger = other.issue_cert("client.example")
    files = {}
    for name, blob in (("ca.pem", ca.cert_pem), ("server.pem", server.cert_chain_pems[0]),
                       ("server.key", server.private_key_pem),
                       ("client.pem", client.cert_chain_pems[0]),
                       ("client.key", client.private_key_pem),
                       ("stranger.pem", stranger.cert_chain_pems[0]),
                       ("stranger.key", stranger.private_key_pem)):
        files[name] = where / name
        blob.write_to_path(str(files[name]))
    return Pki(where, files["ca.pem"], files["server.pem"], files["server.key"],
               files["client.pem"], files["client.key"], files["stranger.pem"],
               files["stranger.key"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_frontend_args(p)
    return p


def run(body, timeout: float = 30) -> None:
    async def main():
        async with asyncio.timeout(timeout):
            await body()
    asyncio.run(main())


# ---- flags ------------------------------------------------------------------------------------

def test_tls_is_off_by_default_and_every_flag_is_forwarded():
    args = _parser().parse_args([])
    settings = settings_from_args(args, "unix:///s")
    assert settings.grpc_tls is None and settings.http_tls is None
    forwarded = frontend_argv(args)
    for p in ("grpc", "http"):
        for flag in ("use-ssl", "use-ssl-mutual", "server-cert", "server-key", "root-cert"):
            assert f"--{p}-{flag}" in forwarded


@pytest.mark.parametrize("argv, grpc_tls, http_tls", [
    # Triton's value syntax: --flag=value or --flag value; true/false, on/off, 1/0, any case
    (["--grpc-use-ssl=1", "--grpc-server-cert", "c", "--grpc-server-key=k",
      "--grpc-root-cert", "r"],
     TlsConfig("grpc", "c", "k"), None),           # the root certificate serves mutual only
    (["--grpc-use-ssl-mutual", "ON", "--grpc-server-cert", "c", "--grpc-server-key", "k",
      "--grpc-root-cert", "r"],
     TlsConfig("grpc", "c", "k", "r", True), None),  # mutual implies --grpc-use-ssl
    (["--grpc-use-ssl", "true", "--grpc-use-ssl-mutual", "false", "--grpc-server-cert", "c",
      "--grpc-server-key", "k"], TlsConfig("grpc", "c", "k"), None),
    (["--http-use-ssl", "True", "--http-server-cert", "c", "--http-server-key", "k"],
     None, TlsConfig("http", "c", "k")),
    (["--http-use-ssl-mutual=1", "--http-server-cert", "c", "--http-server-key", "k",
      "--http-root-cert", "r", "--grpc-use-ssl=0", "--grpc-server-cert", "c"],
     None, TlsConfig("http", "c", "k", "r", True)),
    # TLS flags of a protocol that is not served are not looked at
    (["--allow-grpc", "false", "--grpc-use-ssl", "1"], None, None),
])
def test_flags_to_settings_and_through_trireme_serve(argv, grpc_tls, http_tls):
    p = _parser()
    args = p.parse_args(argv)
    settings = settings_from_args(args, "unix:///s")
    assert (settings.grpc_tls, settings.http_tls) == (grpc_tls, http_tls)
    again = p.parse_args(frontend_argv(args))        # what `trireme serve` hands on
    assert vars(again) == vars(args)
    assert settings_from_args(again, "unix:///s") == settings


def test_a_boolean_flag_takes_a_value_as_in_triton():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--grpc-use-ssl", "maybe"])


@pytest.mark.parametrize("argv, text", [
    (["--grpc-use-ssl", "1"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key "
                              "(PEM files)"),
    (["--grpc-use-ssl", "1", "--grpc-server-cert", "c"],
     "--grpc-use-ssl needs --grpc-server-key (PEM files)"),
    (["--grpc-use-ssl-mutual", "1", "--grpc-server-cert", "c", "--grpc-server-key", "k"],
     "--grpc-use-ssl-mutual needs --grpc-root-cert: the PEM root certificate that client "
     "certificates are verified against"),
    (["--http-use-ssl", "1", "--http-server-key", "k"],
     "--http-use-ssl needs --http-server-cert (PEM files)"),
])
def test_missing_flags_are_refused_in_words(argv, text):
    with pytest.raises(TlsError) as info:
        settings_from_args(_parser().parse_args(argv), "unix:///s")
    assert str(info.value) == text


def test_files_without_tls_are_ignored_with_a_warning(caplog):
    args = _parser().parse_args(["--http-server-cert", "c", "--http-server-key", "k"])
    assert settings_from_args(args, "unix:///s").http_tls is None
    assert "--http-server-cert, --http-server-key given but --http-use-ssl is false: HTTP is " \
           "served in plain text" in caplog.text


def _bad_files(pki: Pki) -> list[tuple[str, dict, str]]:
    d = pki.dir
    from cryptography.hazmat.primitives import serialization
    key = serialization.load_pem_private_key(pki.key.read_bytes(), None)
    (d / "encrypted.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    (d / "empty.pem").write_bytes(b"")
    (d / "garbled.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n"
                                    b"-----END CERTIFICATE-----\n")
    missing = str(d / "missing.pem")
    return [
        ("missing cert", {"cert": missing},
         f"--grpc-server-cert: cannot read '{missing}': No such file or directory"),
        ("directory", {"key": str(d)}, f"--grpc-server-key: cannot read '{d}': Is a directory"),
        ("key as cert", {"cert": str(pki.key)},
         f"--grpc-server-cert: '{pki.key}' holds no PEM certificate"),
        ("cert as key", {"key": str(pki.cert)},
         f"--grpc-server-key: '{pki.cert}' holds no PEM private key"),
        ("encrypted key", {"key": str(d / "encrypted.key")},
         f"--grpc-server-key: '{d / 'encrypted.key'}' is encrypted; give the key unencrypted "
         "(no passphrase can be passed)"),
        ("another key", {"key": str(pki.client_key)},
         f"--grpc-server-key '{pki.client_key}' does not match the certificate in "
         f"--grpc-server-cert '{pki.cert}'"),
        ("garbled cert", {"cert": str(d / "garbled.pem")},
         f"--grpc-server-cert '{d / 'garbled.pem'}' and --grpc-server-key '{pki.key}' cannot "
         "be used: "),
        ("missing root", {"root": missing},
         f"--grpc-root-cert: cannot read '{missing}': No such file or directory"),
        ("empty root", {"root": str(d / "empty.pem")},
         f"--grpc-root-cert: '{d / 'empty.pem'}' holds no PEM certificate"),
        ("garbled root", {"root": str(d / "garbled.pem")},
         f"--grpc-root-cert: '{d / 'garbled.pem'}' cannot be used: "),
    ]


def test_unusable_files_are_refused_in_words(pki):
    for what, change, text in _bad_files(pki):
        cfg = pki.config(mutual=True)
        cfg = TlsConfig("grpc", change.get("cert", cfg.cert), change.get("key", cfg.key),
                        change.get("root", cfg.root), True)
        for build in (lambda c=cfg: tls.server_context(c, "h2"), lambda c=cfg: tls.load(c)):
            with pytest.raises(TlsError) as info:
                build()
            assert str(info.value).startswith(text), what
            assert (str(info.value) == text) != text.endswith(": "), what


def test_the_contexts(pki):
    ctx = tls.server_context(pki.config(), "h2")
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE                  # no client certificate asked for
    assert ctx.options & ssl.OP_NO_RENEGOTIATION and ctx.options & ssl.OP_NO_COMPRESSION
    tls12 = [c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12 and all("GCM" in c or "CHACHA20" in c for c in tls12)   # RFC 9113 §9.2.2
    assert tls.server_context(pki.config(mutual=True), "h2").verify_mode == ssl.CERT_REQUIRED
    files = tls.load(pki.config(mutual=True))
    assert (files.cert, files.key, files.root) == (pki.cert.read_bytes(), pki.key.read_bytes(),
                                                   pki.ca.read_bytes())
    assert tls.load(pki.config()).root is None


def test_the_frontend_and_trireme_serve_refuse_to_start(pki, tmp_path, caplog):
    missing = tmp_path / "nope.key"
    argv = ["--grpc-use-ssl", "1", "--grpc-server-cert", str(pki.cert),
            "--grpc-server-key", str(missing)]
    text = f"--grpc-server-key: cannot read '{missing}': No such file or directory"
    with pytest.raises(TlsError, match="cannot read"):
        checked_settings(_parser().parse_args(argv), "unix:///s")
    from services.cli import main as trireme
    start = time.monotonic()
    assert trireme(["serve", "--model-repository", str(tmp_path), *argv]) == 2
    assert time.monotonic() - start < 5 and text in caplog.text
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "services.frontend.main", "--scheduler",
                           "unix:///nowhere", *argv], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 2 and f"error: {text}" in proc.stderr


# ---- gRPC over TLS ---------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def grpc_server(pki: Pki, impl: str = "native", mutual: bool = False,
                      limits: GrpcLimits | None = None):
    dp = FakeDataPlane()
    settings = FrontendSettings(scheduler_addr="", host="127.0.0.1", grpc_port=0, grpc_impl=impl,
                                grpc_tls=pki.config("grpc", mutual),
                                grpc_limits=limits or GrpcLimits())
    server = await start_grpc(dp, settings)
    try:
        yield server
    finally:
        await server.stop(None)


async def _grpc_served(port: int, creds) -> None:
    """Health and an inference with exact outputs, over a fresh TLS channel."""
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
        health = ch.unary_unary("/grpc.health.v1.Health/Check")
        assert await health(b"", timeout=10) == b"\x08\x01"
        infer = method(ch, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        resp = await infer(echo_request("m", "tls", n=3), timeout=10)
        assert resp.id == "tls" and resp.outputs[0].name == "OUTPUT0"
        assert resp.raw_output_contents[0] == np.array([1, 2, 3], "<i4").tobytes()
        big = echo_request("m", "big", n=500_000)      # 2 MB each way: flow control over TLS
        resp = await infer(big, timeout=20)
        assert resp.raw_output_contents == big.raw_input_contents


async def _grpc_refused(port: int, creds) -> grpc.aio.AioRpcError:
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
        health = ch.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health(b"", timeout=10, wait_for_ready=False)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return info.value


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_over_tls(pki, impl):
    async def body():
        async with grpc_server(pki, impl) as server:
            port = server.trireme_port
            await _grpc_served(port, pki.grpc_credentials())
            # no client certificate is asked for; one presented is not in the way
            await _grpc_served(port, pki.grpc_credentials(pki.stranger_cert, pki.stranger_key))
            # a client that does not trust the server's CA gives up
            await _grpc_refused(port, grpc.ssl_channel_credentials(
                trustme.CA().cert_pem.bytes()))
            # a plain-text client: refused, and TLS clients are served all along
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            await _grpc_served(port, pki.grpc_credentials())
    run(body)


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_mutual_tls(pki, impl):
    async def body():
        async with grpc_server(pki, impl, mutual=True) as server:
            port = server.trireme_port
            await _grpc_refused(port, pki.grpc_credentials())                 # no certificate
            await _grpc_refused(port, pki.grpc_credentials(pki.stranger_cert,  # another CA's
                                                           pki.stranger_key))
            await _grpc_served(port, pki.grpc_credentials(pki.client_cert, pki.client_key))
    run(body)


async def _tls_connect(port: int, ctx: ssl.SSLContext):
    return await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")


async def _all_until_close(reader: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError, ssl.SSLError):
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                out += chunk
    return out


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_grpc_requires_alpn_h2(pki, impl):
    """RFC 9113 §3.3: HTTP/2 over TLS is negotiated by ALPN. A client that offers another
    protocol, or none, is closed after the handshake before a byte is sent; one that offers
    h2 gets our SETTINGS. grpc core (the aio server) does the same."""
    async def body():
        async with grpc_server(pki, impl) as server:
            port = server.trireme_port
            for alpn in (["http/1.1"], None):
                reader, writer = await _tls_connect(port, pki.client_context(alpn))
                assert writer.get_extra_info("ssl_object").selected_alpn_protocol() is None
                writer.write(PREFACE + frame_header(0, SETTINGS, 0, 0))
                assert await _all_until_close(reader) == b""
                writer.close()
            reader, writer = await _tls_connect(port, pki.client_context(["h2"]))
            assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
            writer.write(PREFACE + frame_header(0, SETTINGS, 0, 0))
            head = await asyncio.wait_for(reader.readexactly(9), 5)
            assert head[3] == SETTINGS
            writer.close()
            await _grpc_served(port, pki.grpc_credentials())
    run(body)


def test_native_grpc_handshake_timeout_covers_tls(pki):
    """One budget (--grpc-handshake-timeout-secs) for the TLS handshake and the HTTP/2
    preface: a client silent from the start, and one that completes TLS late and then says
    nothing, are both closed within it (not a fresh budget after TLS)."""
    async def body():
        limits = GrpcLimits(handshake_timeout_s=0.8)
        async with grpc_server(pki, limits=limits) as server:
            port = server.trireme_port
            start = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)   # no ClientHello
            assert await _all_until_close(reader) == b""
            assert 0.7 < time.monotonic() - start < 3
            writer.close()
            got, elapsed = await asyncio.to_thread(_late_tls_then_silence, pki, port, 0.5,
                                                   ["h2"])
            assert got[3] == SETTINGS                  # our preamble, then the close
            assert 0.7 < elapsed < 1.2, elapsed        # 0.8 s in all, not 0.5 + 0.8
            await _grpc_served(port, pki.grpc_credentials())
    run(body)


# ---- HTTPS ------------------------------------------------------------------------------------

async def _echo(req) -> Reply:
    body = await req.read()
    return Reply(200, b"%d" % len(body), "text/plain")


async def _https_served(port: int, ctx: ssl.SSLContext) -> None:
    reader, writer = await _tls_connect(port, ctx)
    writer.write(post("/x", b"hello"))
    status, _, body = await asyncio.wait_for(response(reader), 5)
    assert (status, body) == (200, b"5")
    writer.close()


def test_native_https_keeps_its_timeouts(pki):
    async def body():
        server = NativeHttpServer(_echo, 8 << 20, header_timeout=0.5, body_timeout=0.5)
        await server.start("127.0.0.1", 0, tls.server_context(pki.config("http"), "http/1.1"))
        port = server.port
        client = pki.client_context(["http/1.1"])
        try:
            await _https_served(port, client)
            reader, writer = await _tls_connect(port, client)
            writer.write(post("/x", b"y" * (3 << 20)))   # a 3 MiB body over TLS
            assert (await asyncio.wait_for(response(reader), 10))[2] == b"%d" % (3 << 20)
            writer.close()
            # ALPN: http/1.1 selected; a client offering none is served too
            reader, writer = await _tls_connect(port, client)
            assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
            writer.close()
            await _https_served(port, pki.client_context())
            # header timeout: a head trickling in over TLS is 408 and closed
            reader, writer = await _tls_connect(port, client)
            start = time.monotonic()
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\n")
            await _https_served(port, client)
            answer = await _all_until_close(reader)
            assert time.monotonic() - start < 3
            assert b" 408 " in answer.split(b"\r\n")[0]
            assert b"request head not received within 0.5 s (--http-header-timeout-secs)" in answer
            writer.close()
            # body timeout
            reader, writer = await _tls_connect(port, client)
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\nxx")
            answer = await _all_until_close(reader)
            assert b"request body not received within 0.5 s (--http-body-timeout-secs)" in answer
            writer.close()
            # no TLS handshake at all: cut at the header timeout (ssl_handshake_timeout)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start = time.monotonic()
            assert await _all_until_close(reader) == b""
            assert time.monotonic() - start < 3
            writer.close()
            # a plain-text request: the handshake fails, nothing is answered, others served
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/x", b"hello"))
            assert b"HTTP/1.1 200" not in await _all_until_close(reader)
            writer.close()
            await _https_served(port, client)
            assert server.counters["header_timeouts"] == 1
            assert server.counters["body_timeouts"] == 1
        finally:
            await server.stop(1.0)
    run(body)


def _late_tls_then_silence(pki: Pki, port: int, delay: float, alpn: list[str]
                           ) -> tuple[bytes, float]:
    """Connect, wait ``delay`` before the ClientHello, complete TLS, send nothing: what the
    server sends before it closes, and when it closed (from the connect)."""
    with socket.create_connection(("127.0.0.1", port)) as raw:
        start = time.monotonic()
        time.sleep(delay)
        with pki.client_context(alpn).wrap_socket(raw, server_hostname="localhost") as s:
            got = b""
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while chunk := s.recv(65536):
                    got += chunk
            return got, time.monotonic() - start


def test_native_https_handshake_counts_against_the_header_timeout(pki):
    async def body():
        server = NativeHttpServer(_echo, 1 << 20, header_timeout=0.8)
        await server.start("127.0.0.1", 0, tls.server_context(pki.config("http"), "http/1.1"))
        try:
            got, elapsed = await asyncio.to_thread(_late_tls_then_silence, pki, server.port,
                                                   0.5, ["http/1.1"])
            assert got == b""                          # an empty connection just closes
            assert 0.7 < elapsed < 1.2, elapsed        # 0.8 s in all, not 0.5 + 0.8
            await _https_served(server.port, pki.client_context())
        finally:
            await server.stop(1.0)
    run(body)


@pytest.mark.parametrize("impl", ["native", "aiohttp"])
@pytest.mark.parametrize("mutual", [False, True])
def test_https_routes(pki, impl, mutual):
    """The Triton routes over HTTPS on both servers; with mutual TLS a client without a
    certificate of our CA gets no answer."""
    async def body():
        dp = HttpDataPlane()
        server = await start_http(dp, FrontendSettings(
            "", host="127.0.0.1", http_port=0, http_impl=impl, http_body_timeout_secs=0.5,
            http_tls=pki.config("http", mutual)))
        try:
            ctx = pki.client_context(cert=mutual)
            reader, writer = await _tls_connect(server.port, ctx)
            writer.write(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await asyncio.wait_for(response(reader), 5))[0] == 200
            writer.write(post("/v2/models/m/infer", infer_body([1.5, 2.5])))
            status, _, answer = await asyncio.wait_for(response(reader), 5)
            assert status == 200 and b'"data":[1.5,2.5]' in answer.replace(b" ", b"")
            # the body timeout holds under TLS
            writer.write(post("/v2/models/m/infer", infer_body([1.0]))[:-5])
            answer = await _all_until_close(reader)
            assert b"request body not received within 0.5 s (--http-body-timeout-secs)" in answer
            writer.close()
            if mutual:                   # no certificate, then one from another CA
                for cert in (None, (pki.stranger_cert, pki.stranger_key)):
                    ctx = pki.client_context()
                    if cert:
                        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
                    with contextlib.suppress(ssl.SSLError, ConnectionError):
                        reader, writer = await _tls_connect(server.port, ctx)
                        writer.write(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n")
                        assert await _all_until_close(reader) == b""
                        writer.close()
            await _https_served_routes(server.port, pki.client_context(cert=mutual))
        finally:
            await server.stop(1.0)
    run(body)


async def _https_served_routes(port: int, ctx: ssl.SSLContext) -> None:
    reader, writer = await _tls_connect(port, ctx)
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (await asyncio.wait_for(response(reader), 5))[0] == 200
    writer.close()


def test_plain_text_serving_builds_no_context(monkeypatch):
    """No cost to plain text: with TLS off, no context is made and create_server gets no ssl
    argument (nor ssl_handshake_timeout)."""
    made = []
    monkeypatch.setattr(tls, "server_context", lambda *a: made.append(a))
    seen = []

    async def body():
        loop = asyncio.get_running_loop()
        real = loop.create_server

        async def spy(*args, **kw):
            seen.append(kw)
            return await real(*args, **kw)
        loop.create_server = spy                       # type: ignore[method-assign]
        grpc_srv = await start_grpc(FakeDataPlane(), FrontendSettings(
            "", host="127.0.0.1", grpc_port=0))
        http_srv = await start_http(HttpDataPlane(), FrontendSettings(
            "", host="127.0.0.1", http_port=0))
        await grpc_srv.stop(None)
        await http_srv.stop(1.0)
    run(body)
    assert made == []
    assert len(seen) == 2 and all("ssl" not in kw and "ssl_handshake_timeout" not in kw
                                  for kw in seen)
