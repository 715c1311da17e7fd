"""The Redis response cache (`--cache-config redis,host=H --cache-config redis,port=P`, with
Triton's other settings), for ResponseCache (response_cache.py): one Redis shared by every
replica of a server, so a response one computed answers the others' requests.

Triton's settings and texts (its redis_cache): host and port are required; user (default
"default", or TRITONCACHE_REDIS_USERNAME), password (or TRITONCACHE_REDIS_PASSWORD; the
config wins), db, connect_timeout and socket_timeout in ms (0: none), pool_size,
wait_timeout, tls_enabled with cert, key, cacert (cacert_dir and sni, which redis-py lacks,
are refused). The server pings Redis at start-up and
does not start without it. Serving, a Redis that is gone or slow makes lookups misses and
insertions logged failures, never failed requests; the client reconnects by itself.

Keys are namespaced ("trireme:<repositories' digest>:<key>"): two servers of the same
repositories share entries, two repositories sharing one Redis cannot collide. A value is
the outputs' names, datatypes, shapes and bytes (msgpack). Entries never expire (as
Triton's); Redis's own maxmemory policy bounds them.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from services.common import messages as m

log = logging.getLogger("trireme.cache")

USERNAME_ENV = "TRITONCACHE_REDIS_USERNAME"
PASSWORD_ENV = "TRITONCACHE_REDIS_PASSWORD"
ADDRESS_TEXT = ("Failed to initialize RedisCache, didn't specify address. Must at a minimum "
                "specify 'host' and 'port' in the configuration - e.g. tritonserver "
                "--cache-config redis,host=redis --cache-config redis,port=6379 "
                "--model-repository=/models ...")


class _Value(msgspec.Struct, array_like=True):
    outputs: list[m.TensorRef]
    data: list[bytes]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Value)


def namespace(repositories: Sequence[Any]) -> str:
    """The key prefix of servers of these repositories."""
    digest = hashlib.blake2b(",".join(sorted(str(r) for r in repositories)).encode(),
                             digest_size=8).hexdigest()
    return f"trireme:{digest}:"


def client_options(settings: dict[str, str]) -> dict[str, Any]:
    """redis-py's options from Triton's settings; raises ValueError with Triton's text."""
    if "host" not in settings or "port" not in settings:
        raise ValueError(ADDRESS_TEXT)
    unsupported = sorted({"cacert_dir", "sni"} & set(settings))
    if unsupported:   # (redis-py has no such options: refused rather than ignored)
        raise ValueError(f"Failed to initialize RedisCache: the {' and '.join(unsupported)} "
                         "setting is not supported here")

    def seconds(name: str) -> float | None:
        ms = int(settings.get(name, "0") or 0)
        return ms / 1000 if ms > 0 else None
    opts: dict[str, Any] = {
        "host": settings["host"], "port": _atoi(settings["port"]),
        "username": settings.get("user") or os.environ.get(USERNAME_ENV) or None,
        "password": settings.get("password") or os.environ.get(PASSWORD_ENV) or None,
        "db": int(settings.get("db", "0") or 0),
        "socket_connect_timeout": seconds("connect_timeout"),
        "socket_timeout": seconds("socket_timeout"),
        "max_connections": int(settings.get("pool_size", "1") or 1),
        # RESP2, as Triton's client: an AUTH (or none) then commands, so Redis's own refusals
        # (NOAUTH, WRONGPASS) are what the first command gets
        "protocol": 2,
    }
    # (how long a lookup waits for a free connection of the pool: Triton's default 1 s)
    if settings.get("tls_enabled") == "true":
        opts.update(ssl=True, ssl_certfile=settings.get("cert"), ssl_keyfile=settings.get("key"),
                    ssl_ca_certs=settings.get("cacert"))
    return opts


