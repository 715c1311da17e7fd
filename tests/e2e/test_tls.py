"""TLS end to end: a real `trireme serve` with Triton's gRPC TLS flags (--grpc-use-ssl,
--grpc-use-ssl-mutual, --grpc-server-cert, --grpc-server-key, --grpc-root-cert) and their
HTTP twins (--http-use-ssl, ...), the official tritonclient (gRPC: ssl=True with
root_certificates / private_key / certificate_chain, as Triton's qa/L0_secure_grpc runs
its clients; HTTP: ssl=True with ssl_context_factory, insecure=False), certificates made
here with trustme.

Four servers: both gRPC servers (native, aio) and both HTTP servers (native, aiohttp), each
with server-only TLS and with mutual TLS. On each: health and add_sub with exact outputs on
both protocols; a client without the CA, and (mutual) one without a certificate or with
another CA's, is refused; plain-text clients to the TLS ports fail cleanly while a TLS
client keeps being served; the log holds no traceback.
"""
from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import gevent.ssl
import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import trustme
from conftest import start_server
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

# (grpc impl, http impl, mutual)
SETUPS = [("native", "native", False), ("aio", "aiohttp", False),
          ("native", "native", True), ("aio", "aiohttp", True)]


@dataclass
class Pki:
    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str
    stranger_cert: str
    stranger_key: str
    other_ca: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client, stranger = ca.issue_cert("client.example"), other.issue_cert("client.example")
    paths = {}
    for name, blob in (("ca", ca.cert_pem), ("cert", server.cert_chain_pems[0]),
                       ("key", server.private_key_pem), ("client_cert", client.cert_chain_pems[0]),
                       ("client_key", client.private_key_pem),
                       ("stranger_cert", stranger.cert_chain_pems[0]),
                       ("stranger_key", stranger.private_key_pem), ("other_ca", other.cert_pem)):
        paths[name] = str(d / f"{name}.pem")
        blob.write_to_path(paths[name])
    return Pki(**paths)


def client_context(cafile: str, cert: tuple[str, str] | None = None,
                   module=ssl) -> ssl.SSLContext:
    ctx = module.create_default_context(cafile=cafile)
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: f"grpc-{s[0]}-http-{s[1]}"
                                                              f"{'-mutual' if s[2] else ''}")
def setup(request, pki, tmp_path_factory):
    grpc_impl, http_impl, mutual = request.param
    repo = tmp_path_factory.mktemp("tls") / "models"
    models.add_sub(repo / "add_sub")
    models.write_config(repo / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\n'
                        'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n')
    on = "true"
    flags = []
    for p in ("grpc", "http"):
        flags += [f"--{p}-use-ssl-mutual" if mutual else f"--{p}-use-ssl", on,
                  f"--{p}-server-cert", pki.cert, f"--{p}-server-key", pki.key,
                  f"--{p}-root-cert", pki.ca]
    probe = client_context(pki.ca, (pki.client_cert, pki.client_key) if mutual else None)
    with start_server(repo, "--grpc-impl", grpc_impl, "--http-impl", http_impl, *flags,
                      https=probe) as srv:
        yield srv, mutual


def grpc_client(srv, pki: Pki, cert: tuple[str, str] | None = None, ca: str | None = None,
                ssl_on: bool = True) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        srv.grpc_url, ssl=ssl_on, root_certificates=ca or pki.ca,
        private_key=cert[1] if cert else None, certificate_chain=cert[0] if cert else None)


def http_client(srv, pki: Pki, cert: tuple[str, str] | None = None, ca: str | None = None,
                ssl_on: bool = True) -> httpclient.InferenceServerClient:
    def factory(cafile=None):   # geventhttpclient passes its default CA bundle: ours instead
        return client_context(ca or pki.ca, cert, module=gevent.ssl)
    return httpclient.InferenceServerClient(
        srv.http_url, ssl=ssl_on, ssl_context_factory=factory, insecure=False,
        connection_timeout=10, network_timeout=10)


def own_cert(pki: Pki, mutual: bool) -> tuple[str, str] | None:
    return (pki.client_cert, pki.client_key) if mutual else None


