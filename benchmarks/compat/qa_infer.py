"""L0_infer: Triton's infer_test.py against Trireme (triton_qa.py --only infer).

Replays qa/L0_infer/test.sh with BACKENDS="onnx python" (its own environment variable;
libtorch, plan, python_dlpack and openvino are left out: they need PyTorch, TensorRT or
OpenVINO), ENSEMBLES=1 (its default: the ensembles of the onnx models, the nop_* models
on Trireme's identity backend, ../ensemble_models and custom_zero_1_float32, which is
`backend: "identity"` too), NOBATCH=1, BATCH=1. generate_model_repository, step by step:

  - onnx: cp -r $DATADIR/qa_model_repository/onnx* models/; rm models/onnx_*bf16* (TARGET cpu)
  - python: every onnx_* model of qa_model_repository (bf16 skipped) as python_*: its
    config without `platform:`, version_policy replaced by backend: "python", onnx->python;
    ../python_models/sub_add/model.py for the float32/int32/int16/int8 x3 models (batch and
    nobatch), ../python_models/add_sub/model.py for the others
  - ensembles: qa_ensemble_model_repository/qa_model_repository/*onnx* and nop_*,
    create_nop_version_dir, the eight ../ensemble_models that need only onnx
  - `instance_group [ { kind: KIND_CPU }]` appended to every models/onnx*/ and
    models/python*/ config (TARGET=cpu)
  - custom_zero_1_float32 and custom_nobatch_zero_1_float32 from ../custom_models

Only TARGET=cpu runs (the gpu TARGET needs a GPU); the test gets TRITON_SERVER_CPU_ONLY=1,
as Triton's CPU-only CI sets it. Server: `--exit-timeout-secs=600`
(qa_gen.SKIPPED_ARGS_NOTE). check_test_results: 44 tests (test.sh's 46 include two
ensemble tests that infer_test.py defines only with libtorch among BACKENDS).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import qa_gen
import qa_tree

SUITE = "infer"
SUITES = (SUITE,)
TEST_DIR = "L0_infer"
BACKENDS = "onnx python"
EXPECTED = 44   # test.sh's 46 counts test_ensemble_mix_platform and test_ensemble_mix_ensemble,
                # which infer_test.py defines only when BACKENDS has both onnx and libtorch
EXPORT_PATHS = ("qa/L0_infer", "qa/python_models/add_sub", "qa/python_models/sub_add",
                "qa/ensemble_models", "qa/custom_models/custom_zero_1_float32")
SWAP_TYPES = ("float32", "int32", "int16", "int8")
ENSEMBLE_MODELS = ("wrong_label_int32_float32_float32", "label_override_int32_float32_float32",
                   "mix_type_int32_float32_float32", "batch_to_nobatch_float32_float32_float32",
                   "batch_to_nobatch_nobatch_float32_float32_float32",
                   "nobatch_to_batch_float32_float32_float32",
                   "nobatch_to_batch_nobatch_float32_float32_float32",
                   "mix_nobatch_batch_float32_float32_float32")


def build_models(work: Path, log) -> Path:
    qa = work / "qa"
    models = qa / TEST_DIR / "models"
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir()
    repo = qa_gen.datadir(work, "qa_model_repository", log)
    ens = qa_gen.datadir(work, "qa_ensemble_model_repository/qa_model_repository", log)
    # onnx
    for d in sorted(repo.glob("onnx*")):
        qa_gen.copytree(d, models / d.name)
    for d in models.glob("onnx_*bf16*"):
        shutil.rmtree(d)
    # python
    swap = {f"python_{t}_{t}_{t}" for t in SWAP_TYPES} | \
           {f"python_nobatch_{t}_{t}_{t}" for t in SWAP_TYPES}
    for d in sorted(repo.iterdir()):
        if not d.is_dir() or "onnx_" not in d.name or "bf16" in d.name:
            continue
        py_name = d.name.replace("onnx", "python")
        src = "sub_add" if py_name in swap else "add_sub"
        qa_gen.python_from_onnx(d, models, qa / "python_models" / src / "model.py")
    # ensembles (ENSEMBLES=1): *onnx* ensembles, nop_*, create_nop_version_dir, ensemble_models
    for d in sorted(ens.glob("*onnx*")):
        qa_gen.copytree(d, models / d.name)
    for d in sorted(ens.glob("nop_*")):
        qa_gen.copytree(d, models / d.name)
    for d in models.iterdir():
        if "nop_" in d.name:
            (d / "1").mkdir(exist_ok=True)
    for em in ENSEMBLE_MODELS:
        src = qa / "ensemble_models" / em
        (src / "1").mkdir(parents=True, exist_ok=True)
        qa_gen.copytree(src, models / em)
    # instance groups, TARGET=cpu
    for fw in BACKENDS.split():
        for cfg in sorted(models.glob(f"{fw}*/config.pbtxt")):
            qa_gen.append(cfg, "instance_group [ { kind: KIND_CPU }]\n")
    # custom_zero_1_float32 / custom_nobatch_zero_1_float32
    cz = qa_gen.copytree(qa / "custom_models" / "custom_zero_1_float32",
                         models / "custom_zero_1_float32")
    (cz / "1").mkdir(exist_ok=True)
    qa_gen.append(cz / "config.pbtxt", "instance_group [ { kind: KIND_CPU }]\n")
    cn = qa_gen.copytree(cz, models / "custom_nobatch_zero_1_float32")
    qa_gen.sed(cz / "config.pbtxt", r"max_batch_size: 1", "max_batch_size: 8")
    qa_gen.sed(cz / "config.pbtxt", r"dims: \[ 1 \]", "dims: [ -1 ]")
    qa_gen.sed(cn / "config.pbtxt", r"custom_zero_1_float32", "custom_nobatch_zero_1_float32")
    qa_gen.sed(cn / "config.pbtxt", r"max_batch_size: 1", "max_batch_size: 0")
    qa_gen.sed(cn / "config.pbtxt", r"dims: \[ 1 \]", "dims: [ -1, -1 ]")
    return models


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    if SUITE not in suites:
        return []
    log(f"infer: exported {', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    models = build_models(work, log)
    phase = qa_gen.make_phase(phase_cls, "infer", TEST_DIR)
    return [phase("cpu", f"TARGET=cpu, BACKENDS={BACKENDS}, ENSEMBLES=1", "infer_test.py",
                  repository=models, args=("--exit-timeout-secs=600",), expected=EXPECTED,
                  env={"BACKENDS": BACKENDS, "ENSEMBLES": "1", "NOBATCH": "1", "BATCH": "1",
                       "TRITON_SERVER_CPU_ONLY": "1"})]
