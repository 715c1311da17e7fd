"""Five small QA suites against Trireme (triton_qa.py --only <suite>), one server each run:

  input_validation      qa/L0_input_validation/test.sh, its three Python sections:
                        InputValTest (repository `models`: the three python models the
                        folder holds); InputShapeTest (`--allow-client-shm=true`; models +
                        qa_model_repository/onnx_object_int32_int32; test.sh also adds
                        pt_identity, made with torch.jit, and two TensorRT shape-tensor
                        models: not made here, PyTorch/TensorRT); ModelNameValidationTest
                        (an empty repository, --model-control-mode=explicit --log-verbose=1).
                        The C++ input_byte_size_test and tensor_size_test (Triton's
                        in-process API) are skipped.
  string_io             qa/L0_string_io/test.sh: string_client_test.py against
                        qa_identity_model_repository/onnx_zero_1_object and
                        ../python_models/string_identity (dims [ 8 ])
  nan_inf               qa/L0_nan_inf/test.sh: nan_inf_test.py, the folder's nan_inf_output
                        (which, like the test, uses np.NINF: NumPy 1's aliases are put back
                        on both sides, qa_gen.compat_pythonpath, as Dockerfile.QA has numpy<2)
  output_name           qa/L0_output_name/test.sh: output_name_test.py
                        OutputNameValidationTest against qa_identity_model_repository/
                        *_nobatch_zero_1_float32 (onnx only: the libtorch/plan ones are not
                        generated; the test tries libtorch first and fails there); the old
                        tritongrpcclient.grpc_service_pb2 names via qa_gen.compat_pythonpath
  initializer_as_input  qa/L0_initializer_as_input/test.sh: test.py against the folder's
                        add_with_initializer ONNX model
"""
from __future__ import annotations

import shutil
from pathlib import Path

import qa_gen
import qa_tree

SUITES = ("input_validation", "string_io", "nan_inf", "output_name", "initializer_as_input")
EXPORT_PATHS = ("qa/L0_input_validation", "qa/L0_string_io", "qa/L0_nan_inf",
                "qa/L0_output_name", "qa/L0_initializer_as_input",
                "qa/python_models/string_identity")


def _input_validation(work: Path, phase_cls, log) -> list:
    test_dir = work / "qa" / "L0_input_validation"
    phase = qa_gen.make_phase(phase_cls, "input_validation", "L0_input_validation")
    models = test_dir / "models"
    shape_models = test_dir / "models_shape"   # test.sh adds to `models`; both runs kept apart
    shutil.rmtree(shape_models, ignore_errors=True)
    qa_gen.copytree(models, shape_models)
    repo = qa_gen.datadir(work, "qa_model_repository", log)
    qa_gen.copytree(repo / "onnx_object_int32_int32", shape_models / "onnx_object_int32_int32")
    empty = test_dir / "test_models"
    shutil.rmtree(empty, ignore_errors=True)
    empty.mkdir()
    test = "input_validation_test.py"
    return [
        phase("InputValTest", "models", test, ("InputValTest",), models),
        phase("InputShapeTest", "models + onnx_object_int32_int32, --allow-client-shm=true "
              "(no pt_identity, no plan models)", test, ("InputShapeTest",), shape_models,
              ("--allow-client-shm=true",)),
        phase("ModelNameValidationTest", "empty repository, explicit, --log-verbose=1", test,
              ("ModelNameValidationTest",), empty,
              ("--model-control-mode=explicit", "--log-verbose=1")),
    ]


def _string_io(work: Path, phase_cls, log) -> list:
    test_dir = work / "qa" / "L0_string_io"
    models = test_dir / "models"
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir()
    ident = qa_gen.datadir(work, "qa_identity_model_repository", log)
    qa_gen.copytree(ident / "onnx_zero_1_object", models / "onnx_zero_1_object")
    si = qa_gen.copytree(work / "qa" / "python_models" / "string_identity",
                         models / "string_identity")
    (si / "1").mkdir()
    shutil.move(si / "model.py", si / "1" / "model.py")
    qa_gen.sed(si / "config.pbtxt", r"\[ 1 \]", "[ 8 ]", count=0)
    # sed "s/\[ 1 \]/\[ 8 \]/": the first match of every line (each line has at most one)
    phase = qa_gen.make_phase(phase_cls, "string_io", "L0_string_io")
    return [phase("string_client_test", "models", "string_client_test.py",
                  repository=models, expected=1)]


def _nan_inf(work: Path, phase_cls, log) -> list:
    phase = qa_gen.make_phase(phase_cls, "nan_inf", "L0_nan_inf")
    return [phase("nan_inf_test", "models (NumPy 1 aliases)", "nan_inf_test.py",
                  repository=work / "qa" / "L0_nan_inf" / "models", expected=3,
                  env={"PYTHONPATH": qa_gen.compat_pythonpath(work)},
                  # the model itself uses np.NINF: the server's Python models get them too
                  server_env={"PYTHONPATH": str(work / "shims_compat")})]


def _output_name(work: Path, phase_cls, log) -> list:
    models = work / "qa" / "L0_output_name" / "models"
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir()
    ident = qa_gen.datadir(work, "qa_identity_model_repository", log)
    for d in sorted(ident.glob("*_nobatch_zero_1_float32")):
        qa_gen.copytree(d, models / d.name)
    phase = qa_gen.make_phase(phase_cls, "output_name", "L0_output_name")
    return [phase("OutputNameValidationTest", "models (onnx_nobatch_zero_1_float32)",
                  "output_name_test.py", ("OutputNameValidationTest",), models, expected=1,
                  env={"PYTHONPATH": qa_gen.compat_pythonpath(work)})]


def _initializer_as_input(work: Path, phase_cls, log) -> list:
    phase = qa_gen.make_phase(phase_cls, "initializer_as_input", "L0_initializer_as_input")
    return [phase("test", "models", "test.py",
                  repository=work / "qa" / "L0_initializer_as_input" / "models")]


_BUILDERS = {"input_validation": _input_validation, "string_io": _string_io,
             "nan_inf": _nan_inf, "output_name": _output_name,
             "initializer_as_input": _initializer_as_input}


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    wanted = [s for s in SUITES if s in suites]
    if not wanted:
        return []
    log(f"{', '.join(wanted)}: exported "
        f"{', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    out = []
    for s in wanted:
        out += _BUILDERS[s](work, phase_cls, log)
    return out
