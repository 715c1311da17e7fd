"""Restricted API groups: Triton's --http-restricted-api and --grpc-restricted-protocol.

A restriction names groups of endpoints and one header, `<group>[,<group>...]:<key>=<value>`
(repeatable; a group may appear once in all of a protocol's flags). A request for an
endpoint of a restricted group is refused unless it carries the header with exactly that
value: HTTP answers 403 {"error": "This API is restricted, expecting header '<key>'"}, gRPC
UNAVAILABLE "This protocol is restricted, expecting header 'triton-grpc-protocol-<key>'"
(on gRPC the key is a metadata key and Triton prefixes it). Parsing, texts and the
endpoint -> group tables follow Triton's src/command_line_parser.cc
(ParseRestrictedFeatureOption, ParseGenericConfigOption, SplitOptions),
src/restricted_features.h, src/http_server.cc (RespondIfRestricted and the check that opens
each Handle* method) and src/grpc/grpc_server.cc (the category given to each RPC).

The protocol adapters decide once, at start, whether any check runs at all: with no
restriction configured neither server looks at a header (http/routes.py, grpc/methods.py).
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "GROUPS",
    "GRPC_KEY_PREFIX",
    "GRPC_METHOD_GROUPS",
    "Restriction",
    "RestrictionAction",
    "RestrictionError",
    "Restrictions",
    "grpc_refusal_text",
    "http_group",
    "http_refusal_text",
    "parse_restrictions",
]

# Triton's RESTRICTED_CATEGORY_NAMES, in its order.
GROUPS = ("health", "metadata", "inference", "shared-memory", "model-config",
          "model-repository", "statistics", "trace", "logging")
_GROUP_SET = frozenset(GROUPS)

# kRestrictedProtocolHeaderTemplate (src/grpc/grpc_server.h): prepended to every gRPC key.
GRPC_KEY_PREFIX = "triton-grpc-protocol-"

HTTP_OPTION = "http-restricted-api"
GRPC_OPTION = "grpc-restricted-protocol"


class RestrictionError(ValueError):
    """A restriction spec Triton refuses at start-up; the message is Triton's text."""


class Restriction(NamedTuple):
    """The header (a gRPC metadata key, prefix included) and the value a request needs."""
    header: str
    value: str


def parse_restrictions(specs: Iterable[str], option: str = HTTP_OPTION,
                       feature_type: str = "api", key_prefix: str = "") -> dict[str, Restriction]:
    """group -> Restriction from the values of one repeatable flag, in order.

    ``option`` is the flag's name without dashes, ``feature_type`` the word Triton's texts use
    ("api" for HTTP, "protocol" for gRPC), ``key_prefix`` what is put before each key
    (GRPC_KEY_PREFIX for gRPC). Raises RestrictionError with Triton's text at the first bad
    spec: a missing part, an unknown group, a group already restricted."""
    restricted: dict[str, Restriction] = {}
    for spec in specs:
        names, key, value = _split_spec(spec, option)
        for name in names.split(","):        # SplitOptions: every piece, empty ones too
            if name not in _GROUP_SET:
                raise RestrictionError(f"unknown restricted {feature_type} '{name}' ")
            if name in restricted:
                raise RestrictionError(f"restricted {feature_type} '{name}' can not be "
                                       "specified in multiple config groups")
            restricted[name] = Restriction(key_prefix + key, value)
    return restricted


def _split_spec(spec: str, option: str) -> tuple[str, str, str]:
    """ParseGenericConfigOption(arg, ":", "=", ...): the groups end at the first ':', the
    key at the first '=' after it; the value is the rest. Each part must be non-empty."""
    colon = spec.find(":")
    equals = spec.find("=", colon + 1) if colon >= 0 else -1
    names, key, value = spec[:colon], spec[colon + 1:equals], spec[equals + 1:]
    if colon < 0 or equals < 0 or not names or not key or not value:
        raise RestrictionError(f"--{option} option format is '<config name>:<setting>=<value>'. "
                               f"Got {spec}")
    return names, key, value


@dataclass(frozen=True)
class Restrictions:
    """Both protocols' restrictions, group -> Restriction (empty: nothing restricted)."""
    http: Mapping[str, Restriction] = field(default_factory=dict)
    grpc: Mapping[str, Restriction] = field(default_factory=dict)

    @classmethod
    def parse(cls, http_specs: Iterable[str] = (), grpc_specs: Iterable[str] = ()) -> Restrictions:
        return cls(parse_restrictions(http_specs, HTTP_OPTION, "api"),
                   parse_restrictions(grpc_specs, GRPC_OPTION, "protocol", GRPC_KEY_PREFIX))


