"""Checks for protos/: generated code is up to date and wire-compatible with
the official tritonclient.

Our generated modules and tritonclient's both register ``inference.*`` in the
default protobuf descriptor pool, so they cannot be imported into the same
process. This module therefore never imports ``protos.*_pb2*`` itself; the
descriptors are dumped as JSON by separate subprocesses and compared here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "protos"

# Dumps every message/field, enum value and service method of the given
# modules' files (nested types included) as JSON on stdout.
_DUMP_SCRIPT = r"""
import importlib, json, sys
from google.protobuf import descriptor_pb2 as D

messages, enums, services = {}, {}, {}

def walk_enum(prefix, e):
    enums[prefix + e.name] = {v.name: v.number for v in e.value}

def walk_msg(prefix, m):
    name = prefix + m.name
    fields = {}
    for f in m.field:
        oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
        fields[f.name] = [f.number, f.type, f.label, f.type_name, oneof]
    messages[name] = {"fields": fields, "map_entry": m.options.map_entry}
    for e in m.enum_type:
        walk_enum(name + ".", e)
    for n in m.nested_type:
        walk_msg(name + ".", n)

for modname in sys.argv[1:]:
    mod = importlib.import_module(modname)
    if not hasattr(mod, "DESCRIPTOR"):  # e.g. *_pb2_grpc: import check only
        continue
    fdp = D.FileDescriptorProto()
    mod.DESCRIPTOR.CopyToProto(fdp)
    prefix = fdp.package + "."
    for e in fdp.enum_type:
        walk_enum(prefix, e)
    for m in fdp.message_type:
        walk_msg(prefix, m)
    for s in fdp.service:
        services[prefix + s.name] = {
            r.name: [r.input_type, r.output_type, r.client_streaming, r.server_streaming]
            for r in s.method
        }

json.dump({"messages": messages, "enums": enums, "services": services}, sys.stdout)
"""


def _dump(*modules: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", _DUMP_SCRIPT, *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"descriptor dump of {modules} failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def ours() -> dict:
    # Importing *_pb2_grpc also exercises its grpcio version guard.
    return _dump(
        "protos.model_config_pb2",
        "protos.grpc_service_pb2",
        "protos.grpc_service_pb2_grpc",
    )


@pytest.fixture(scope="module")
def theirs() -> dict:
    return _dump("tritonclient.grpc.model_config_pb2", "tritonclient.grpc.service_pb2")


def test_generated_code_is_up_to_date(tmp_path):
    # In a child process: protoc's C++ protobuf must not meet one a framework loaded into
    # this process (TensorFlow's clashes with it and crashes).
    proc = subprocess.run([sys.executable, str(PROTO_DIR / "generate.py"), str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    written = sorted(tmp_path.glob("*.py*"))
    assert written, "generator produced no files"
    regenerate = "run `python protos/generate.py` from the repository root"
    for path in written:
        checked_in = PROTO_DIR / path.name
        assert checked_in.exists(), f"protos/{path.name} is missing; {regenerate}"
        assert checked_in.read_bytes() == path.read_bytes(), (
            f"protos/{path.name} is stale; {regenerate}"
        )
    # Nothing generated-looking may linger in protos/ without being produced.
    produced = {p.name for p in written}
    stray = {
        p.name
        for p in PROTO_DIR.iterdir()
        if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    } - produced
    assert not stray, f"stale generated files {sorted(stray)}; delete them and {regenerate}"


def test_messages_match_tritonclient(ours, theirs):
    problems = []
    for msg, info in theirs["messages"].items():
        if msg not in ours["messages"]:
            problems.append(f"missing message {msg}")
            continue
        mine = ours["messages"][msg]
        if mine["map_entry"] != info["map_entry"]:
            problems.append(f"{msg}: map_entry {mine['map_entry']} != {info['map_entry']}")
        for field, spec in info["fields"].items():
            got = mine["fields"].get(field)
            if got is None:
                problems.append(f"missing field {msg}.{field}")
            elif got != spec:
                problems.append(
                    f"{msg}.{field}: [number, type, label, type_name, oneof] "
                    f"{got} != {spec}"
                )
    assert not problems, "\n".join(problems)


def test_enums_match_tritonclient(ours, theirs):
    problems = []
    for enum, values in theirs["enums"].items():
        mine = ours["enums"].get(enum)
        if mine is None:
            problems.append(f"missing enum {enum}")
            continue
        for name, number in values.items():
            if mine.get(name) != number:
                problems.append(f"{enum}.{name}: {mine.get(name)} != {number}")
    assert not problems, "\n".join(problems)


def test_service_matches_tritonclient(ours, theirs):
    assert "inference.GRPCInferenceService" in theirs["services"]
    assert sorted(ours["services"]) == sorted(theirs["services"])
    problems = []
    for svc, methods in theirs["services"].items():
        mine = ours["services"][svc]
        for name in sorted(set(methods) | set(mine)):
            # [input_type, output_type, client_streaming, server_streaming]
            if mine.get(name) != methods.get(name):
                problems.append(f"{svc}.{name}: {mine.get(name)} != {methods.get(name)}")
    assert not problems, "\n".join(problems)
