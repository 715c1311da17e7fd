"""TLS for both servers: the flags, their checks at start-up, and the server contexts.

gRPC takes Triton's flags with Triton's meaning (src/command_line_parser.cc,
src/grpc/grpc_server.cc): `--grpc-use-ssl <bool>` serves TLS with `--grpc-server-cert` and
`--grpc-server-key` (PEM files); `--grpc-use-ssl-mutual <bool>` turns TLS on too and requires
every client to present a certificate that verifies against `--grpc-root-cert`
(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY); without it no client
certificate is asked for and the root certificate is not used. Booleans as every Triton
flag: true/false, on/off, 1/0 (and yes/no, services/common/flags.py).

Triton has no HTTPS (its qa/L0_https puts nginx in front); HTTP takes the same five flags
under the `--http-` prefix (`--http-use-ssl`, `--http-use-ssl-mutual`, `--http-server-cert`,
`--http-server-key`, `--http-root-cert`), with the same meaning, so that one rule covers
both ports and a deployment switches a protocol by its prefix.

Where Triton says nothing, or stays silent on a mistake, we refuse to start, in words that
name the flag and the file: TLS on without a certificate or key; mutual TLS without a root
certificate (nothing to verify client certificates against); a file that is
missing, unreadable, not PEM, an encrypted key (Triton takes no passphrase; OpenSSL would
prompt on the terminal), a key that does not match the certificate. (Triton reads a file it
cannot open as empty and fails later, in grpc core's words.) Certificate or key files given
while TLS is off are ignored, as in Triton, with a warning.

The contexts: TLS 1.2 or later, AEAD cipher suites only for TLS 1.2 (RFC 9113 §9.2.2 bans
the others for HTTP/2; HTTPS gets the same list), no renegotiation (§9.2.1),
no compression, ALPN "h2" for gRPC and "http/1.1" for HTTP. The native gRPC server closes a
connection that did not select "h2" by ALPN, a client that offered none included
(RFC 9113 §3.3: HTTP/2 over TLS is negotiated by ALPN, prior knowledge is for cleartext
only; grpc core refuses such a peer the same way). The grpc.aio alternative gets the same
files as grpc.ssl_server_credentials. Plain text is untouched: with TLS off no context
exists and the servers are created exactly as before.
"""
from __future__ import annotations

import argparse
import logging
import ssl
from dataclasses import dataclass

from services.common.flags import parse_bool

log = logging.getLogger(__name__)

__all__ = ["TlsConfig", "TlsError", "TlsFiles", "add_tls_args", "describe", "load",
           "server_context", "tls_from_args"]

# TLS 1.2 suites allowed by RFC 9113 §9.2.2 (ephemeral key exchange, AEAD); TLS 1.3 suites
# are all AEAD and not affected by set_ciphers.
CIPHERS = "@SECLEVEL=2:ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL:!eNULL"


class TlsError(ValueError):
    """A TLS flag or file the server cannot start with; the text names both."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS of one protocol's server, as given by its flags (paths, not contents)."""
    protocol: str          # "grpc" or "http": names the flags in messages
    cert: str
    key: str
    root: str = ""
    mutual: bool = False

    def flag(self, what: str) -> str:
        return f"--{self.protocol}-{what}"


@dataclass(frozen=True)
class TlsFiles:
    """The PEM contents of a TlsConfig, read and checked (for grpc core's credentials)."""
    cert: bytes
    key: bytes
    root: bytes | None     # only with mutual TLS


# ---- flags ----------------------------------------------------------------------------------

def add_tls_args(p: argparse.ArgumentParser, protocol: str) -> list[argparse.Action]:
    """Triton's five gRPC TLS flags for ``protocol`` ("grpc" or "http"); returns the actions.
    The path flags default to "" (Triton's: no file), so `trireme serve` forwards them."""
    name = "gRPC" if protocol == "grpc" else "HTTP"
    extra = "" if protocol == "grpc" else " (ours: Triton serves no HTTPS)"
    return [
        p.add_argument(f"--{protocol}-use-ssl", type=parse_bool, default=False,
                       metavar="<boolean>",
                       help=f"serve {name} over TLS with --{protocol}-server-cert and "
                            f"--{protocol}-server-key (false){extra}"),
        p.add_argument(f"--{protocol}-use-ssl-mutual", type=parse_bool, default=False,
                       metavar="<boolean>",
                       help=f"serve {name} over TLS and require every client to present a "
                            f"certificate verified against --{protocol}-root-cert; implies "
                            f"--{protocol}-use-ssl (false)"),
        p.add_argument(f"--{protocol}-server-cert", default="", metavar="<file>",
                       help="file holding the PEM-encoded server certificate (chain)"),
        p.add_argument(f"--{protocol}-server-key", default="", metavar="<file>",
                       help="file holding the PEM-encoded, unencrypted server private key"),
        p.add_argument(f"--{protocol}-root-cert", default="", metavar="<file>",
                       help="file holding the PEM-encoded root certificate(s) that client "
                            f"certificates are verified against (--{protocol}-use-ssl-mutual)"),
    ]


