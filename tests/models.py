"""Model repositories built at test time with the onnx helper API (no binary blobs)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ONNX_TYPES = {
    "bool": TensorProto.BOOL, "uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16,
    "uint32": TensorProto.UINT32, "uint64": TensorProto.UINT64, "int8": TensorProto.INT8,
    "int16": TensorProto.INT16, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
    "fp16": TensorProto.FLOAT16, "fp32": TensorProto.FLOAT, "fp64": TensorProto.DOUBLE,
    "bytes": TensorProto.STRING,
}
OPSET = [helper.make_opsetid("", 17)]


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="trireme-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def write_config(model_dir: Path, text: str) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)


def add_sub(model_dir: Path, *, size: int = 16, dtype: str = "fp32", batch: bool = True,
            versions: tuple[int, ...] = (1,), offset_per_version: bool = False,
            swapped: tuple[int, ...] = ()) -> None:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (Triton's 'simple' model).

    With offset_per_version, version v adds v-1 to OUTPUT0 so tests can tell versions apart.
    The versions in ``swapped`` compute OUTPUT0 = INPUT0 - INPUT1, OUTPUT1 = INPUT0 + INPUT1,
    as the versions 2 and 3 that Triton's gen_qa_models.py writes (swap=True)."""
    t = ONNX_TYPES[dtype]
    dims = ["batch", size] if batch else [size]
    for v in versions:
        # "sum" is what becomes OUTPUT0 (the difference in a swapped version)
        add_to, sub_to = ("OUTPUT1", "sum") if v in swapped else ("sum", "OUTPUT1")
        nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], [add_to]),
                 helper.make_node("Sub", ["INPUT0", "INPUT1"], [sub_to])]
        inits = []
        if offset_per_version:
            inits.append(helper.make_tensor("off", t, [], [float(v - 1)]))
            nodes.append(helper.make_node("Add", ["sum", "off"], ["OUTPUT0"]))
        else:
            nodes.append(helper.make_node("Identity", ["sum"], ["OUTPUT0"]))
        g = helper.make_graph(
            nodes, "add_sub",
            [helper.make_tensor_value_info("INPUT0", t, dims),
             helper.make_tensor_value_info("INPUT1", t, dims)],
            [helper.make_tensor_value_info("OUTPUT0", t, dims),
             helper.make_tensor_value_info("OUTPUT1", t, dims)],
            initializer=inits)
        _save(g, model_dir / str(v) / "model.onnx")


def identity(model_dir: Path, dtype: str) -> None:
    """INPUT0 -> OUTPUT0 with a dynamic batch dim and one dynamic dim."""
    t = ONNX_TYPES[dtype]
    g = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", t, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", t, ["batch", "n"])])
    _save(g, model_dir / "1" / "model.onnx")


def mlp(model_dir: Path, width: int = 1024, layers: int = 3, seed: int = 0) -> None:
    """A width x width MLP with ReLU, FP32, dynamic batch (the benchmark model)."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "INPUT0"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        b = np.zeros(width, np.float32)
        inits += [helper.make_tensor(f"w{i}", TensorProto.FLOAT, w.shape, w.ravel()),
                  helper.make_tensor(f"b{i}", TensorProto.FLOAT, b.shape, b)]
        out = "OUTPUT0" if i == layers - 1 else f"h{i}"
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"mm{i}"]),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [out])]
        prev = out
    g = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", width])],
        initializer=inits)
    _save(g, model_dir / "1" / "model.onnx")


def tiny(model_dir: Path, width: int = 16, seed: int = 0) -> None:
    """16 -> 16 MatMul + Add + Relu (the latency benchmark model)."""
    mlp(model_dir, width=width, layers=1, seed=seed)


def standard_repository(root: Path) -> Path:
    """The repository most end-to-end tests share."""
    add_sub(root / "add_sub")
    write_config(root / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
                 'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    for dt in ONNX_TYPES:
        identity(root / f"identity_{dt}", dt)
        write_config(root / f"identity_{dt}",
                     'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'
                     'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n')
    return root


def slow(model_dir: Path, width: int = 256, layers: int = 400) -> None:
    """INPUT0 FP32 [rows, width] -> `layers` chained MatMuls with the identity matrix
    (OUTPUT0 == INPUT0). About 1 ms per row on one CPU thread at the defaults, so the
    number of rows sets how long a request runs (fault and shutdown tests)."""
    w = np.eye(width, dtype=np.float32)
    nodes, prev = [], "INPUT0"
    for i in range(layers):
        out = "OUTPUT0" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, "w"], [out]))
        prev = out
    g = helper.make_graph(
        nodes, "slow", [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["rows", width])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["rows", width])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())])
    _save(g, model_dir / "1" / "model.onnx")


def slow_config(width: int = 256) -> str:
    """config.pbtxt for `slow`: no batching, one instance, one intra-op thread. Inputs and
    outputs are written out, or auto-complete would turn max_batch_size 0 into 4."""
    return ("max_batch_size: 0\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n"
            f'input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [-1, {width}] }}]\n'
            f'output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [-1, {width}] }}]\n'
            'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n')


def lookup(model_dir: Path, table: int = 4) -> None:
    """INDEX INT64 [rows, 1] -> OUTPUT0 FP32 [rows, 1] = float(INDEX) via Gather on a table
    of `table` entries. An index outside the table makes onnxruntime fail the run, so a
    test can make one execution fail on demand."""
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "INDEX"], ["g"], axis=0),
         helper.make_node("Identity", ["g"], ["OUTPUT0"])],
        "lookup", [helper.make_tensor_value_info("INDEX", TensorProto.INT64, ["rows", 1])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["rows", 1])],
        initializer=[helper.make_tensor("table", TensorProto.FLOAT, [table],
                                        np.arange(table, dtype=np.float32))])
    _save(g, model_dir / "1" / "model.onnx")


def affine(model_dir: Path, shape: list, width: int, seed: int = 0) -> np.ndarray:
    """OUTPUT0 = INPUT0 @ W + 1 over the last dimension (`width`), FP32, with `shape` the
    tensors' shape in the file (names for dynamic dims). Returns W, for expected values."""
    w = np.random.default_rng(seed).standard_normal((width, width)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "w"], ["mm"]),
         helper.make_node("Add", ["mm", "one"], ["OUTPUT0"])], "affine",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape)],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
                     helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    _save(g, model_dir / "1" / "model.onnx")
    return w


