"""Regenerates the binary model files of the examples (they are small and committed, so
`trireme serve` works from a fresh clone without running this).

    python examples/make_models.py             # rewrites them in place
    python examples/make_models.py --out DIR   # writes DIR/model_repository, DIR/frameworks/...

What each part needs beyond the README's install (`pip install -e ".[onnx]"`):

    ONNX         pip install onnx==1.23.2     (onnxruntime runs models, the onnx package writes them)
    TorchScript  pip install -e ".[torch]"
    SavedModel   pip install -e ".[tensorflow]"
    OpenVINO IR  pip install -e ".[openvino]"

A part whose framework is not installed is skipped with a message, and its committed files
stay as they are. Only the binary files are written here: config.pbtxt and model.py files
are sources, edited by hand.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
WIDTH = 4   # the framework examples' add_sub: FP32 [batch, 4]


# ---------------------------------------------------------------- ONNX (the onnx package)

def _onnx_save(graph, path: Path) -> None:
    import onnx
    from onnx import helper
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="trireme-examples")
    model.ir_version = 8   # what older onnxruntime releases read too
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def onnx_models(out: Path) -> list[Path]:
    """simple: Triton's add/sub, FP32 [batch, 16]; tiny_mlp: a 16 -> 16 MatMul + Add + Relu
    (no config.pbtxt, completed from the file); identity_bytes: BYTES [batch, n] through."""
    import numpy as np
    from onnx import TensorProto, helper
    repo = out / "model_repository"
    f32 = TensorProto.FLOAT

    def io(name, dtype, dims):
        return helper.make_tensor_value_info(name, dtype, dims)

    simple = repo / "simple" / "1" / "model.onnx"
    _onnx_save(helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["sum"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
         helper.make_node("Identity", ["sum"], ["OUTPUT0"])], "add_sub",
        [io("INPUT0", f32, ["batch", 16]), io("INPUT1", f32, ["batch", 16])],
        [io("OUTPUT0", f32, ["batch", 16]), io("OUTPUT1", f32, ["batch", 16])]), simple)

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    tiny = repo / "tiny_mlp" / "1" / "model.onnx"
    _onnx_save(helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "w0"], ["mm0"]),
         helper.make_node("Add", ["mm0", "b0"], ["a0"]),
         helper.make_node("Relu", ["a0"], ["OUTPUT0"])], "mlp",
        [io("INPUT0", f32, ["batch", 16])], [io("OUTPUT0", f32, ["batch", 16])],
        initializer=[helper.make_tensor("w0", f32, w.shape, w.ravel()),
                     helper.make_tensor("b0", f32, [16], np.zeros(16, np.float32))]), tiny)

    identity = repo / "identity_bytes" / "1" / "model.onnx"
    _onnx_save(helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [io("INPUT0", TensorProto.STRING, ["batch", "n"])],
        [io("OUTPUT0", TensorProto.STRING, ["batch", "n"])]), identity)
    return [simple, tiny, identity]


# ---------------------------------------------------------------- PyTorch (TorchScript)

def torchscript_models(out: Path) -> list[Path]:
    """add_sub_pytorch: forward(x, y) -> (x + y, x - y), saved by torch.jit.script."""
    import torch

    class AddSub(torch.nn.Module):
        def forward(self, x, y):
            return x + y, x - y

    path = out / "frameworks" / "pytorch" / "add_sub_pytorch" / "1" / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():   # torch.jit.script is deprecated; Triton still loads it
        warnings.simplefilter("ignore")
        torch.jit.script(AddSub()).save(str(path))
    return [path]


# ---------------------------------------------------------------- TensorFlow (SavedModel)

def savedmodel_models(out: Path) -> list[Path]:
    """add_sub_tensorflow: a SavedModel whose serving_default signature takes INPUT0 and
    INPUT1 and returns {OUTPUT0: sum, OUTPUT1: difference}."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    spec = tf.TensorSpec([None, WIDTH], tf.float32)

    class AddSub(tf.Module):
        @tf.function(input_signature=[spec, spec])
        def serve(self, INPUT0, INPUT1):
            return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}

    path = out / "frameworks" / "tensorflow" / "add_sub_tensorflow" / "1" / "model.savedmodel"
    module = AddSub()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return sorted(p for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- OpenVINO (IR)

def openvino_models(out: Path) -> list[Path]:
    """add_sub_openvino: model.xml (the graph) and model.bin (its weights: none here)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    def named(node, name):
        node.output(0).get_tensor().set_names({name})
        return node.output(0)

    a = ops.parameter([-1, WIDTH], np.float32, name="INPUT0")
    b = ops.parameter([-1, WIDTH], np.float32, name="INPUT1")
    model = ov.Model([named(ops.add(a, b), "OUTPUT0"), named(ops.subtract(a, b), "OUTPUT1")],
                     [a, b], "add_sub")
    path = out / "frameworks" / "openvino" / "add_sub_openvino" / "1" / "model.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(path), compress_to_fp16=False)
    return [path, path.with_suffix(".bin")]


# (what is written, the module it needs, how to install it, the writer)
PARTS: list[tuple[str, str, str, Callable[[Path], list[Path]]]] = [
    ("ONNX models", "onnx", "pip install onnx==1.23.2", onnx_models),
    ("the TorchScript model", "torch", 'pip install -e ".[torch]"', torchscript_models),
    ("the TensorFlow SavedModel", "tensorflow", 'pip install -e ".[tensorflow]"', savedmodel_models),
    ("the OpenVINO model", "openvino", 'pip install -e ".[openvino]"', openvino_models),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE,
                        help="where model_repository/ and frameworks/ are (default: examples/)")
    args = parser.parse_args(argv)
    for what, module, install, write in PARTS:
        if importlib.util.find_spec(module) is None:
            print(f"skipped {what}: {module} is not installed ({install})")
            continue
        for path in write(args.out):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