def _triton_words(e: Exception, options: dict[str, Any]) -> str:
    """redis-py's error in the words of Triton's client (redis-plus-plus): Redis's reply
    with its code, or "Failed to connect to Redis (host:port): <why>"."""
    import redis
    text = str(e)
    if isinstance(e, redis.AuthenticationError):
        code = "NOAUTH" if "required" in text.lower() else "WRONGPASS"
        return f"{code} {text}"
    if isinstance(e, redis.ConnectionError):
        hit = re.match(r"Error -?\d+ connecting to (\S+?)\. (.+?)\.?$", text)
        if hit:
            return f"Failed to connect to Redis ({hit.group(1)}): {hit.group(2)}"
        return f"Failed to connect to Redis ({options['host']}:{options['port']}): {text}"
    return text


def _atoi(text: str) -> int:
    """C's atoi, as Triton reads the port: the leading digits, else 0."""
    digits = re.match(r"\s*([+-]?\d+)", text)
    return int(digits.group(1)) if digits else 0


class RedisCache:
    """A ResponseCache backend whose lookups and insertions are awaited."""

    def __init__(self, options: dict[str, Any], prefix: str, wait_s: float = 1.0) -> None:
        self._options = options
        self._wait_s = wait_s
        self._prefix = prefix.encode()
        self._client: Any = None   # redis.asyncio.Redis, made on the serving loop
        self.lookups = self.hits = self.misses = 0
        # The lookups of one event-loop turn, by key: fetched together, one MGET (a round
        # trip each would queue them behind pool_size connections)
        self._batch: dict[bytes, list[asyncio.Future]] | None = None

    @classmethod
    def connect(cls, settings: dict[str, str], prefix: str) -> RedisCache:
        """Check that Redis answers (Triton does not start without it); raises ValueError
        (the settings) or RuntimeError (no answer) with Triton's text."""
        import redis
        options = client_options(settings)
        wait_s = int(settings.get("wait_timeout", "1000") or 1000) / 1000
        try:
            client = redis.Redis(**{**options, "socket_connect_timeout":
                                    options["socket_connect_timeout"] or 5.0})
            try:
                client.ping()
            finally:
                client.close()
        except redis.RedisError as e:
            raise RuntimeError(f"Failed to initialize RedisCache: {_triton_words(e, options)}") \
                from None
        return cls(options, prefix, wait_s)

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio
            options = dict(self._options)
            size = options.pop("max_connections")
            if options.pop("ssl", False):
                options["connection_class"] = redis.asyncio.SSLConnection
            # pool_size connections; a lookup waits wait_timeout for one, then misses
            pool = redis.asyncio.BlockingConnectionPool(max_connections=size,
                                                        timeout=self._wait_s, **options)
            self._client = redis.asyncio.Redis(connection_pool=pool)
        return self._client

    async def lookup(self, key: bytes) -> tuple[list[m.TensorRef], list[bytes]] | None:
        self.lookups += 1
        loop = asyncio.get_running_loop()
        found: asyncio.Future = loop.create_future()
        if self._batch is None:
            self._batch = {}
            loop.create_task(self._fetch())   # (runs once this turn's lookups have joined)
        self._batch.setdefault(key, []).append(found)
        raw = await found
        if raw is None:
            self.misses += 1
            return None
        try:
            value = _decoder.decode(raw)
        except msgspec.DecodeError as e:   # not ours, or another version's
            log.warning("Failed to retrieve key: %s: %s", key.hex(), e)
            self.misses += 1
            return None
        self.hits += 1
        return value.outputs, value.data

    async def _fetch(self) -> None:
        import redis
        batch, self._batch = self._batch or {}, None
        keys = list(batch)
        try:
            raws = await self._redis().mget([self._prefix + k for k in keys])
        except (redis.RedisError, OSError) as e:
            for k in keys:
                log.warning("Failed to retrieve key: %s: %s", k.hex(), e)
            raws = [None] * len(keys)
        for k, raw in zip(keys, raws):
            for f in batch[k]:
                if not f.done():
                    f.set_result(raw)

    async def insert(self, key: bytes, outputs: list[m.TensorRef], data: list[bytes]) -> str | None:
        import redis
        try:
            await self._redis().set(self._prefix + key, _encoder.encode(_Value(outputs, data)))
        except (redis.RedisError, OSError) as e:
            return f"Failed to insert key: {key.hex()}: {e}"
        return None

    def gauges(self) -> list[tuple[str, str, float]]:
        return []   # (Triton's Redis cache reports none)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
