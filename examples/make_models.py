"""Regenerates the bundled examples/model_repository with the onnx helper API.

    python examples/make_models.py
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import models  # noqa: E402


def main() -> None:
    repo = HERE / "model_repository"
    models.add_sub(repo / "simple")
    models.write_config(repo / "simple", """name: "simple"
backend: "onnxruntime"
max_batch_size: 8
input [
  { name: "INPUT0", data_type: TYPE_FP32, dims: [16] },
  { name: "INPUT1", data_type: TYPE_FP32, dims: [16] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_FP32, dims: [16] },
  { name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }
]
instance_group [{ kind: KIND_CPU, count: 1 }]
""")
    models.tiny(repo / "tiny_mlp")   # no config.pbtxt: auto-completed from the ONNX file
    models.identity(repo / "identity_bytes", "bytes")
    models.write_config(repo / "identity_bytes", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    print(f"wrote {repo}")


if __name__ == "__main__":
    main()
