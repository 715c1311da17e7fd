"""L0_batcher: Triton's dynamic batcher QA test against Trireme (triton_qa.py --only batcher).

Replays qa/L0_batcher/test.sh with BACKENDS=onnx (libtorch, plan: PyTorch / TensorRT;
python is in test.sh's default list but the brief of this replay is onnx only). Every
`python3 batcher_test.py BatcherTest.<case>` gets its own server, with BATCHER_TYPE and
TRITONSERVER_DELAY_SCHEDULER exported as test.sh exports them (the delay goes to the
server's environment, and the test checks it sees it too). Repositories:

  models                       qa_model_repository/onnx_float32_float32_float32,
                               max_batch_size 8, version 1 only, preferred [2, 6], 10 s delay
  preferred_batch_only_models  the same, preferred [4, 6], no delay
  var_models                   qa_variable_model_repository/onnx_float32_float32_float32
                               (same batching, 16 -> -1 in the config),
                               custom_zero_1_float32 (backend "identity", KIND_GPU as
                               test.sh writes it, ragged INPUT0) and onnx_zero_1_float32
                               (from onnx_nobatch_zero_1_float32, ragged INPUT0,
                               BATCH_SCATTER_WITH_INPUT_SHAPE batch_output)

Sections run: NO_DELAY_TESTS and DELAY_TESTS (FIXED, then VARIABLE), DIFFERENT_SHAPE_TESTS,
test_multi_batch_delayed_preferred_different_shape, PREFERRED_BATCH_ONLY_TESTS. Not run:
MAX_QUEUE_DELAY_ONLY_TESTS and the preserve-ordering trace cases (--trace-file,
verify_timestamps.py), queue_timeout_test.py, the C++ instance_queue_test.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import qa_gen
import qa_tree

SUITE = "batcher"
SUITES = (SUITE,)
TEST_DIR = "L0_batcher"
TEST = "batcher_test.py"
EXPORT_PATHS = ("qa/L0_batcher", "qa/custom_models/custom_zero_1_float32")
NO_DELAY_TESTS = ("test_static_batch_preferred", "test_static_batch_lt_any_preferred",
                  "test_static_batch_not_preferred", "test_static_batch_gt_max_preferred",
                  "test_multi_batch_not_preferred", "test_multi_batch_gt_max_preferred",
                  "test_multi_batch_sum_gt_max_preferred", "test_multi_same_output0",
                  "test_multi_same_output1", "test_multi_different_outputs",
                  "test_multi_different_output_order")
DELAY_TESTS = ("test_multi_batch_delayed_sum_gt_max_preferred",
               "test_multi_batch_use_biggest_preferred", "test_multi_batch_use_best_preferred",
               "test_multi_batch_delayed_use_max_batch")
DIFFERENT_SHAPE_TESTS = ("test_multi_batch_not_preferred_different_shape",
                         "test_multi_batch_preferred_different_shape",
                         "test_multi_batch_different_shape_allow_ragged",
                         "test_multi_batch_different_shape")
PREFERRED_BATCH_ONLY_TESTS = ("test_preferred_batch_only_aligned",
                              "test_preferred_batch_only_unaligned",
                              "test_preferred_batch_only_use_biggest_preferred",
                              "test_preferred_batch_only_use_no_preferred_size")
DB = "dynamic_batching { preferred_batch_size: [ 2, 6 ], max_queue_delay_microseconds: 10000000 }\n"


def _delay(case: str) -> str:
    """test.sh's `export TRITONSERVER_DELAY_SCHEDULER=6 && [[ ... ]] && ...` chain."""
    if case == "test_multi_batch_use_biggest_preferred":
        return "6"
    if case in ("test_multi_batch_use_best_preferred", "test_multi_batch_delayed_use_max_batch"):
        return "3"
    return "2"


def _preferred_delay(case: str) -> str:
    return {"test_preferred_batch_only_aligned": "4",
            "test_preferred_batch_only_unaligned": "5",
            "test_preferred_batch_only_use_biggest_preferred": "7"}.get(case, "3")


def _batching(cfg: Path, tail: str) -> None:
    text = cfg.read_text()
    text = re.sub(r"(?m)^max_batch_size:.*", "max_batch_size: 8", text)
    text = re.sub(r"(?m)^version_policy:.*", "version_policy: { specific { versions: [1] }}",
                  text)
    cfg.write_text(text + tail)


