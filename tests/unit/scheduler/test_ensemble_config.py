"""services.scheduler.ensemble_config: Triton's ensemble checks, texts and order.

The QA_* tests port Triton server's qa/L0_model_config ensemble cases (the folder named in
each test): their configs written here with the pbtxt helpers below, their `expected` file
(a grep pattern the server's error must contain; a second file where Triton's hash order
allows another answer) checked against our full text, which is asserted exactly too.
Our own graphs and the labels: test_ensemble_graphs.py; the pbtxt helpers: ensemble_pbtxt.py.
"""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from services.common import config as C
from services.scheduler.ensemble_config import (
    circular_dependency_text,
    dependency_failed_text,
    missing_models_text,
    no_loaded_version_text,
    validate_ensemble,
    validate_steps,
    version_not_loaded_text,
)
from tests.unit.scheduler.ensemble_pbtxt import (
    assert_qa,
    ensemble,
    error,
    identity,
    io,
    model,
    parse,
    passes,
    step,
)

# The composing models of the qa cases (identity backend, completed configs).
ZOO = {m.name: m for m in (
    identity("fp32_dim1_batch4", 4), identity("fp32_dim1_batch2", 2),
    identity("int32_dim1_batch4", 4, dtype="INT32"), identity("fp32_dim3_batch4", 4, dims=(16, 16, 16)),
    identity("fp32_dim1_batch4_input4", 4, 4, 4), identity("fp32_dim1_batch4_output3", 4, 3, 3),
    identity("fp32_dim2_nobatch", 0, dims=(-1, 16)),
    identity("int32_dim1_nobatch_output2", 0, 2, 2, "INT32", (1,)),
    model("repeat_int32", 0, [io("IN", "INT32", (-1,)), io("DELAY", "UINT32", (-1,)),
                              io("WAIT", "UINT32", (1,))],
          [io("OUT", "INT32", (1,)), io("IDX", "UINT32", (1,))],
          "model_transaction_policy { decoupled: true }"),
)}
REPEAT_IN = {"IN": "IN", "DELAY": "DELAY", "WAIT": "WAIT"}
REPEAT_IO = [io("IN", "INT32", (-1,)), io("DELAY", "UINT32", (-1,)), io("WAIT", "UINT32", (1,))]

# The four-step graph many qa cases vary: two models feed fp32_dim1_batch4_input4.
ONE, OUT3, IN4 = "fp32_dim1_batch4", "fp32_dim1_batch4_output3", "fp32_dim1_batch4_input4"
OUT3_MAP = {"output1": "temp_tensor_1", "output2": "temp_tensor_2", "output3": "temp_tensor_3"}
IN4_STEP = step(IN4, {"input1": "temp_tensor_1", "input2": "temp_tensor_2", "input3": "temp_tensor_3",
                      "input4": "temp_tensor_4"}, {"output": "prob"})


