"""Sequence models for the tests: Triton's docs/examples simple_sequence and
simple_dyna_sequence rebuilt with the onnx helper (same graphs, same configs), an ONNX
accumulator with implicit state, and a Python accumulator keyed by its CORRID input."""
from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper

from tests.models import _save, write_config
from tests.models_python import python_model

I32 = TensorProto.INT32


def _flag(name: str, kind: str) -> str:
    return (f'{{ name: "{name}" control [{{ kind: {kind} int32_false_true: [ 0, 1 ] }}] }}')


def simple_sequence(model_dir: Path) -> None:
    """OUTPUT = READY * (INPUT + START): Triton's simple_sequence (direct strategy)."""
    g = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["_INPUT"]),
         helper.make_node("Add", ["_INPUT", "START"], ["add"]),
         helper.make_node("Mul", ["READY", "add"], ["CAST"]),
         helper.make_node("Cast", ["CAST"], ["OUTPUT"], to=I32)], "simple_sequence",
        [helper.make_tensor_value_info(n, I32, ["batch", 1]) for n in ("INPUT", "START", "READY")],
        [helper.make_tensor_value_info("OUTPUT", I32, ["batch", 1])])
    _save(g, model_dir / "1" / "model.onnx")
    write_config(model_dir, f'''name: "{model_dir.name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  control_input [ {_flag("START", "CONTROL_SEQUENCE_START")},
                  {_flag("READY", "CONTROL_SEQUENCE_READY")} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
''')


def simple_dyna_sequence(model_dir: Path) -> None:
    """OUTPUT = READY * (INPUT + START + END * CORRID): Triton's simple_dyna_sequence
    (oldest strategy, CORRID uint64, two instances)."""
    g = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["_INPUT"]),
         helper.make_node("Cast", ["CORRID"], ["corrid"], to=I32),
         helper.make_node("Add", ["_INPUT", "START"], ["add0"]),
         helper.make_node("Mul", ["END", "corrid"], ["mul0"]),
         helper.make_node("Add", ["add0", "mul0"], ["sum0"]),
         helper.make_node("Mul", ["READY", "sum0"], ["CAST"]),
         helper.make_node("Cast", ["CAST"], ["OUTPUT"], to=I32)], "simple_dyna_sequence",
        [helper.make_tensor_value_info(n, I32, ["batch", 1]) for n in ("INPUT", "START", "END", "READY")]
        + [helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ["batch", 1])],
        [helper.make_tensor_value_info("OUTPUT", I32, ["batch", 1])])
    _save(g, model_dir / "1" / "model.onnx")
    write_config(model_dir, f'''name: "{model_dir.name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 10000000
  oldest {{ max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }}
  control_input [ {_flag("START", "CONTROL_SEQUENCE_START")},
                  {_flag("END", "CONTROL_SEQUENCE_END")},
                  {_flag("READY", "CONTROL_SEQUENCE_READY")},
                  {{ name: "CORRID" control [{{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }}] }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
''')


def accumulate_state(model_dir: Path, idle_us: int = 0, slots: int = 4) -> None:
    """Implicit state: STATE_OUT = STATE_IN + INPUT, OUTPUT = STATE_OUT; the state starts
    at zero on each sequence's START."""
    g = helper.make_graph(
        [helper.make_node("Add", ["STATE_IN", "INPUT"], ["STATE_OUT"]),
         helper.make_node("Identity", ["STATE_OUT"], ["OUTPUT"])], "accumulate",
        [helper.make_tensor_value_info("INPUT", I32, ["batch", 1]),
         helper.make_tensor_value_info("STATE_IN", I32, ["batch", 1])],
        [helper.make_tensor_value_info("OUTPUT", I32, ["batch", 1]),
         helper.make_tensor_value_info("STATE_OUT", I32, ["batch", 1])])
    _save(g, model_dir / "1" / "model.onnx")
    idle = f"max_sequence_idle_microseconds: {idle_us}\n  " if idle_us else ""
    write_config(model_dir, f'''name: "{model_dir.name}"
platform: "onnxruntime_onnx"
max_batch_size: {slots}
sequence_batching {{
  {idle}state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32
              dims: [ 1 ] initial_state {{ name: "zero" data_type: TYPE_INT32 dims: [ 1 ]
              zero_data: true }} }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
''')


PY_ACCUMULATE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sums INPUT per sequence, keyed by its CORRID input (a string sequence id); START
    resets the sum. OUTPUT is the running sum."""

    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()[0]
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy()[0])
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0])
            total = value + (0 if start else self.sums.get(corrid, 0))
            self.sums[corrid] = total
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", np.array([total], dtype=np.int32))]))
        return responses
'''


def python_accumulate(root: Path, name: str = "py_accumulate") -> None:
    python_model(root, name, PY_ACCUMULATE, f'''name: "{name}"
backend: "python"
max_batch_size: 0
sequence_batching {{
  control_input [ {_flag("START", "CONTROL_SEQUENCE_START")},
                  {{ name: "CORRID" control [{{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING }}] }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
''')
