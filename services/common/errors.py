"""The one error type every service raises and sends across processes.

Codes are Triton's set. Mapping a code to an HTTP or gRPC status happens once, in each
protocol adapter, never here; across processes an error travels as {code, message}.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Code(enum.IntEnum):
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TriremeError(Exception):
    """An error with a Triton code; `str(err)` is the client-facing message."""

    def __init__(self, code: Code | int, message: str) -> None:
        super().__init__(message)
        try:
            self.code = Code(code)
        except ValueError:  # a code from a newer peer: keep the message, not the crash
            self.code = Code.UNKNOWN
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"TriremeError({self.code.name}, {self.message!r})"

    def __reduce__(self):  # keep (code, message) when copied or pickled in tests
        return (type(self), (self.code, self.message))


def invalid_arg(msg: str) -> TriremeError:
    return TriremeError(Code.INVALID_ARG, msg)


def not_found(msg: str) -> TriremeError:
    return TriremeError(Code.NOT_FOUND, msg)


def unavailable(msg: str) -> TriremeError:
    return TriremeError(Code.UNAVAILABLE, msg)


def internal(msg: str) -> TriremeError:
    return TriremeError(Code.INTERNAL, msg)


def unsupported(msg: str) -> TriremeError:
    return TriremeError(Code.UNSUPPORTED, msg)


# ---- Triton's recurring texts, each written once -----------------------------------------
# The *_text functions return the text (callers choose the code, or raise ValueError where a
# model's own code expects one); the others build the error with Triton's code. The tests
# compare these texts with Triton's byte for byte.

CANCELLED_TEXT = "Request cancelled"
REPOSITORY_NAME_UNSUPPORTED = "'repository_name' specification is not supported"

# TritonJson's accessor errors (triton common, triton_json.h), which Triton's HTTP server
# passes on, most of them as "Unable to parse '<field>': <text>" (unable_to_parse).
JSON_NOT_STRING = "attempt to access JSON non-string as string"
JSON_NOT_BOOL = "attempt to access JSON non-boolean as boolean"
JSON_NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"
JSON_NOT_ARRAY = "attempt to access JSON non-array as array"
JSON_NOT_OBJECT = "attempt to get members for non-object"


def json_no_member_text(name: str) -> str:
    """TritonJson's MemberAs*() of a member the object lacks (or of any member of a value
    that is not an object)."""
    return f"attempt to access non-existing object member '{name}'"


def unable_to_parse(field: str, why: str) -> TriremeError:
    """Triton's RETURN_MSG_IF_ERR(..., "Unable to parse '<field>'") around a TritonJson error
    (Triton: INTERNAL, 500; the client's mistake: 400 here, docs/compat.md)."""
    return invalid_arg(f"Unable to parse '{field}': {why}")


def json_not_utf8_text(name: str, index: int) -> str:
    """A BYTES output asked for as JSON with an element that is not UTF-8 (Triton writes the
    bytes into the JSON string as they are: a body no JSON reader takes)."""
    return (f"output '{name}': element {index} is not valid UTF-8, which JSON cannot carry. "
            f"Please use the binary data format for output")


def reserved_header_text(name: str) -> str:
    """A forwarded header named as a reserved parameter (Triton main's ForwardHeaders)."""
    return f"Header '{name}' is reserved for Triton usage and cannot be forwarded."


def unknown_model(model: str) -> TriremeError:
    return TriremeError(Code.NOT_FOUND, f"Request for unknown model: '{model}' is not found")


def ambiguous_model(model: str, count: int) -> TriremeError:
    """--model-namespacing: a name that more than one repository's loaded model has
    (Triton's FindModelIdentifier)."""
    return TriremeError(Code.INVALID_ARG, f"There are {count} identifiers of model '{model}' in "
                                          "global map, model namespace must be provided to "
                                          "resolve ambiguity.")


def still_loading(model: str) -> TriremeError:
    """A model the scheduler does not know yet because it is still loading the repository
    (it just started, or restarted): UNAVAILABLE, which clients retry, not NOT_FOUND."""
    return TriremeError(Code.UNAVAILABLE, f"'{model}' is not ready: the server is still "
                                          "loading its models")


def bad_version_string_text(version: str, detail: str) -> str:
    """Triton's GetModelVersionFromString failure; `detail` names the C++ parser that threw
    ("stol" on the inference path, "stoll" for statistics)."""
    return (f"failed to get model version from specified version string '{version}' "
            f"(details: {detail}), version should be an integral value > 0")


def not_ready_text(model: str, version: int | str) -> str:
    return f"'{model}' version {version} is not at ready state"


def instance_exited_text(instance: str, model: str, code: int | None = None) -> str:
    """A worker that died with requests it held (the scheduler knows its exit code; a
    frontend that sent requests to it directly sees only its connection close)."""
    how = f" (exit code {code})" if code is not None else ""
    return (f"model instance '{instance}' of model '{model}' exited unexpectedly{how}; "
            "the request was not completed")


def poll_failed(model: str) -> TriremeError:
    """A load request the repository cannot satisfy: no such model, a config override that
    does not parse, a "file:" parameter the file system refuses. Triton's text and code
    (INTERNAL: Triton's model-control example clients check it)."""
    return TriremeError(Code.INTERNAL,
                        f"failed to load '{model}', failed to poll from model repository")


def load_failed_text(model: str, version: int | str, why: object) -> str:
    return f"failed to load '{model}' version {version}: {why}"


# Triton's Status::AsString prefix of each code (common/src/error.cc CodeString).
CODE_STRINGS = {Code.UNKNOWN: "Unknown", Code.INTERNAL: "Internal", Code.NOT_FOUND: "Not found",
                Code.INVALID_ARG: "Invalid argument", Code.UNAVAILABLE: "Unavailable",
                Code.UNSUPPORTED: "Unsupported", Code.ALREADY_EXISTS: "Already exists",
                Code.CANCELLED: "<invalid code>"}


class LoadFailed(TriremeError):
    """A load that failed once the model's versions were known: ``message`` is the reason
    the repository index shows; ``versions`` those that failed with it (none: the model
    itself failed, as an ensemble or an empty version policy does)."""

    def __init__(self, code: Code | int, message: str, versions: Iterable[int] = ()) -> None:
        super().__init__(code, message)
        self.versions = sorted(versions)


def explicit_load_failed(model: str, e: LoadFailed) -> TriremeError:
    """Triton's answer to an explicit load that failed (core ModelRepositoryManager::
    LoadUnloadModels over ModelLifeCycle::OnLoadComplete): INVALID_ARG, each failed
    version's state and reason as Status::AsString writes it."""
    if not e.versions:
        return TriremeError(Code.INVALID_ARG, f"load failed for model '{model}': {e.message}\n")
    states = []
    for v in e.versions:   # (Trireme's reason may name the load already: said once here)
        why = e.message.removeprefix(load_failed_text(model, v, ""))
        states.append(f"version {v} is at UNAVAILABLE state: {CODE_STRINGS[e.code]}: {why};")
    return TriremeError(Code.INVALID_ARG, f"load failed for model '{model}': {''.join(states)}\n")


def expects_datatype_text(model: str, kind: str, name: str, expected: str, provided: str) -> str:
    return (f"unable to load model '{model}', configuration expects datatype {expected} for "
            f"{kind} '{name}', model provides {provided}")


def expects_inputs_text(model: str, expected: int, provided: int | str) -> str:
    return (f"unable to load model '{model}', configuration expects {expected} inputs, "
            f"model provides {provided}")


def unexpected_io_text(kind: str, name: str, allowed: Iterable[str]) -> str:
    return f"unexpected inference {kind} '{name}', allowed {kind}s are: " + ", ".join(sorted(allowed))


def unsupported_io_datatype_text(datatype: str, kind: str, name: str, model: str) -> str:
    return f"unsupported datatype {datatype} for {kind} '{name}' for model '{model}'"


def unrecognized_load_parameter(key: str) -> TriremeError:
    return invalid_arg(f"unrecognized load parameter '{key}'.")


class PortTaken(Exception):
    """A server's port held by another process: Triton's start-up text (with its trailing
    space), which stops the process that cannot bind."""

    def __init__(self, service: str, host: str, port: int) -> None:
        super().__init__(f"failed to start {service} service: Unavailable - Socket "
                         f"'{host}:{port}' already in use ")


def unknown_expect_text(expect: str) -> str:
    return f"Unknown Expect: {expect}"
