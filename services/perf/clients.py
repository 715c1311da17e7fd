"""The official tritonclient, made from the settings: HTTP (geventhttpclient) or gRPC (sync
or asyncio), TLS as the --ssl-* flags say; and `Control`, the one view of the calls the
tool makes besides inference (metadata, config, statistics, shared-memory registration)
whichever the protocol."""
from __future__ import annotations

from typing import Any

from services.perf.flags import SslSettings

TIMEOUT_S = 60.0


def _https_factory(ssl: SslSettings):
    """geventhttpclient's ssl_context_factory: a context for the --ssl-https-* flags."""
    def factory(cafile=None):   # (geventhttpclient offers its CA bundle: the flag's wins)
        import gevent.ssl  # type: ignore[import-untyped]
        # gevent's own SSLContext: gevent.ssl.create_default_context makes the standard
        # library's, whose blocking sockets stall every other greenlet of the process
        ctx = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_CLIENT)
        ca = ssl.https_ca_certificates_file or cafile
        if ca:
            ctx.load_verify_locations(cafile=ca)
        else:
            ctx.load_default_certs()
        if not ssl.https_verify_host or not ssl.https_verify_peer:
            ctx.check_hostname = False
        if not ssl.https_verify_peer:
            ctx.verify_mode = gevent.ssl.CERT_NONE
        if ssl.https_client_certificate_file:
            ctx.load_cert_chain(ssl.https_client_certificate_file, ssl.https_private_key_file)
        return ctx
    return factory


def http_client(url: str, ssl: SslSettings, concurrency: int = 1):
    import tritonclient.http as httpclient  # type: ignore[import-untyped]
    if not ssl.https:
        return httpclient.InferenceServerClient(url, concurrency=concurrency,
                                                connection_timeout=TIMEOUT_S,
                                                network_timeout=TIMEOUT_S)
    return httpclient.InferenceServerClient(
        url, concurrency=concurrency, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S,
        ssl=True, ssl_context_factory=_https_factory(ssl), insecure=not ssl.https_verify_peer)


def _grpc_tls(ssl: SslSettings) -> dict[str, Any]:
    if not ssl.grpc_use_ssl:
        return {}
    return {"ssl": True, "root_certificates": ssl.grpc_root_certifications_file or None,
            "private_key": ssl.grpc_private_key_file or None,
            "certificate_chain": ssl.grpc_certificate_chain_file or None}


def grpc_client(url: str, ssl: SslSettings):
    import tritonclient.grpc as grpcclient  # type: ignore[import-untyped]
    return grpcclient.InferenceServerClient(url, **_grpc_tls(ssl))


def grpc_aio_client(url: str, ssl: SslSettings):
    import tritonclient.grpc.aio as grpcaio  # type: ignore[import-untyped]
    return grpcaio.InferenceServerClient(url, **_grpc_tls(ssl))


class Control:
    """Metadata, config, statistics and shared-memory calls over the chosen protocol; every
    answer as the JSON the HTTP API gives (gRPC's int64 fields come back as strings: the
    readers take int() of every count)."""

    def __init__(self, protocol: str, url: str, ssl: SslSettings,
                 headers: dict[str, str] | None = None) -> None:
        self.protocol = protocol
        self.headers = headers or None
        self.client = http_client(url, ssl) if protocol == "http" else grpc_client(url, ssl)

    def _json(self, call, *args, **kwargs) -> Any:
        if self.protocol == "grpc":
            kwargs["as_json"] = True
        return call(*args, headers=self.headers, **kwargs)

    def server_metadata(self) -> dict:
        return self._json(self.client.get_server_metadata)

    def model_metadata(self, model: str, version: str) -> dict:
        return self._json(self.client.get_model_metadata, model, version)

    def model_config(self, model: str, version: str) -> dict:
        cfg = self._json(self.client.get_model_config, model, version)
        return cfg.get("config", cfg) if self.protocol == "grpc" else cfg

    def statistics(self, model: str = "", version: str = "") -> list[dict]:
        return self._json(self.client.get_inference_statistics, model, version).get(
            "model_stats", [])

    def register_system_shm(self, name: str, key: str, byte_size: int) -> None:
        self.client.register_system_shared_memory(name, key, byte_size, headers=self.headers)

    def unregister_system_shm(self, name: str) -> None:
        self.client.unregister_system_shared_memory(name, headers=self.headers)

    def close(self) -> None:
        self.client.close()