def http_refusal_text(header: str) -> str:
    """RespondIfRestricted (src/http_server.cc), answered with 403 Forbidden."""
    return f"This API is restricted, expecting header '{header}'"


def grpc_refusal_text(header: str) -> str:
    """CommonCallData::Execute, InferHandler and ModelStreamInferHandler (src/grpc), answered
    with UNAVAILABLE."""
    return f"This protocol is restricted, expecting header '{header}'"


# ---- HTTP: path -> group, as HTTPAPIServer::Handle routes ----------------------------------
# Triton's regexes (FullMatch). The group is the one the Handle* method a path reaches checks
# first (before the method, the body, anything else); a path Triton answers 404 has none.
_MODEL_RE = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?"
                       r"(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?")
_SHM_RE = re.compile(r"/v2/(?:system|cuda)sharedmemory(?:/region/([^/]+))?/"
                     r"(?:status|register|unregister)")
_REPOSITORY_RE = re.compile(r"/v2/repository(?:/([^/]+))?/(?:index|models/([^/]+)/(?:load|unload))")
_EXACT = {
    "/v2/models/stats": "statistics",       # HandleModelStats, before the model regex
    "/v2/logging": "logging",               # HandleLogging
    "/v2": "metadata",                      # HandleServerMetadata
    "/v2/health/live": "health",            # HandleServerHealth
    "/v2/health/ready": "health",
    "/v2/trace/setting": "trace",           # HandleTrace
}
_MODEL_KINDS = {
    "": "metadata",                         # HandleModelMetadata
    "ready": "health",                      # HandleModelReady
    "infer": "inference",                   # HandleInfer
    "generate": "inference",                # HandleGenerate
    "generate_stream": "inference",
    "config": "model-config",               # HandleModelConfig
    "stats": "statistics",                  # HandleModelStats
    "trace/setting": "trace",               # HandleTrace, unversioned only
}


def http_group(path: str) -> str | None:
    """The restriction group of an HTTP path (percent-decoded, no query), or None for a path
    Triton answers 404 without a check."""
    group = _EXACT.get(path)
    if group is not None:
        return group
    if path.startswith("/v2/models/"):
        m = _MODEL_RE.fullmatch(path)
        if m is None:
            return None
        kind = m.group(3) or ""
        if kind == "trace/setting" and m.group(2):
            return None                     # Triton: falls out of the model branch, 404
        return _MODEL_KINDS[kind]
    if path.startswith("/v2/repository"):
        return "model-repository" if _REPOSITORY_RE.fullmatch(path) else None
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory" if _SHM_RE.fullmatch(path) else None
    return None


# ---- gRPC: method -> group, as grpc_server.cc registers each RPC ---------------------------
_SERVICE = "/inference.GRPCInferenceService/"
GRPC_METHOD_GROUPS: dict[str, str] = {
    _SERVICE + "ServerLive": "health",
    _SERVICE + "ServerReady": "health",
    _SERVICE + "ModelReady": "health",
    "/grpc.health.v1.Health/Check": "health",
    _SERVICE + "ServerMetadata": "metadata",
    _SERVICE + "ModelMetadata": "metadata",
    _SERVICE + "ModelInfer": "inference",
    _SERVICE + "ModelStreamInfer": "inference",
    _SERVICE + "ModelConfig": "model-config",
    _SERVICE + "ModelStatistics": "statistics",
    _SERVICE + "RepositoryIndex": "model-repository",
    _SERVICE + "RepositoryModelLoad": "model-repository",
    _SERVICE + "RepositoryModelUnload": "model-repository",
    _SERVICE + "SystemSharedMemoryStatus": "shared-memory",
    _SERVICE + "SystemSharedMemoryRegister": "shared-memory",
    _SERVICE + "SystemSharedMemoryUnregister": "shared-memory",
    _SERVICE + "CudaSharedMemoryStatus": "shared-memory",
    _SERVICE + "CudaSharedMemoryRegister": "shared-memory",
    _SERVICE + "CudaSharedMemoryUnregister": "shared-memory",
    _SERVICE + "TraceSetting": "trace",
    _SERVICE + "LogSettings": "logging",
}


class RestrictionAction(argparse.Action):
    """The `append` action of --http-restricted-api / --grpc-restricted-protocol that refuses,
    while the command line is parsed, what Triton refuses at start-up (with its texts): each
    new value is checked together with the ones before it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = [*(getattr(namespace, self.dest, None) or ()), values]
        option = self.option_strings[-1].lstrip("-")
        grpc = option == GRPC_OPTION
        try:
            parse_restrictions(items, option, "protocol" if grpc else "api",
                               GRPC_KEY_PREFIX if grpc else "")
        except RestrictionError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, items)