def build(work: Path, log) -> dict[str, Path]:
    test_dir = work / "qa" / TEST_DIR
    repo = qa_gen.datadir(work, "qa_model_repository", log)
    var = qa_gen.datadir(work, "qa_variable_model_repository", log)
    ident = qa_gen.datadir(work, "qa_identity_model_repository", log)
    out = {}
    for name, src, tail in (("models", repo, DB),
                            ("preferred_batch_only_models", repo,
                             "dynamic_batching { preferred_batch_size: [ 4, 6 ] }\n"),
                            ("var_models", var, DB)):
        d = test_dir / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        m = qa_gen.copytree(src / "onnx_float32_float32_float32",
                            d / "onnx_float32_float32_float32")
        _batching(m / "config.pbtxt", tail)
        out[name] = d
    var_models = out["var_models"]
    for cfg in var_models.glob("*/config.pbtxt"):
        qa_gen.sed(cfg, "16", "-1")
    cz = qa_gen.copytree(work / "qa" / "custom_models" / "custom_zero_1_float32",
                         var_models / "custom_zero_1_float32")
    (cz / "1").mkdir()
    cfg = cz / "config.pbtxt"
    qa_gen.append(cfg, "instance_group [ { kind: KIND_GPU count: 1 }]\n")
    qa_gen.sed(cfg, r"(?m)^max_batch_size:.*", "max_batch_size: 8")
    qa_gen.sed(cfg, r"dims:.*\[.*\]", "dims: [ -1 ]")
    qa_gen.sed(cfg, r'name:.*"INPUT0"', 'name: "INPUT0"\nallow_ragged_batch: true')
    qa_gen.sed(cfg, r"(?m)^version_policy:.*", "version_policy: { specific { versions: [1] }}")
    qa_gen.append(cfg, DB)
    oz = qa_gen.copytree(ident / "onnx_nobatch_zero_1_float32", var_models / "onnx_zero_1_float32")
    cfg = oz / "config.pbtxt"
    qa_gen.sed(cfg, "nobatch_", "", count=1)   # sed "s/nobatch_//": first per line
    qa_gen.sed(cfg, r"(?m)^max_batch_size:.*", "max_batch_size: 8")
    qa_gen.sed(cfg, r'name: "INPUT0"', 'name: "INPUT0"\nallow_ragged_batch: true')
    qa_gen.append(cfg, 'batch_output [{target_name: "OUTPUT0"                                     '
                  'kind: BATCH_SCATTER_WITH_INPUT_SHAPE                                     '
                  'source_input: "INPUT0" }]                     ' + DB)
    return out


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    if SUITE not in suites:
        return []
    log(f"batcher: exported {', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    repos = build(work, log)
    phase = qa_gen.make_phase(phase_cls, "batcher", TEST_DIR)
    base = {"BACKENDS": "onnx"}
    out = []

    def add(case: str, run: str, repo: str, btype: str, delay: str | None = None):
        env = {**base, "BATCHER_TYPE": btype}
        server_env = {}
        if delay is not None:
            env["TRITONSERVER_DELAY_SCHEDULER"] = delay
            server_env["TRITONSERVER_DELAY_SCHEDULER"] = delay
        label = f"{run}, {btype}" + (f", DELAY_SCHEDULER={delay}" if delay else "")
        out.append(phase(f"{case}.{btype}", label, TEST, (f"BatcherTest.{case}",),
                         repos[repo], expected=1, env=env, server_env=server_env))

    for btype, repo in (("FIXED", "models"), ("VARIABLE", "var_models")):
        for case in NO_DELAY_TESTS:
            add(case, "no delay", repo, btype)
        for case in DELAY_TESTS:
            add(case, "delay", repo, btype, _delay(case))
    for case in DIFFERENT_SHAPE_TESTS:
        add(case, "different shape", "var_models", "VARIABLE")
    add("test_multi_batch_delayed_preferred_different_shape", "different shape",
        "var_models", "VARIABLE", "4")
    for case in PREFERRED_BATCH_ONLY_TESTS:
        add(case, "preferred batch only", "preferred_batch_only_models", "FIXED",
            _preferred_delay(case))
    return out
