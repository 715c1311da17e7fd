"""TensorFlow models built at test time by TensorFlow itself (no binary blobs).

Each builder writes `<model_dir>/<version>/model.*` and returns what computes the expected
outputs in this process, from the same weights the server loads.
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

WIDTH = 16
_F32 = tf.TensorSpec([None, WIDTH], tf.float32)


class AddMul(tf.Module):
    """serving_default: OUTPUT0 = INPUT0 @ W + INPUT1 (FP32), OUTPUT1 = INPUT0 > INPUT1 (INT32);
    signature "strings": UPPER = upper(TEXT) (BYTES), LENGTH = byte length (INT32)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w = tf.Variable(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32))

    @tf.function(input_signature=[_F32, _F32])
    def serve(self, INPUT0, INPUT1):
        return {"OUTPUT0": tf.matmul(INPUT0, self.w) + INPUT1,
                "OUTPUT1": tf.cast(INPUT0 > INPUT1, tf.int32)}

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.string)])
    def strings(self, TEXT):
        return {"UPPER": tf.strings.upper(TEXT), "LENGTH": tf.strings.length(TEXT)}


def savedmodel(model_dir: Path, version: int = 1) -> AddMul:
    """A SavedModel with the signatures "serving_default" and "strings"."""
    module = AddMul()
    tf.saved_model.save(module, str(Path(model_dir) / str(version) / "model.savedmodel"),
                        signatures={"serving_default": module.serve, "strings": module.strings})
    return module


def broken_savedmodel(model_dir: Path) -> None:
    """A model.savedmodel folder of garbage files."""
    path = Path(model_dir) / "1" / "model.savedmodel"
    (path / "variables").mkdir(parents=True)
    (path / "saved_model.pb").write_bytes(b"this is not a SavedModel\n")
    (path / "variables" / "variables.index").write_bytes(b"nor is this a checkpoint\n")


def graphdef(model_dir: Path, seed: int = 1):
    """A frozen GraphDef made with tf.compat.v1: placeholders INPUT0/INPUT1 [-1, 16] FP32,
    OUTPUT0 = check_numerics(INPUT0 @ W + INPUT1) (fails on NaN/Inf), OUTPUT1 = INPUT0 - INPUT1.
    Returns run(feeds: {name: array}, fetches: [names]) -> [arrays] on the frozen graph."""
    rng = np.random.default_rng(seed)
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [None, WIDTH], name="INPUT0")
        b = tf.compat.v1.placeholder(tf.float32, [None, WIDTH], name="INPUT1")
        w = tf.Variable(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), name="w")
        tf.debugging.check_numerics(tf.matmul(a, w) + b, "OUTPUT0 is not finite", name="OUTPUT0")
        tf.identity(a - b, name="OUTPUT1")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            frozen = tf.compat.v1.graph_util.convert_variables_to_constants(
                sess, graph.as_graph_def(), ["OUTPUT0", "OUTPUT1"])
    path = Path(model_dir) / "1" / "model.graphdef"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(frozen.SerializeToString())

    def run(feeds: dict[str, np.ndarray], fetches: list[str]) -> list[np.ndarray]:
        g = tf.Graph()
        with g.as_default():
            tf.compat.v1.import_graph_def(frozen, name="")
            with tf.compat.v1.Session(graph=g) as sess:
                return sess.run([f"{n}:0" for n in fetches],
                                {f"{n}:0": v for n, v in feeds.items()})
    return run


def variable_graphdef(model_dir: Path, value: int = 7, variable: str = "VARIABLE") -> None:
    """A GraphDef that is not frozen (Triton's qa graphdef_variable, with a non-zero start):
    OUTPUT = VARIABLE + INPUT, INT32 [1], where VARIABLE starts at `value` only once the
    initialization operation "init" (global_variables_initializer) has run."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.int32, [1], name="INPUT")
        v = tf.compat.v1.get_variable(variable, [1], dtype=tf.int32,
                                      initializer=tf.compat.v1.constant_initializer(value))
        tf.add(v, x, name="OUTPUT")
        assert tf.compat.v1.global_variables_initializer().name == "init"
    path = Path(model_dir) / "1" / "model.graphdef"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(graph.as_graph_def().SerializeToString())


def tf1_savedmodel(model_dir: Path, value: int = 5, variable: str = "LOCAL") -> None:
    """A TensorFlow 1 SavedModel (tf.compat.v1 Builder): serving_default OUTPUT = LOCAL + INPUT,
    INT32 [-1, 1], with LOCAL a local variable that no main op initializes; "init" (its
    local_variables_initializer) sets it to `value`."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.int32, [None, 1], name="INPUT")
        v = tf.compat.v1.get_variable(variable, [1], dtype=tf.int32,
                                      initializer=tf.compat.v1.constant_initializer(value),
                                      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        y = tf.add(v, x, name="OUTPUT")
        assert tf.compat.v1.local_variables_initializer().name == "init"
        with tf.compat.v1.Session(graph=graph) as sess:
            builder = tf.compat.v1.saved_model.Builder(
                str(Path(model_dir) / "1" / "model.savedmodel"))
            signature = tf.compat.v1.saved_model.predict_signature_def({"INPUT": x}, {"OUTPUT": y})
            builder.add_meta_graph_and_variables(
                sess, ["serve"], signature_def_map={"serving_default": signature},
                main_op=tf.no_op())
            builder.save()