def check_served(mod, client, seed: int = 0) -> None:
    """Health and add_sub with exact outputs."""
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("add_sub")
    rng = np.random.default_rng(seed)
    a, b = rng.random((2, 16), dtype=np.float32), rng.random((2, 16), dtype=np.float32)
    inputs = [mod.InferInput("INPUT0", [2, 16], "FP32"), mod.InferInput("INPUT1", [2, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_grpc_served_over_tls(setup, pki):
    srv, mutual = setup
    # Triton's qa/L0_secure_grpc client: --ssl --root-certificates --private-key
    # --certificate-chain, on both setups (a certificate the server does not ask for is fine)
    for cert in ((pki.client_cert, pki.client_key), own_cert(pki, mutual)):
        c = grpc_client(srv, pki, cert)
        try:
            check_served(grpcclient, c)
        finally:
            c.close()


def test_grpc_streaming_over_tls(setup, pki):
    srv, mutual = setup
    c = grpc_client(srv, pki, own_cert(pki, mutual))
    results = []
    done = threading.Event()

    def callback(result, error):
        results.append((result, error))
        if len(results) == 3:
            done.set()
    try:
        c.start_stream(callback)
        sent = []
        for i in range(3):
            a = np.full((1, 16), i, np.float32)
            ins = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
                   grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
            ins[0].set_data_from_numpy(a)
            ins[1].set_data_from_numpy(a)
            c.async_stream_infer("add_sub", ins, request_id=str(i))
            sent.append(a)
        assert done.wait(30)
        c.stop_stream()
    finally:
        c.close()
    for (result, error), a in zip(results, sent, strict=True):
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def test_grpc_refusals(setup, pki):
    srv, mutual = setup
    refused = [grpc_client(srv, pki, ca=pki.other_ca)]               # does not trust us
    if mutual:
        refused += [grpc_client(srv, pki),                            # no certificate
                    grpc_client(srv, pki, (pki.stranger_cert, pki.stranger_key))]  # other CA
    for c in refused:
        try:
            with pytest.raises(InferenceServerException) as info:
                c.is_server_live(client_timeout=10)
            assert info.value.status() == "StatusCode.UNAVAILABLE"
        finally:
            c.close()


def test_https_served(setup, pki):
    srv, mutual = setup
    c = http_client(srv, pki, own_cert(pki, mutual))
    try:
        check_served(httpclient, c, seed=1)
    finally:
        c.close()


def test_https_refusals(setup, pki):
    srv, mutual = setup
    refused = [http_client(srv, pki, ca=pki.other_ca)]
    if mutual:
        refused += [http_client(srv, pki),
                    http_client(srv, pki, (pki.stranger_cert, pki.stranger_key))]
    for c in refused:
        try:
            # refused in the handshake (SSLError), or, TLS 1.3, by an alert after it: the
            # connection closes before an answer
            with pytest.raises((ssl.SSLError, ConnectionError, HTTPConnectionClosed)):
                c.is_server_live()
        finally:
            c.close()


def test_plain_text_clients_fail_cleanly_and_hurt_no_one(setup, pki):
    """Plain-text clients, many of them, on both TLS ports while a TLS client keeps
    getting exact answers; then the log holds no traceback."""
    srv, mutual = setup
    cert = own_cert(pki, mutual)
    stop = threading.Event()
    errors: list[BaseException] = []
    served = [0]

    def tls_client():
        g, h = grpc_client(srv, pki, cert), http_client(srv, pki, cert)
        try:
            while not stop.is_set():
                check_served(grpcclient, g, served[0])
                check_served(httpclient, h, served[0])
                served[0] += 1
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            g.close()
            h.close()

    worker = threading.Thread(target=tls_client)
    worker.start()
    try:
        for _ in range(5):
            g = grpc_client(srv, pki, ssl_on=False)
            try:
                with pytest.raises(InferenceServerException) as info:
                    g.is_server_live(client_timeout=10)
                assert info.value.status() == "StatusCode.UNAVAILABLE"
            finally:
                g.close()
            h = httpclient.InferenceServerClient(srv.http_url, connection_timeout=10,
                                                 network_timeout=10)
            try:
                with pytest.raises((ConnectionError, HTTPConnectionClosed)):   # not a timeout
                    h.is_server_live()
            finally:
                h.close()
    finally:
        stop.set()
        worker.join(60)
    assert not errors, errors
    assert served[0] >= 1
    log = srv.log()
    assert "Traceback" not in log and not [x for x in log.splitlines() if x.startswith("E")], \
        log[-4000:]


def test_start_up_log_says_tls(setup):
    srv, mutual = setup
    mode = "(mutual TLS)" if mutual else "(TLS)"
    log = srv.log()
    assert any("Started GRPCInferenceService" in line and line.endswith(f'{mode}"')
               for line in log.splitlines()), log[-3000:]
    assert any("Started HTTPService" in line and line.endswith(f'{mode}"')
               for line in log.splitlines()), log[-3000:]


def test_certificate_files_are_checked_before_anything_starts(tmp_path, pki):
    """`trireme serve` refuses an unusable file at once, naming the flag and the file."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    for flags, text in (
        (["--grpc-use-ssl", "1", "--grpc-server-cert", pki.cert, "--grpc-server-key",
          str(tmp_path / "missing.key")],
         f"--grpc-server-key: cannot read '{tmp_path / 'missing.key'}': No such file or "
         "directory"),
        (["--http-use-ssl-mutual", "1", "--http-server-cert", pki.cert, "--http-server-key",
          pki.client_key, "--http-root-cert", pki.ca],
         f"--http-server-key '{pki.client_key}' does not match the certificate in "
         f"--http-server-cert '{pki.cert}'"),
    ):
        proc = subprocess.run([sys.executable, "-m", "services.cli", "serve",
                               "--model-repository", str(tmp_path), *flags],
                              cwd=root, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert text in proc.stderr
