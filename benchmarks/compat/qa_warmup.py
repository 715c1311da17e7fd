"""L0_warmup against Trireme (triton_qa.py --only warmup).

Replays qa/L0_warmup/test.sh with BACKENDS=onnx (libtorch and plan need PyTorch's C++
backend / TensorRT), SERVER_ARGS `--log-verbose=1 --exit-timeout-secs=120` (Trireme logs
"... is running warmup sample ..." at verbose level 1, as Triton), one server per section:

  fixed-size     qa_model_repository/onnx_float32_float32_float32 ('regular sample': INPUT0
                 zero, INPUT1 random, batch 1) and qa_sequence_model_repository/
                 onnx_sequence_int32 ('sequence sample': count 2, batch 8, INPUT / START /
                 READY zero): the server starts, the log holds "is running warmup sample
                 'regular sample'" and 'sequence sample' "for iteration 1" and "2", and no
                 "failed to run warmup"
  string         qa_identity_model_repository/onnx_zero_1_object ('zero string stateless',
                 'random string stateless') and onnx_sequence_object ('string statefull',
                 INPUT from warmup/raw_string_data: one element "233"): the three samples
                 logged, no "failed to run warmup"
  failing_infer  the folder's Python model whose every response is an error: the server
                 must fail to start, the log holding "failed to run warmup sample 'zero
                 sample': An Error Occurred;"
  decoupled      the folder's decoupled Python model (no response, only the final flag):
                 starts, "is running warmup sample 'decoupled sample'", no failure

The model_warmup blocks are appended to the generated configs line by line as test.sh's
`echo ... >> config.pbtxt` do. gen_qa_sequence_models.py writes `kind: KIND_GPU` into the
sequence models' configs; on a machine without a GPU (no `nvidia-smi -L`) both sections run
with those two groups turned into KIND_CPU (the run's name says so), since a KIND_GPU
instance cannot load there (Triton's text: "... has kind KIND_GPU but no GPUs are
available"), in Triton as in Trireme.

Not run: the last section (onnx_nobatch_float32_float32_float32 as KIND_GPU with a
model_warmup, and the Python model bls_onnx_warmup, which calls it through BLS and asserts
its outputs are GPU tensors, run by L0_backend_python's test_infer_shm_leak.py under
pytest): it needs a GPU and CUDA torch.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import qa_gen
import qa_tree

SUITE = "warmup"
SUITES = (SUITE,)
TEST_DIR = "L0_warmup"
EXPORT_PATHS = ("qa/L0_warmup",)
SERVER_ARGS = ("--log-verbose=1", "--exit-timeout-secs=120")
NO_WARMUP_ERROR = (("no warmup error", "failed to run warmup"),)
BACKEND = "onnx"
INPUT_PREFIX = IDENTITY_INPUT_PREFIX = SEQ_INPUT = "INPUT"   # (libtorch's are INPUT__...)
START, READY = "START", "READY"


def _input(key: str, data_type: str, dims: str, data: str) -> list[str]:
    return ["    inputs {", f'        key: "{key}"', "        value: {",
            f"            data_type: {data_type}", f"            dims: {dims}",
            f"            {data}", "        }", "    }"]


REGULAR = ["model_warmup [{", '    name : "regular sample"', "    batch_size: 1",
           *_input(f"{INPUT_PREFIX}0", "TYPE_FP32", "16", "zero_data: true"),
           *_input(f"{INPUT_PREFIX}1", "TYPE_FP32", "16", "random_data: true"), "}]"]
SEQUENCE = ["model_warmup [{", '    name : "sequence sample"', "    count : 2",
            "    batch_size: 8",
            *_input(SEQ_INPUT, "TYPE_INT32", "1", "zero_data: true"),
            *_input(START, "TYPE_INT32", "1", "zero_data: true"),
            *_input(READY, "TYPE_INT32", "1", "zero_data: true"), "}]"]
STRING_STATELESS = ["model_warmup [", "{", '    name : "zero string stateless"',
                    "    batch_size: 1",
                    *_input(f"{IDENTITY_INPUT_PREFIX}0", "TYPE_STRING", "16", "zero_data: true"),
                    "},", "{", '    name : "random string stateless"', "    batch_size: 1",
                    *_input(f"{IDENTITY_INPUT_PREFIX}0", "TYPE_STRING", "16",
                            "random_data: true"), "}", "]"]
STRING_STATEFUL = ["model_warmup [{", '    name : "string statefull"', "    batch_size: 8",
                   *_input(SEQ_INPUT, "TYPE_STRING", "1", 'input_data_file: "raw_string_data"'),
                   *_input(START, "TYPE_INT32", "1", "zero_data: true"),
                   *_input(READY, "TYPE_INT32", "1", "zero_data: true"), "}]"]


def has_gpu() -> bool:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def _echo(config: Path, lines: list[str]) -> None:
    qa_gen.append(config, "".join(line + "\n" for line in lines))


def _sequence_on_cpu(model: Path) -> None:
    qa_gen.sed(model / "config.pbtxt", r"kind: KIND_GPU", "kind: KIND_CPU")


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    if SUITE not in suites:
        return []
    log(f"warmup: exported {', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    test_dir = work / "qa" / TEST_DIR
    qa_model = qa_gen.datadir(work, "qa_model_repository", log)
    seq = qa_gen.datadir(work, "qa_sequence_model_repository", log)
    ident = qa_gen.datadir(work, "qa_identity_model_repository", log)
    gpu = has_gpu()
    kind_note = "" if gpu else " (sequence model KIND_GPU -> KIND_CPU: no GPU here)"
    if not gpu:
        log("warmup: no GPU visible: the generated sequence models' KIND_GPU groups become "
            "KIND_CPU")
    phase = qa_gen.make_phase(phase_cls, SUITE, TEST_DIR)
    out = []

    # ---- fixed-size data type (the addsub and sequence models)
    fixed = test_dir / "models_fixed"
    shutil.rmtree(fixed, ignore_errors=True)
    fixed.mkdir()
    addsub = qa_gen.copytree(qa_model / f"{BACKEND}_float32_float32_float32",
                             fixed / f"{BACKEND}_float32_float32_float32")
    seq_int = qa_gen.copytree(seq / f"{BACKEND}_sequence_int32", fixed / f"{BACKEND}_sequence_int32")
    _echo(addsub / "config.pbtxt", REGULAR)
    _echo(seq_int / "config.pbtxt", SEQUENCE)
    if not gpu:
        _sequence_on_cpu(seq_int)
    out.append(phase("fixed", f"fixed-size: {BACKEND} addsub + sequence{kind_note}", None,
                     repository=fixed, args=SERVER_ARGS, server_must_start=True,
                     log_checks=(
                         ("warmup for stateless model",
                          "is running warmup sample 'regular sample'"),
                         ("1st warmup iteration for stateful model",
                          "is running warmup sample 'sequence sample' for iteration 1"),
                         ("2nd warmup iteration for stateful model",
                          "is running warmup sample 'sequence sample' for iteration 2")),
                     log_absent=NO_WARMUP_ERROR))

    # ---- variable-size data type (string): SUPPORT_STRING for onnx
    strings = test_dir / "models_string"
    shutil.rmtree(strings, ignore_errors=True)
    strings.mkdir()
    seq_obj = qa_gen.copytree(seq / f"{BACKEND}_sequence_object",
                              strings / f"{BACKEND}_sequence_object")
    zero = qa_gen.copytree(ident / f"{BACKEND}_zero_1_object", strings / f"{BACKEND}_zero_1_object")
    _echo(zero / "config.pbtxt", STRING_STATELESS)
    _echo(seq_obj / "config.pbtxt", STRING_STATEFUL)
    (seq_obj / "warmup").mkdir()
    (seq_obj / "warmup" / "raw_string_data").write_bytes(b"\x03\x00\x00\x00\x32\x33\x33")
    if not gpu:
        _sequence_on_cpu(seq_obj)
    out.append(phase("string", f"string: {BACKEND} identity + sequence{kind_note}", None,
                     repository=strings, args=SERVER_ARGS, server_must_start=True,
                     log_checks=(
                         ("warmup for zero string stateless model",
                          "is running warmup sample 'zero string stateless'"),
                         ("warmup for random string stateless model",
                          "is running warmup sample 'random string stateless'"),
                         ("warmup for string stateful model",
                          "is running warmup sample 'string statefull'")),
                     log_absent=NO_WARMUP_ERROR))

    # ---- warmup sample failure
    failing = test_dir / "models_failing"
    shutil.rmtree(failing, ignore_errors=True)
    failing.mkdir()
    qa_gen.copytree(test_dir / "failing_infer", failing / "failing_infer")
    out.append(phase("failing_infer", "failing_infer (python)", None, repository=failing,
                     args=SERVER_ARGS, server_must_fail=True,
                     log_checks=(("warmup error",
                                  "failed to run warmup sample 'zero sample': An Error Occurred;"),
                                 )))

    # ---- decoupled model
    dec = test_dir / "models_decoupled"
    shutil.rmtree(dec, ignore_errors=True)
    dec.mkdir()
    qa_gen.copytree(test_dir / "decoupled", dec / "decoupled")
    out.append(phase("decoupled", "decoupled (python)", None, repository=dec, args=SERVER_ARGS,
                     server_must_start=True,
                     log_checks=(("warmup for decoupled model",
                                  "is running warmup sample 'decoupled sample'"),),
                     log_absent=NO_WARMUP_ERROR))

    # ---- onnx output memory type with warmup (GPU)
    out.append(phase("bls_onnx_warmup", "bls_onnx_warmup (KIND_GPU onnx)", "test_infer_shm_leak.py",
                     not_run=("needs a GPU: onnx_nobatch_float32_float32_float32 is KIND_GPU and "
                              "bls_onnx_warmup asserts its outputs are GPU tensors (CUDA torch)")))
    return out

