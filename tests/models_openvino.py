"""OpenVINO IR models (model.xml + model.bin) built at test time with the OpenVINO opset API."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops


def _named(node, name: str):
    node.output(0).get_tensor().set_names({name})
    return node.output(0)


def _save(model: ov.Model, model_dir: Path, version: int = 1) -> Path:
    path = model_dir / str(version) / "model.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path


def add_sub(model_dir: Path, size: int = 16) -> Path:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, FP32 [batch?, size]."""
    a = ops.parameter([-1, size], np.float32, name="INPUT0")
    b = ops.parameter([-1, size], np.float32, name="INPUT1")
    return _save(ov.Model([_named(ops.add(a, b), "OUTPUT0"), _named(ops.subtract(a, b), "OUTPUT1")],
                          [a, b], "add_sub"), model_dir)


def mlp(model_dir: Path, width: int = 32, layers: int = 2, batch: int = 1, seed: int = 0) -> Path:
    """INPUT0 FP32 [batch, width] -> (MatMul + Add + ReLU) x layers -> OUTPUT0, with a
    *static* batch dimension, as exported models often have."""
    rng = np.random.default_rng(seed)
    x = ops.parameter([batch, width], np.float32, name="INPUT0")
    h = x.output(0)
    for _ in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        b = rng.standard_normal(width).astype(np.float32)
        node = ops.relu(ops.add(ops.matmul(h, ops.constant(w), False, False), ops.constant(b)))
        h = node.output(0)
    return _save(ov.Model([_named(node, "OUTPUT0")], [x], "mlp"), model_dir)


def types(model_dir: Path) -> Path:
    """No batch dimension. I64 [4] -> TWICE = 2x, POSITIVE = x > 0 (BOOL);
    H [2, 3] FP16 -> PLUS1 = H + 1 (FP16)."""
    i = ops.parameter([4], np.int64, name="I64")
    h = ops.parameter([2, 3], np.float16, name="H")
    outs = [_named(ops.multiply(i, ops.constant(np.int64(2))), "TWICE"),
            _named(ops.greater(i, ops.constant(np.int64(0))), "POSITIVE"),
            _named(ops.add(h, ops.constant(np.float16(1))), "PLUS1")]
    return _save(ov.Model(outs, [i, h], "types"), model_dir)


def strings(model_dir: Path) -> Path:
    """TEXT string [batch, 2] -> UPPER string (ASCII a-z upper-cased byte by byte, other
    bytes as they are) and LENGTH i32 (bytes per element), with OpenVINO's string ops."""
    import openvino.opset15 as ops15
    text = ops15.parameter([-1, 2], ov.Type.string, name="TEXT")
    begins, ends, symbols = ops15.string_tensor_unpack(text).outputs()
    lower = ops15.logical_and(ops15.greater_equal(symbols, ops15.constant(np.uint8(97))),
                              ops15.less_equal(symbols, ops15.constant(np.uint8(122))))
    upper = ops15.select(lower, ops15.subtract(symbols, ops15.constant(np.uint8(32))), symbols)
    outs = [_named(ops15.string_tensor_pack(begins, ends, upper), "UPPER"),
            _named(ops15.subtract(ends, begins), "LENGTH")]
    return _save(ov.Model(outs, [text], "strings"), model_dir)


def broken(model_dir: Path) -> Path:
    """A model.xml that is not IR."""
    path = model_dir / "1" / "model.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("<net name='broken'><layers>")
    return path


@functools.cache
def _compiled(path: Path) -> ov.CompiledModel:
    return ov.Core().compile_model(str(path), "CPU")


def run(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model file compiled in this process, as the reference for served results."""
    result = _compiled(path).create_infer_request().infer(inputs)
    return {port.get_any_name(): np.array(value) for port, value in result.items()}
