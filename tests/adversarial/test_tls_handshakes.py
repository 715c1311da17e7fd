"""Failed TLS handshakes on the gRPC port of a real `trireme serve` (--grpc-use-ssl, the
native gRPC server): none may leave anything held in the frontend.

asyncio and uvloop call neither ``connection_made`` nor ``connection_lost`` on the protocol
of a connection whose TLS handshake fails: it exists only inside their SSL protocol. Measured
before the fix: the native gRPC server kept each connection from the protocol factory on (at
accept), so every failed handshake left one connection held for good (its HTTP/2 state,
receiver, guards and gate: about 6 KiB), 5 failed handshakes 5. Its socket was closed all
the same, so the fd count alone does not see that leak; the RSS across waves does.

Each wave opens, one after the other, GARBAGE raw TCP connections that send an HTTP/1.1
request instead of a ClientHello (the server answers with an alert and closes) and ABANDONED
ones that send a real ClientHello, read the server's first flight (the server now waits for
the client's Finished) and close mid-handshake, half with a FIN and half with a RST. Checked:

(a) the frontend's open fds, and its TCP connections on the gRPC port, come back to what
    they were before the waves (polled with a deadline);
(b) its RSS after the last wave is within RSS_GROWTH_LIMIT of its RSS after the first (the
    first warms the allocator and OpenSSL): connections held would grow it by about
    (WAVES - 1) x (GARBAGE + ABANDONED) x 6 KiB, 35 MiB;
(c) a tritonclient.grpc client over TLS gets exact answers before and after, on a connection
    kept open through the waves and on a new one;
(d) the server log holds no traceback.

Deterministic: no sleeps; every wait polls with a deadline.
"""
from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass

import models
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import trustme
from conftest import start_server

WAVES = 4
GARBAGE = 1000              # per wave
ABANDONED = 1000            # per wave
RSS_GROWTH_LIMIT = 12 << 20
IO_TIMEOUT_S = 10.0
SETTLE_S = 30.0             # deadline for the frontend to let go of what the waves opened
GARBAGE_BYTES = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@dataclass
class Pki:
    ca: str
    cert: str
    key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    return Pki(**{k: str(v) for k, v in paths.items()})


@pytest.fixture(scope="module")
def server(tmp_path_factory, pki):
    root = tmp_path_factory.mktemp("tls-handshakes") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    with start_server(root, "--grpc-impl", "native", "--grpc-use-ssl", "true",
                      "--grpc-server-cert", pki.cert, "--grpc-server-key", pki.key) as srv:
        yield srv


# ---- the attackers ----------------------------------------------------------------------------
def read_to_eof(sock: socket.socket) -> None:
    """Until the server closes (a RST counts): it has handled the connection then."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


def garbage(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as s:
        s.sendall(GARBAGE_BYTES)
        read_to_eof(s)


def abandoned(port: int, client: ssl.SSLContext, reset: bool) -> None:
    """A real ClientHello; once the server's first flight is here it waits for our Finished,
    which never comes: the connection closes mid-handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as s:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = client.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
        with pytest.raises(ssl.SSLWantReadError):
            tls.do_handshake()
        s.sendall(outgoing.read())
        assert s.recv(65536), "the server closed instead of answering a ClientHello"
        if reset:   # a RST rather than a FIN
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def wave(port: int, client: ssl.SSLContext) -> None:
    for i in range(max(GARBAGE, ABANDONED)):
        if i < GARBAGE:
            garbage(port)
        if i < ABANDONED:
            abandoned(port, client, reset=bool(i % 2))


# ---- what the frontend holds ------------------------------------------------------------------
def held(fe: psutil.Process, port: int) -> tuple[int, int]:
    """The frontend's open fds, and its TCP connections on the gRPC port (the listener aside)."""
    conns = sum(1 for c in fe.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN)
    return fe.num_fds(), conns


def settle(fe: psutil.Process, port: int, base: tuple[int, int]) -> tuple[int, int]:
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = held(fe, port)
        if now[0] <= base[0] and now[1] <= base[1]:
            return now
        assert time.monotonic() < deadline, (
            f"the frontend still holds {now[0]} fds and {now[1]} connections on the gRPC port "
            f"{SETTLE_S:.0f} s after the failed handshakes (before them: {base[0]} and {base[1]})")
        time.sleep(0.05)


def check_infer(client: grpcclient.InferenceServerClient, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.random((1, 16), dtype=np.float32), rng.random((1, 16), dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
              grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    r = client.infer("add_sub", inputs, client_timeout=IO_TIMEOUT_S)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def tls_client(srv, pki: Pki) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(srv.grpc_url, ssl=True, root_certificates=pki.ca)


# ---- the test ----------------------------------------------------------------------------------
def test_failed_handshakes_leave_nothing_held(server, pki):
    fe = server.frontend()
    port = server.grpc_port
    client_ctx = ssl.create_default_context(cafile=pki.ca)
    client_ctx.set_alpn_protocols(["h2"])
    kept = tls_client(server, pki)
    try:
        check_infer(kept, 0)            # (its connection stays open through the waves)
        base = held(fe, port)
        rss = []
        for _ in range(WAVES):
            wave(port, client_ctx)
            settle(fe, port, base)      # (a)
            rss.append(fe.memory_info().rss)
        growth = rss[-1] - rss[0]
        print(f"frontend RSS after each wave (MiB): {[round(r / 2**20, 1) for r in rss]}")
        assert growth < RSS_GROWTH_LIMIT, (                                         # (b)
            f"the frontend's RSS grew by {growth / 2**20:.1f} MiB over {WAVES - 1} waves of "
            f"{GARBAGE + ABANDONED} failed handshakes: it holds on to them")
        check_infer(kept, 1)            # (c)
        fresh = tls_client(server, pki)
        try:
            check_infer(fresh, 2)
        finally:
            fresh.close()
    finally:
        kept.close()
    assert "Traceback" not in server.log()   # (d)
