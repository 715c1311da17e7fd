"""services.scheduler.ensemble_config on Trireme's own ensemble graphs (chains, diamonds,
fan-out, ensembles of ensembles, cycles, reshapes, wildcards, decoupled steps) and the
labels an ensemble output takes from its step. Triton's qa cases: test_ensemble_config.py."""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from services.scheduler.ensemble_config import (
    ensemble_labels,
    is_decoupled,
    step_order,
    validate_ensemble,
    validate_steps,
)
from tests.unit.scheduler.ensemble_pbtxt import ensemble, error, io, model, passes, step

ADD_SUB = model("add_sub", 8, [io("INPUT0", dims=(4,)), io("INPUT1", dims=(4,))],
                [io("OUTPUT0", dims=(4,)), io("OUTPUT1", dims=(4,))])
SCALE = model("scale", 8, [io("INPUT0", dims=(4,))], [io("OUTPUT0", dims=(4,))])
ADD = model("add", 8, [io("INPUT0", dims=(4,)), io("INPUT1", dims=(4,))], [io("OUTPUT0", dims=(4,))])
MODELS = {m.name: m for m in (ADD_SUB, SCALE, ADD)}
V4 = (4,)


def chain() -> mc.ModelConfig:
    return ensemble("chain", [
        step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "sum", "OUTPUT1": "DIFF"}),
        step("scale", {"INPUT0": "sum"}, {"OUTPUT0": "SCALED"})],
        inputs=[io("A", dims=V4), io("B", dims=V4)], outputs=[io("SCALED", dims=V4), io("DIFF", dims=V4)],
        mbs=8)


DIAMOND_STEPS = [step("scale", {"INPUT0": "x"}, {"OUTPUT0": "t"}),        # 0: top
                 step("scale", {"INPUT0": "t"}, {"OUTPUT0": "left"}),     # 1
                 step("scale", {"INPUT0": "t"}, {"OUTPUT0": "right"}),    # 2
                 step("add", {"INPUT0": "left", "INPUT1": "right"}, {"OUTPUT0": "y"})]  # 3: bottom


def diamond(order=(0, 1, 2, 3)) -> mc.ModelConfig:
    return ensemble("diamond", [DIAMOND_STEPS[i] for i in order], inputs=[io("x", dims=V4)],
                    outputs=[io("y", dims=V4)], mbs=8)


def test_valid_chain_diamond_and_fan_out():
    fan_out = ensemble("fan_out", [step("scale", {"INPUT0": "x"}, {"OUTPUT0": "y1"}),
                                   step("add_sub", {"INPUT0": "x", "INPUT1": "x"}, {"OUTPUT1": "y2"})],
                       inputs=[io("x", dims=V4)], outputs=[io("y1", dims=V4), io("y2", dims=V4)], mbs=8)
    for cfg in (chain(), diamond(), diamond((3, 1, 0, 2)), fan_out):
        passes(cfg, MODELS)


def test_valid_ensemble_of_an_ensemble():
    inner = chain()
    outer = ensemble("outer", [step("chain", {"A": "a", "B": "b"}, {"SCALED": "s", "DIFF": "d"}),
                               step("add", {"INPUT0": "s", "INPUT1": "d"}, {"OUTPUT0": "out"})],
                     inputs=[io("a", dims=V4), io("b", dims=V4)], outputs=[io("out", dims=V4)], mbs=4)
    passes(outer, {"chain": inner, "add": ADD})
    assert step_order(outer) == [0, 1]


def test_step_order():
    assert step_order(chain()) == [0, 1]
    assert step_order(diamond()) == [0, 1, 2, 3]
    assert step_order(diamond((3, 1, 0, 2))) == [2, 1, 3, 0]  # top, left, right, bottom
    assert step_order(diamond((3, 2, 1, 0))) == [3, 1, 2, 0]