def tls_from_args(args: argparse.Namespace, protocol: str) -> TlsConfig | None:
    """The TlsConfig of ``protocol`` from add_tls_args' flags; None when TLS is off. Checks
    the flags together (TlsError); the files are read by load / server_context."""
    p = protocol
    use, mutual = getattr(args, f"{p}_use_ssl", False), getattr(args, f"{p}_use_ssl_mutual", False)
    cert, key = getattr(args, f"{p}_server_cert", ""), getattr(args, f"{p}_server_key", "")
    root = getattr(args, f"{p}_root_cert", "")
    if not (use or mutual):
        given = [f"--{p}-{w}" for w, v in (("server-cert", cert), ("server-key", key),
                                           ("root-cert", root)) if v]
        if given:
            log.warning("%s given but --%s-use-ssl is false: %s is served in plain text",
                        ", ".join(given), p, "gRPC" if p == "grpc" else "HTTP")
        return None
    on = f"--{p}-use-ssl-mutual" if mutual else f"--{p}-use-ssl"
    missing = [f"--{p}-{w}" for w, v in (("server-cert", cert), ("server-key", key)) if not v]
    if missing:
        raise TlsError(f"{on} needs {' and '.join(missing)} (PEM files)")
    if mutual and not root:
        raise TlsError(f"{on} needs --{p}-root-cert: the PEM root certificate that client "
                       "certificates are verified against")
    return TlsConfig(p, cert, key, root if mutual else "", mutual)


# ---- files and contexts ---------------------------------------------------------------------

def _read(cfg: TlsConfig, what: str, path: str, marker: bytes, kind: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TlsError(f"{cfg.flag(what)}: cannot read '{path}': {e.strerror or e}") from None
    if marker not in data:
        raise TlsError(f"{cfg.flag(what)}: '{path}' holds no PEM {kind}")
    return data


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> str:
    raise _EncryptedKey


def server_context(cfg: TlsConfig, alpn: str) -> ssl.SSLContext:
    """A server SSLContext for ``cfg`` offering ``alpn`` ("h2" or "http/1.1"). Raises
    TlsError naming the flag and the file when one cannot be used."""
    _read(cfg, "server-cert", cfg.cert, b"-----BEGIN CERTIFICATE-----", "certificate")
    _read(cfg, "server-key", cfg.key, b"PRIVATE KEY-----", "private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_ciphers(CIPHERS)
    ctx.set_alpn_protocols([alpn])
    try:
        ctx.load_cert_chain(cfg.cert, cfg.key, password=_no_passphrase)
    except _EncryptedKey:
        raise TlsError(f"{cfg.flag('server-key')}: '{cfg.key}' is encrypted; give the key "
                       "unencrypted (no passphrase can be passed)") from None
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            text = (f"{cfg.flag('server-key')} '{cfg.key}' does not match the certificate in "
                    f"{cfg.flag('server-cert')} '{cfg.cert}'")
        else:
            text = (f"{cfg.flag('server-cert')} '{cfg.cert}' and {cfg.flag('server-key')} "
                    f"'{cfg.key}' cannot be used: {e}")
        raise TlsError(text) from None
    if cfg.mutual:
        _read(cfg, "root-cert", cfg.root, b"-----BEGIN CERTIFICATE-----", "certificate")
        try:
            ctx.load_verify_locations(cafile=cfg.root)
        except ssl.SSLError as e:
            raise TlsError(f"{cfg.flag('root-cert')}: '{cfg.root}' cannot be used: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def load(cfg: TlsConfig) -> TlsFiles:
    """The PEM contents of ``cfg``, checked as server_context checks them (TlsError)."""
    server_context(cfg, "h2")
    root = None
    if cfg.mutual:
        root = _read(cfg, "root-cert", cfg.root, b"-----BEGIN CERTIFICATE-----", "certificate")
    return TlsFiles(
        _read(cfg, "server-cert", cfg.cert, b"-----BEGIN CERTIFICATE-----", "certificate"),
        _read(cfg, "server-key", cfg.key, b"PRIVATE KEY-----", "private key"), root)


def describe(cfg: TlsConfig | None) -> str:
    """For the start-up log line: "", " (TLS)" or " (mutual TLS)"."""
    if cfg is None:
        return ""
    return " (mutual TLS)" if cfg.mutual else " (TLS)"