# ------------------------------------------------------------- qa: the ensemble's own config
QA_OWN = [
    ("ensemble_scheduling_no_set",
     parse('name: "ensemble_scheduling_not_set" max_batch_size: 8 platform: "ensemble" '
           f'input [ {io("data", dims=(1, 28, 28))} ] output [ {io("prob", dims=(10, 1, 1))} ]'),
     "ensemble scheduling must be set for ensemble ensemble_scheduling_not_set whose platform is "
     "ensemble"),
    ("noautofill_platform/ensemble_scheduling_set",  # test.sh swaps in each other platform
     ensemble("ensemble_scheduling_set", [step("model_a", {"model_a_input": "data"},
                                               {"model_a_output": "prob"})],
              mbs=8, extra="instance_group [ { kind: KIND_GPU gpus: [ 42 ] } ]",
              platform="onnxruntime_onnx"),
     "ensemble scheduling cannot be set for model 'ensemble_scheduling_set' whose platform is not "
     "ensemble"),
    ("instance_group_set",
     ensemble("instance_group_set", [step("model_a", {"model_a_input": "data"},
                                          {"model_a_output": "prob"})],
              mbs=8, extra="instance_group [ { kind: KIND_GPU gpus: [ 42 ] } ]"),
     "instance group should not be specified for ensemble 'instance_group_set'"),
    ("optimization_set",
     ensemble("optimization_set", [step("model_a", {"model_a_input": "data"}, {"model_a_output": "prob"})],
              mbs=8, extra="optimization { priority: PRIORITY_MAX }"),
     "optimization should not be specified for ensemble 'optimization_set'"),
    ("model_warm_up_set",
     ensemble("model_warmup_set", [step("model_a", {"model_a_input": "data"}, {"model_a_output": "prob"})],
              mbs=8, extra="model_warmup [{}]"),
     "model_warmup can not be specified for ensemble 'model_warmup_set'"),
    ("no_step", ensemble("no_step", [], mbs=8), "must specify 'step' for ensemble 'no_step'"),
    ("no_step_2",
     parse('name: "no_step_2" max_batch_size: 8 platform: "ensemble" ensemble_scheduling { } '
           f'input [ {io("data")} ] output [ {io("prob")} ]'),
     "must specify 'step' for ensemble 'no_step_2'"),
    ("no_model_name",
     ensemble("no_model_name", [step("model_a", {"model_a_input": "data"}, {"model_a_output": "temp_1"}),
                                step("", {"model_b_input": "temp_1"}, {"model_b_output": "temp_2"}),
                                step("model_c", {"model_c_input": "temp_2"}, {"model_c_output": "prob"})]),
     "must specify 'model_name' in step 1 of ensemble 'no_model_name'"),
    ("no_input_map",
     ensemble("no_input_map", [step("model_a", {"model_a_input": "data"}, {"model_a_output": "temp_1"}),
                               step("model_b", {}, {"model_b_output": "temp_2"}),
                               step("model_c", {"model_c_input": "temp_2"}, {"model_c_output": "prob"})]),
     "must specify 'input_map' in step 1 of ensemble 'no_input_map'"),
    ("no_output_map",
     ensemble("no_output_map", [step("model_a", {"model_a_input": "data"}, {"model_a_output": "temp_1"}),
                                step("model_b", {"model_b_input": "temp_1"}, {}),
                                step("model_c", {"model_c_input": "temp_2"}, {"model_c_output": "prob"})]),
     "must specify 'output_map' in step 1 of ensemble 'no_output_map'"),
    ("output_to_tensor_overmapped",
     ensemble("output_to_tensor_overmapped", [
         step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
         step(ONE, {"input": "data"}, {"output": "temp_tensor_1"}),
         step(OUT3, {"input": "data"}, {"output1": "temp_tensor_2", "output2": "temp_tensor_2",
                                        "output3": "temp_tensor_3"}),
         IN4_STEP]),
     "ensemble tensor 'temp_tensor_2' can appear in an output map only once for ensemble "
     "'output_to_tensor_overmapped' step 2"),
    ("redundant_tensor_as_input",
     ensemble("redundant_tensor_as_input", [
         step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
         step(ONE, {"input": "temp_tensor_5"}, {"output": "temp_tensor_6"}),
         step(OUT3, {"input": "temp_tensor_4"}, OUT3_MAP), IN4_STEP]),
     "ensemble tensor 'temp_tensor_6' is unused in ensemble 'redundant_tensor_as_input'"),
    ("redundant_tensor_as_output",
     ensemble("redundant_tensor_as_output", [
         step(ONE, {"input": "data"}, {"output": "temp_tensor_1"}),
         step(OUT3, {"input": "temp_tensor_1"}, {"output1": "prob", "output2": "prob_2",
                                                 "output3": "temp_tensor_2"})],
              outputs=[io("prob"), io("prob_2")]),
     "ensemble tensor 'temp_tensor_2' is unused in ensemble 'redundant_tensor_as_output'"),
    ("tensor_to_input_overmapped",  # a repeated map key: the last one stands
     ensemble("tensor_to_input_overmapped", [
         step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
         step(ONE, {"input": "temp_tensor_4"}, {"output": "temp_tensor_5"}),
         step(OUT3, {"input": "data"}, OUT3_MAP),
         step(IN4, [("input1", "temp_tensor_1"), ("input2", "temp_tensor_2"), ("input3", "temp_tensor_3"),
                    ("input4", "temp_tensor_5"), ("input4", "temp_tensor_4")], {"output": "prob"})]),
     "ensemble tensor 'temp_tensor_5' is unused in ensemble 'tensor_to_input_overmapped'"),
    ("unreachable_input",
     ensemble("unreachable_input", [step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
                                    step(OUT3, {"input": "data"}, OUT3_MAP), IN4_STEP],
              inputs=[io("data"), io("data_2")]),
     "ensemble input 'data_2' for ensemble unreachable_input' is not used"),
    ("unreachable_output",
     ensemble("unreachable_output", [step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
                                     step(OUT3, {"input": "data"}, OUT3_MAP), IN4_STEP],
              outputs=[io("prob"), io("prob_2")]),
     "ensemble output 'prob_2' for ensemble unreachable_output' is not used"),
    ("unreachable_output_2",
     ensemble("unreachable_output_2", [step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
                                       step(ONE, {"input": "prob_2"}, {"output": "prob_2"}),
                                       step(OUT3, {"input": "data"}, OUT3_MAP), IN4_STEP],
              outputs=[io("prob"), io("prob_2")]),
     "output 'prob_2' for ensemble 'unreachable_output_2' is not written"),
    ("unreachable_output_3",
     ensemble("unreachable_output_3", [step(ONE, {"input": "data"}, {"output": "temp_tensor_4"}),
                                       step(ONE, {"input": "not_written_tensor"}, {"output": "prob_2"}),
                                       step(OUT3, {"input": "data"}, OUT3_MAP), IN4_STEP],
              outputs=[io("prob"), io("prob_2")]),
     "output 'prob_2' for ensemble 'unreachable_output_3' is not written: at least one of its "
     "depending tensors, 'not_written_tensor', is not connected"),
]
QA_SECOND_TEXT = {  # the other expected file, where Triton's hash order allows either text
    "redundant_tensor_as_input": "ensemble tensor 'temp_tensor_5' is unused in ensemble "
                                 "'redundant_tensor_as_input'",
}
QA_EXPECTED = {  # the qa expected file where it is shorter than Triton's whole text
    "output_to_tensor_overmapped": "ensemble tensor 'temp_tensor_2' can appear in an output map only "
                                   "once for ensemble 'output_to_tensor_overmapped'",
}