def test_step_order_refuses_a_cycle():
    cfg = ensemble("loop", [step("add", {"INPUT0": "x", "INPUT1": "y"}, {"OUTPUT0": "t"}),
                            step("scale", {"INPUT0": "t"}, {"OUTPUT0": "y"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4)])
    with pytest.raises(ValueError):
        step_order(cfg)


def test_a_cycle_is_an_unwritten_output():
    # y needs t, t needs y: the walk back ends at y itself, so Triton names no tensor
    cfg = ensemble("loop", [step("add", {"INPUT0": "x", "INPUT1": "y"}, {"OUTPUT0": "t"}),
                            step("scale", {"INPUT0": "t"}, {"OUTPUT0": "y"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4)])
    assert error(validate_ensemble, cfg) == "output 'y' for ensemble 'loop' is not written"


def test_two_steps_writing_one_tensor():
    cfg = ensemble("twice", [step("scale", {"INPUT0": "x"}, {"OUTPUT0": "y"}),
                             step("scale", {"INPUT0": "x"}, {"OUTPUT0": "y"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4)])
    assert error(validate_ensemble, cfg) == \
        "ensemble tensor 'y' can appear in an output map only once for ensemble 'twice' step 1"


def test_ensemble_output_type_against_the_step_writing_it():
    cfg = ensemble("e", [step("scale", {"INPUT0": "x"}, {"OUTPUT0": "y"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", "INT32", V4)], mbs=8)
    assert error(validate_steps, cfg, MODELS) == (
        "in ensemble e, ensemble tensor y: inconsistent data type: TYPE_INT32 is inferred from model e "
        "while TYPE_FP32 is inferred from model scale")


def test_ensemble_reshape_is_the_shape_steps_see():
    # Triton compares an ensemble input's reshape, not its dims, with the steps' inputs
    reshaped = ensemble("e", [step("scale", {"INPUT0": "x"}, {"OUTPUT0": "y"})],
                        inputs=[io("x", dims=(2, 2), extra="reshape { shape: [ 4 ] }")],
                        outputs=[io("y", dims=V4)], mbs=8)
    validate_steps(reshaped, MODELS)
    plain = ensemble("e", [step("scale", {"INPUT0": "x"}, {"OUTPUT0": "y"})],
                     inputs=[io("x", dims=(2, 2))], outputs=[io("y", dims=V4)], mbs=8)
    assert error(validate_steps, plain, MODELS) == (
        "in ensemble e, ensemble tensor x: inconsistent shape: [-1,2,2] is inferred from model e while "
        "[-1,4] is inferred from model scale")


def test_wildcards_match_and_non_batching_steps_are_allowed():
    any_len = model("any_len", 0, [io("INPUT0", dims=(-1, -1))], [io("OUTPUT0", dims=(-1, -1))])
    cfg = ensemble("e", [step("any_len", {"INPUT0": "x"}, {"OUTPUT0": "y"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4)], mbs=8)
    validate_steps(cfg, {"any_len": any_len})  # [-1,4] against [-1,-1]; mbs 0 is not "smaller"


def test_optional_input_may_stay_unmapped():
    opt = model("opt", 8, [io("INPUT0", dims=V4), io("INPUT1", dims=V4, extra="optional: true")],
                [io("OUTPUT0", dims=V4)])
    cfg = ensemble("e", [step("opt", {"INPUT0": "x"}, {"OUTPUT0": "y"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4)], mbs=8)
    validate_steps(cfg, {"opt": opt})


def test_decoupled_steps():
    dec = model("dec", 0, [io("INPUT0", dims=V4)], [io("OUTPUT0", dims=V4), io("OUTPUT1", dims=V4)],
                "model_transaction_policy { decoupled: true }")
    composing = {"dec": dec, "add": ADD}
    # both outputs of one decoupled step: one label, and the ensemble becomes decoupled
    one = ensemble("one", [step("dec", {"INPUT0": "x"}, {"OUTPUT0": "y", "OUTPUT1": "z"})],
                   inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4), io("z", dims=V4)], mbs=0)
    validate_steps(one, composing)
    assert is_decoupled(one, composing) is True
    # a decoupled step's responses joined with the ensemble's own input
    mixed = ensemble("mixed", [step("dec", {"INPUT0": "x"}, {"OUTPUT0": "t"}),
                               step("add", {"INPUT0": "t", "INPUT1": "x"}, {"OUTPUT0": "s"}),
                               step("scale", {"INPUT0": "s"}, {"OUTPUT0": "y"})],
                     inputs=[io("x", dims=V4)], outputs=[io("y", dims=V4)], mbs=0)
    validate_ensemble(mixed)
    assert error(validate_steps, mixed, {**composing, "scale": SCALE}) == (
        "in ensemble mixed, step of model 'add' receives inputs originated from different decoupled "
        "models")


# ------------------------------------------------------------------------- labels
def test_ensemble_labels_come_from_the_output_each_step_maps_to_an_ensemble_output():
    """Triton's model_lifecycle.cc: an ensemble output without labels of its own gets those
    of the composing model output mapped to it; intermediate tensors get none."""
    cfg = ensemble("e", [step("a", {"INPUT0": "data"}, {"OUTPUT0": "mid", "OUTPUT1": "prob"}),
                         step("b", {"INPUT0": "mid"}, {"OUTPUT0": "other"})],
                   outputs=(io("prob"), io("other"), io("own")))
    composing = {"a": {"OUTPUT0": ["m"], "OUTPUT1": ["x", "y"]}, "b": {}}
    assert ensemble_labels(cfg, {}, composing) == {"prob": ["x", "y"]}
    # the ensemble's own label file wins (also one whose first line is empty, as in Triton)
    own = {"prob": ["", "z"], "own": ["o"]}
    assert ensemble_labels(cfg, own, composing) == own
