"""Regenerate the Python protobuf/gRPC modules checked into ``protos/``.

Usage (from the repository root)::

    python protos/generate.py            # rewrite protos/*_pb2*.py[i] in place
    python protos/generate.py OUT_DIR    # write them somewhere else

or, from Python, ``generate(out_dir)``.

The ``.proto`` files keep Triton's layout (``grpc_service.proto`` does
``import "model_config.proto";``), so protoc emits top-level imports such as
``import model_config_pb2``. Those only work when ``protos/`` itself is on
``sys.path``; we rewrite them to ``from protos import ...`` so the modules
work as the ``protos`` package. The rewrite is a plain, deterministic text
substitution, so the output is byte-for-byte reproducible for a given
grpcio-tools version (pinned below; tests/test_protos.py checks for drift).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "protos"
PROTO_FILES = ("model_config.proto", "grpc_service.proto")
# Exact grpcio-tools release the checked-in code was generated with. Other
# releases emit different version stamps, which the drift test would flag.
GRPCIO_TOOLS_VERSION = "1.81.1"
# protoc emits a *_pb2_grpc.py for every input file; model_config.proto has
# no services, so that one is an empty shell that we do not keep.
DROP_OUTPUTS = ("model_config_pb2_grpc.py",)

_MODULES = tuple(Path(p).stem + "_pb2" for p in PROTO_FILES)
_MOD_RE = "|".join(re.escape(m) for m in _MODULES)
# `import model_config_pb2 as model__config__pb2`
_IMPORT_RE = re.compile(rf"^import ({_MOD_RE})\b", re.MULTILINE)
# `from model_config_pb2 import X` (emitted for public imports / in .pyi)
_FROM_RE = re.compile(rf"^from ({_MOD_RE}) import\b", re.MULTILINE)


def _check_tools_version() -> None:
    from grpc_tools import grpc_version

    if grpc_version.VERSION != GRPCIO_TOOLS_VERSION:
        raise RuntimeError(
            f"protos/generate.py needs grpcio-tools=={GRPCIO_TOOLS_VERSION}, "
            f"found {grpc_version.VERSION}"
        )


def _rewrite_imports(text: str) -> str:
    text = _IMPORT_RE.sub(rf"from {PACKAGE} import \1", text)
    text = _FROM_RE.sub(rf"from {PACKAGE}.\1 import", text)
    return text


def generate(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Generate the modules into *out_dir*; return the written paths (sorted)."""
    _check_tools_version()
    import grpc_tools
    from grpc_tools import protoc

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wkt_include = Path(grpc_tools.__file__).resolve().parent / "_proto"

    with tempfile.TemporaryDirectory(prefix="protos-gen-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{wkt_include}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            *PROTO_FILES,
        ]
        # protoc resolves relative .proto names against the -I paths.
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}")

        written: list[Path] = []
        for src in sorted(Path(tmp).iterdir()):
            if src.name in DROP_OUTPUTS:
                continue
            text = _rewrite_imports(src.read_text(encoding="utf-8"))
            dst = out / src.name
            dst.write_text(text, encoding="utf-8", newline="\n")
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else PROTO_DIR
    for path in generate(out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