def scale(model_dir: Path, shape: list, factor: float = 3.0) -> None:
    """OUTPUT0 = INPUT0 * factor, FP32, `shape` as in the file (e.g. ["batch"]: a scalar
    per batch item)."""
    g = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "k"], ["OUTPUT0"])], "scale",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape)],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [factor])])
    _save(g, model_dir / "1" / "model.onnx")


def ragged_sum(model_dir: Path) -> None:
    """A ragged-batching model (Triton's ragged_batching.md example): INPUT FP32 [n] holds
    every request's elements one after another, INDEX INT32 [requests] where each request's
    elements end (BATCH_ACCUMULATED_ELEMENT_COUNT), COUNT FP32 [requests] (BATCH_ELEMENT_COUNT).
    SUM [requests, 1] = each request's sum (differences of a running sum; exact for
    integer values), COUNT_OUT [requests, 1] = COUNT."""
    i64 = TensorProto.INT64
    g = helper.make_graph(
        [helper.make_node("CumSum", ["INPUT", "axis"], ["running"]),
         helper.make_node("Concat", ["zero", "running"], ["prefix"], axis=0),   # [n + 1]
         helper.make_node("Slice", ["INDEX", "first", "last", "axis1"], ["before"]),
         helper.make_node("Concat", ["izero", "before"], ["starts"], axis=0),   # [0, INDEX[:-1]]
         helper.make_node("Gather", ["prefix", "INDEX"], ["end_sum"], axis=0),
         helper.make_node("Gather", ["prefix", "starts"], ["start_sum"], axis=0),
         helper.make_node("Sub", ["end_sum", "start_sum"], ["sums"]),
         helper.make_node("Unsqueeze", ["sums", "axes"], ["SUM"]),
         helper.make_node("Unsqueeze", ["COUNT", "axes"], ["COUNT_OUT"])],
        "ragged_sum",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("INDEX", TensorProto.INT32, ["requests"]),
         helper.make_tensor_value_info("COUNT", TensorProto.FLOAT, ["requests"])],
        [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, ["requests", 1]),
         helper.make_tensor_value_info("COUNT_OUT", TensorProto.FLOAT, ["requests", 1])],
        initializer=[helper.make_tensor("axis", i64, [], [0]),
                     helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]),
                     helper.make_tensor("izero", TensorProto.INT32, [1], [0]),
                     helper.make_tensor("first", i64, [1], [0]),
                     helper.make_tensor("last", i64, [1], [-1]),
                     helper.make_tensor("axis1", i64, [1], [0]),
                     helper.make_tensor("axes", i64, [1], [1])])
    _save(g, model_dir / "1" / "model.onnx")


def flat_identity(model_dir: Path, scale: float = 2.0) -> None:
    """INPUT0 FP32 [n] -> OUTPUT0 = INPUT0 * scale, one dimension in and out: a ragged
    input whose output goes back by BATCH_SCATTER_WITH_INPUT_SHAPE (Triton's ragged_io)."""
    g = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "k"], ["OUTPUT0"])], "flat_identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["n"])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [scale])])
    _save(g, model_dir / "1" / "model.onnx")


def sum_diff_prod(model_dir: Path, size: int = 4) -> None:
    """SUM = A + B, DIFF = A - B, PROD = A * B, FP32 [batch, size]: three outputs, for
    configs that list only some of them."""
    dims = ["batch", size]
    g = helper.make_graph(
        [helper.make_node(op, ["A", "B"], [name])
         for op, name in (("Add", "SUM"), ("Sub", "DIFF"), ("Mul", "PROD"))],
        "sum_diff_prod",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in ("A", "B")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in ("SUM", "DIFF", "PROD")])
    _save(g, model_dir / "1" / "model.onnx")


def add_with_initializer(model_dir: Path) -> None:
    """Triton's qa/L0_initializer_as_input model: OUTPUT = INPUT + INITIALIZER, FP32 [5, 5],
    where INITIALIZER is both a graph input and an initializer of ones (a request may
    override it)."""
    t = TensorProto.FLOAT
    g = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "INITIALIZER"], ["OUTPUT"])], "add_with_initializer",
        [helper.make_tensor_value_info("INPUT", t, [5, 5]),
         helper.make_tensor_value_info("INITIALIZER", t, [5, 5])],
        [helper.make_tensor_value_info("OUTPUT", t, [5, 5])],
        initializer=[helper.make_tensor("INITIALIZER", t, [5, 5], [1.0] * 25)])
    _save(g, model_dir / "1" / "model.onnx")