@pytest.mark.parametrize("case,cfg,full", QA_OWN, ids=[c[0] for c in QA_OWN])
def test_qa_own_config(case, cfg, full):
    expected = [QA_EXPECTED.get(case, full)] + ([QA_SECOND_TEXT[case]] if case in QA_SECOND_TEXT else [])
    assert_qa(error(validate_ensemble, cfg), full, *expected)


def test_qa_has_backend_is_config_validate():
    # qa ensemble/has_backend fails in ValidateModelConfig before the ensemble checks
    cfg = parse('name: "has_backend" max_batch_size: 8 backend: "onnxruntime" platform: "ensemble" '
                f'input [ {io("data", dims=(1, 28, 28))} ] output [ {io("prob", dims=(10, 1, 1))} ]')
    assert_qa(error(C.validate, cfg),
              "Ensemble model 'has_backend' must have platform type 'ensemble' and empty backend type",
              "Ensemble model 'has_backend' must have platform type 'ensemble' and empty backend type")


# --------------------------------------------------------- qa: against the composing models
def check_steps(cfg: mc.ModelConfig) -> str:
    validate_ensemble(cfg)  # each of these passes the ensemble's own checks first
    return error(validate_steps, cfg, ZOO)


def test_qa_inconsistent_data_type():
    cfg = ensemble("inconsistent_data_type", [
        step("int32_dim1_batch4", {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
        step("fp32_dim1_batch2", {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"})])
    text = ("in ensemble inconsistent_data_type, ensemble tensor data: inconsistent data type: TYPE_FP32 "
            "is inferred from model inconsistent_data_type while TYPE_INT32 is inferred from model "
            "int32_dim1_batch4")
    assert_qa(check_steps(cfg), text, text)


def test_qa_inconsistent_shape():
    cfg = ensemble("inconsistent_shape", [
        step("fp32_dim1_batch4", {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
        step("fp32_dim3_batch4", {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"})])
    assert_qa(check_steps(cfg),
              "in ensemble inconsistent_shape, ensemble tensor temp_tensor: inconsistent shape: [-1,16] is "
              "inferred from model fp32_dim1_batch4 while [-1,16,16,16] is inferred from model "
              "fp32_dim3_batch4",
              r"in ensemble inconsistent_shape, ensemble tensor temp_tensor: inconsistent shape: \[-1,16\] "
              r"is inferred from model fp32_dim1_batch4 while \[-1,16,16,16\] is inferred from model "
              r"fp32_dim3_batch4")


def test_qa_invalid_batch_size():
    cfg = ensemble("invalid_batch_size", [
        step("fp32_dim1_batch4", {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
        step("fp32_dim1_batch2", {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"})], mbs=3)
    text = ("ensemble invalid_batch_size allows maximum batch size 3, but it contains model "
            "fp32_dim1_batch2 which only allows maximum batch size to be 2")
    assert_qa(check_steps(cfg), text, text)


def test_qa_invalid_decoupled_branching():
    cfg = ensemble("invalid_decoupled_branching", [
        step("repeat_int32", REPEAT_IN, {"OUT": "repeat_1_out"}),
        step("repeat_int32", REPEAT_IN, {"OUT": "repeat_2_out"}),
        step("int32_dim1_nobatch_output2", {"INPUT0": "repeat_1_out", "INPUT1": "repeat_2_out"},
             {"OUTPUT0": "identity_0", "OUTPUT1": "identity_1"}),
        step("int32_dim1_nobatch_output2", {"INPUT0": "identity_0", "INPUT1": "identity_1"},
             {"OUTPUT0": "OUT"})],
        inputs=REPEAT_IO, outputs=[io("OUT", "INT32", (1,))], mbs=0)
    text = ("in ensemble invalid_decoupled_branching, step of model 'int32_dim1_nobatch_output2' "
            "receives inputs originated from different decoupled models")
    assert_qa(check_steps(cfg), text, text)


def test_qa_invalid_decoupled_branching_2():
    # two decoupled steps write the ensemble's outputs: the response itself cannot pair them
    cfg = ensemble("invalid_decoupled_branching_2", [
        step("repeat_int32", REPEAT_IN, {"OUT": "OUT"}), step("repeat_int32", REPEAT_IN, {"IDX": "IDX"})],
        inputs=REPEAT_IO, outputs=[io("OUT", "INT32", (1,)), io("IDX", "UINT32", (1,))], mbs=0)
    text = ("in ensemble invalid_decoupled_branching_2, step of model 'invalid_decoupled_branching_2' "
            "receives inputs originated from different decoupled models")
    assert_qa(check_steps(cfg), text, text)


def test_qa_invalid_input_map():
    cfg = ensemble("invalid_input_map", [
        step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor_4"}),
        step(ONE, {"INPUT0": "temp_tensor_4"}, {"OUTPUT0": "temp_tensor_5"}),
        step(OUT3, {"INPUT0": "data", "INPUT1": "data", "INPUT2": "data"},
             {"OUTPUT0": "temp_tensor_1", "OUTPUT1": "temp_tensor_2", "OUTPUT2": "temp_tensor_3"}),
        step(IN4, {"INPUT0": "temp_tensor_1", "INPUT1": "temp_tensor_2", "INPUT2": "temp_tensor_3",
                   "INPUT3": "temp_tensor_4", "invalid_input": "temp_tensor_5"}, {"OUTPUT0": "prob"})])
    text = ("in ensemble invalid_input_map, ensemble tensor temp_tensor_5 is mapping to non-existing "
            "input invalid_input in model fp32_dim1_batch4_input4")
    assert_qa(check_steps(cfg), text, text)


def test_qa_invalid_output_map():
    cfg = ensemble("invalid_output_map", [
        step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor_4"}),
        step(OUT3, {"INPUT0": "data", "INPUT1": "data", "INPUT2": "data"},
             {"OUTPUT0": "temp_tensor_1", "invalid_output": "temp_tensor_2"}),
        step(IN4, {"INPUT0": "temp_tensor_1", "INPUT1": "temp_tensor_2", "INPUT2": "temp_tensor_1",
                   "INPUT3": "temp_tensor_4"}, {"OUTPUT0": "prob"})])
    text = ("in ensemble invalid_output_map, ensemble tensor temp_tensor_2 is mapped from non-existing "
            "output invalid_output in model fp32_dim1_batch4_output3")
    assert_qa(check_steps(cfg), text, text)


def test_qa_unmapped_input():
    cfg = ensemble("unmapped_input", [
        step(OUT3, {"INPUT0": "data", "INPUT1": "data", "INPUT2": "data"},
             {"OUTPUT0": "temp_tensor_2", "OUTPUT1": "temp_tensor_3", "OUTPUT2": "temp_tensor_4"}),
        step(IN4, {"INPUT1": "temp_tensor_2", "INPUT2": "temp_tensor_3", "INPUT3": "temp_tensor_4"},
             {"OUTPUT0": "prob"})])
    text = ("in ensemble unmapped_input, input INPUT0 in model fp32_dim1_batch4_input4 is not mapped to "
            "any ensemble tensors")
    assert_qa(check_steps(cfg), text, text)


NON_EXISTING = ensemble("non_existing_model", [
    step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor_4"}),
    step(OUT3, {"INPUT0": "data", "INPUT1": "data", "INPUT2": "data"},
         {"OUTPUT0": "temp_tensor_1", "OUTPUT1": "temp_tensor_2", "OUTPUT2": "temp_tensor_3"}),
    step(IN4, {"input1": "temp_tensor_1", "input2": "temp_tensor_2", "input3": "temp_tensor_3",
               "input4": "temp_tensor_4"}, {"output": "prob"})])


def test_qa_non_existing_model():
    text = ("ensemble non_existing_model contains models that are not available or ambiguous: "
            "fp32_dim1_batch4_input4")
    validate_ensemble(NON_EXISTING)
    present = {k: v for k, v in ZOO.items() if k != IN4}
    assert_qa(missing_models_text("non_existing_model", [IN4]), text, text)
    assert_qa(error(validate_steps, NON_EXISTING, present), text, text)


def test_missing_models_text_names_the_first_missing_step_only():
    # Triton sets the status at the first missing step and keeps it
    assert missing_models_text("e", ["zeta", "alpha"]) == \
        "ensemble e contains models that are not available or ambiguous: zeta"
    cfg = ensemble("e", [step("zeta", {"INPUT0": "data"}, {"OUTPUT0": "t"}),
                         step("alpha", {"INPUT0": "t"}, {"OUTPUT0": "prob"})])
    assert error(validate_steps, cfg, {}) == \
        "ensemble e contains models that are not available or ambiguous: zeta"


def test_qa_circular_dependency():
    a = ensemble("circular_dependency",
                 [step("circular_dependency_2", {"input": "data"}, {"output": "prob"})])
    b = ensemble("circular_dependency_2",
                 [step("circular_dependency", {"data": "input"}, {"prob": "output"})],
                 inputs=[io("input")], outputs=[io("output")])
    configs = {"circular_dependency": a, "circular_dependency_2": b}
    validate_ensemble(a)
    validate_ensemble(b)
    text_a = ("circular dependency between ensembles: circular_dependency -> ... -> circular_dependency_2 "
              "-> circular_dependency")
    text_b = ("circular dependency between ensembles: circular_dependency_2 -> ... -> circular_dependency "
              "-> circular_dependency_2")
    assert_qa(circular_dependency_text("circular_dependency", configs) or "", text_a, text_a, text_b)
    assert_qa(circular_dependency_text("circular_dependency_2", configs) or "", text_b, text_a, text_b)


def test_qa_self_circular_dependency():
    cfg = ensemble("self_circular_dependency", [
        step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor_4"}),
        step(OUT3, {"INPUT0": "data", "INPUT1": "data", "INPUT2": "data"},
             {"OUTPUT0": "temp_tensor_1", "OUTPUT1": "temp_tensor_2", "OUTPUT2": "temp_tensor_3"}),
        step(IN4, {"INPUT0": "temp_tensor_1", "INPUT1": "temp_tensor_2", "INPUT2": "temp_tensor_3",
                   "INPUT3": "temp_tensor_4"}, {"OUTPUT0": "temp_tensor_5"}),
        step("self_circular_dependency", {"data": "temp_tensor_5"}, {"prob": "prob"})])
    validate_ensemble(cfg)
    text = ("circular dependency between ensembles: self_circular_dependency -> ... -> "
            "self_circular_dependency -> self_circular_dependency")
    assert_qa(circular_dependency_text(cfg.name, {**ZOO, cfg.name: cfg}) or "", text, text)


def test_circular_dependency_none_for_a_nested_ensemble():
    inner = ensemble("inner", [step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "prob"})])
    outer = ensemble("outer", [step("inner", {"data": "data"}, {"prob": "prob"})])
    assert circular_dependency_text("outer", {**ZOO, "inner": inner, "outer": outer}) is None


@pytest.mark.parametrize("case", ["no_required_version", "no_required_version_2", "no_required_version_3"])
def test_qa_no_required_version(case):
    # the texts only: which versions loaded is the repository's business
    text = version_not_loaded_text(case, "simple", 2)
    assert_qa(text, f"ensemble '{case}' depends on 'simple' whose required version 2 is not loaded.",
              f"ensemble '{case}' depends on 'simple' whose required version 2 is not loaded")


def test_dependency_status_texts():
    assert dependency_failed_text("e", "m", "boom") == \
        "ensemble 'e' depends on 'm' which is not valid. Model 'm' failed with error: boom"
    assert no_loaded_version_text("e", "m") == "ensemble 'e' depends on 'm' which has no loaded version."
    assert no_loaded_version_text("e", "m", "boom") == ("ensemble 'e' depends on 'm' which has no loaded "
                                                        "version. Model 'm' loading failed with error: boom")


# ------------------------------------------------------------------- qa: configs that load

def test_qa_success_embedded_ensemble():
    inner = ensemble("inner_ensemble", [step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "prob"})])
    outer = ensemble("embedded_ensemble", [step("inner_ensemble", {"data": "data"}, {"prob": "prob"})])
    passes(inner, ZOO)
    passes(outer, {"inner_ensemble": inner})


def test_qa_success_inconsistent_shape():
    # batching [16] meets non-batching [-1,16]: the full shapes agree
    passes(ensemble("inconsistent_shape", [
        step(ONE, {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
        step("fp32_dim2_nobatch", {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"})]), ZOO)


def test_qa_success_inconsistent_shape_2():
    passes(ensemble("inconsistent_shape_2", [
        step("fp32_dim2_nobatch", {"INPUT0": "data"}, {"OUTPUT0": "temp_tensor"}),
        step(ONE, {"INPUT0": "temp_tensor"}, {"OUTPUT0": "prob"})],
        inputs=[io("data", dims=(4, 16))], outputs=[io("prob", dims=(4, 16))], mbs=0), ZOO)


def test_qa_success_unmapped_output():
    passes(ensemble("unmapped_output", [
        step(OUT3, {"INPUT0": "data", "INPUT1": "data", "INPUT2": "data"}, {"OUTPUT0": "prob"})]), ZOO)


def test_qa_success_python_conflicting_scheduler_ensemble():
    # the steps' auto-complete gives them max_batch_size 4 and dynamic batching; the ensemble is 0
    first = model("ensemble_first_step", 4, [io("INPUT0", dims=(4,))], [io("OUTPUT0", dims=(4,))],
                  "dynamic_batching { }")
    second = model("ensemble_second_step", 4, [io("INPUT0", dims=(4,))], [io("OUTPUT0", dims=(4,))],
                   "dynamic_batching { }")
    passes(ensemble("conflicting_scheduler_ensemble", [
        step("ensemble_first_step", {"INPUT0": "ENSEMBLE_INPUT0"}, {"OUTPUT0": "temp_output_0"}, 1),
        step("ensemble_second_step", {"INPUT0": "temp_output_0"}, {"OUTPUT0": "ENSEMBLE_OUTPUT0"}, 1)],
        inputs=[io("ENSEMBLE_INPUT0", dims=(4,))], outputs=[io("ENSEMBLE_OUTPUT0", dims=(4,))], mbs=0),
        {"ensemble_first_step": first, "ensemble_second_step": second})
