"""L0_shared_memory: Triton's system shared-memory QA test against Trireme (triton_qa.py).

    python benchmarks/compat/triton_qa.py --only shared_memory [--markdown] [--json OUT]

Replays qa/L0_shared_memory/test.sh: every `python3 shared_memory_test.py <Class.case>`
line gets a fresh `trireme serve` (triton_qa.run_phase) with test.sh's SERVER_ARGS
(`--log-verbose 1`, and `--allow-client-shm=true` where test.sh's SERVER_ARGS_EXTRA has it)
and CLIENT_TYPE=http, then grpc, as test.sh loops over them:

  1. SharedMemoryTest.test_client_shm_disabled_by_default, without --allow-client-shm
     (registering must be refused, the status query answered)
  2. 17 SharedMemoryTest cases with --allow-client-shm=true, repository `models`: the
     'simple' model of Triton's docs/examples (INT32 add/sub, ONNX), as Dockerfile.QA
     copies it into qa/L0_shared_memory/models
  3. three TestSharedMemoryUnregister cases (`<case>_http` / `<case>_grpc`), repository
     `python_models`: 'simple' is qa/python_models/execute_delayed_model (add/sub after a
     15 s sleep), as test.sh copies it: regions unregistered while a request uses them
  4. SharedMemoryTest.test_large_shm_register_offset: test.sh empties `models` and puts
     `<backend>_int32_int32_int32` add/sub models there for each of BACKENDS. Here, the
     backends whose models can be made and run on this machine (large_offset_backends()):
     python (qa/python_models/add_sub with test.sh's sed and max_batch_size line), onnx
     and, where PyTorch is installed, libtorch (gen_qa_models.py --onnx --libtorch, the
     qa_model_repository line of gen_qa_model_repository, only version 1 copied, as test.sh
     does). The test gets BACKENDS naming them (test.sh does not export its own default, so
     in Triton's CI the test asks for all five backends). Left out: plan (TensorRT, a GPU)
     and openvino (gen_qa_models.py imports `openvino.runtime`, which OpenVINO 2026 no
     longer has). That repository is `models_large_offset`, not `models`: every repository
     is built before any phase runs.
  5. Not in test.sh: the same test over `models_large_offset_all_versions`, which holds
     every version gen_qa_models.py writes (onnx and libtorch: 1, 2 and 3; python: 1), run
     once with no BACKENDS (the test's own five) and once per backend. Versions 2 and 3 are
     written with swap=True (OUTPUT0 = INPUT0 - INPUT1, OUTPUT1 = INPUT0 + INPUT1), the
     config's version_policy is `all`, and a request without a version is served by the
     latest, 3, as Triton does (Triton 2.51 asked the same way writes the same bytes:
     docs/compat.md). The test expects OUTPUT0 = INPUT0 + INPUT1, so its onnx and libtorch
     runs fail on Triton too: those rows are `xfail` when the failure is the test's
     "Model output does not match expected output", and `fail` otherwise, a pass included
     (that would mean a version other than the latest answered).

test.sh's check_test_results (one result per command) is the `expected` count of each
phase; steps 4 and 5 have none in test.sh.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import qa_tree

SUITE = "shared_memory"
SUITES = (SUITE,)
TEST_DIR = "L0_shared_memory"
TEST_FILE = "shared_memory_test.py"
ALLOW = ("--allow-client-shm=true",)
VERBOSE = ("--log-verbose", "1")
CLIENT_TYPES = ("http", "grpc")
# step 5: the check the test makes, and why it fails on the swapped latest version
SWAPPED_LATEST = ("Model output does not match expected output",
                  "the latest version (3), which serves a request without a version, is "
                  "written with swap=True by gen_qa_models.py: OUTPUT0 = INPUT0 - INPUT1; "
                  "Triton answers the same bytes")

EXPORT_PATHS = (
    "qa/L0_shared_memory",
    "qa/python_models/add_sub",
    "qa/python_models/execute_delayed_model",
    "docs/examples/model_repository/simple",
)

# test.sh's second loop, in its order
ALLOWED_CASES = (
    "test_invalid_create_shm",
    "test_valid_create_set_register",
    "test_unregister_before_register",
    "test_unregister_after_register",
    "test_reregister_after_register",
    "test_unregister_after_inference",
    "test_register_after_inference",
    "test_too_big_shm",
    "test_mixed_raw_shm",
    "test_unregisterall",
    "test_infer_offset_out_of_bound",
    "test_infer_byte_size_out_of_bound",
    "test_infer_integer_overflow",
    "test_register_out_of_bound",
    "test_register_reserved_names",
    "test_register_invalid_shm_key",
    "test_python_client_leak",
)
UNREGISTER_CASES = (
    "test_unregister_shm_during_inference_single_req",
    "test_unregister_shm_during_inference_multiple_req",
    "test_unregister_shm_after_inference",
)


def export(source: qa_tree.TritonSource, work: Path) -> list[str]:
    """Export this suite's paths from Triton's repository (TritonSource.export exports
    qa_tree.EXPORT_PATHS: they are swapped for ours for the one call)."""
    saved = qa_tree.EXPORT_PATHS
    qa_tree.EXPORT_PATHS = EXPORT_PATHS
    try:
        return source.export(work)
    finally:
        qa_tree.EXPORT_PATHS = saved


def _copy_simple(work: Path, models: Path) -> None:
    """Dockerfile.QA: cp -r docs/examples/model_repository/simple qa/L0_shared_memory/models/."""
    src = work / "docs" / "examples" / "model_repository" / "simple"
    if not (src / "1" / "model.onnx").is_file():
        raise RuntimeError("docs/examples/model_repository/simple/1/model.onnx is missing from "
                           "Triton's repository (L0_shared_memory's 'simple' model)")
    shutil.copytree(src, models / "simple", dirs_exist_ok=True)


def large_offset_backends() -> tuple[str, ...]:
    """The `<backend>_int32_int32_int32` models step 4 can make and run here."""
    torch = importlib.util.find_spec("torch") is not None
    return ("python", "onnx", *(("libtorch",) if torch else ()))


def _large_offset_models(work: Path, test_dir: Path, log) -> tuple[Path, Path, str]:
    """test.sh's "Test large system shared memory offset" repository for
    large_offset_backends() (version 1 of each, as test.sh copies), the same models with
    every version the generator writes, and a note on the ONNX pinning ('' when none)."""
    backends = large_offset_backends()
    models = test_dir / "models_large_offset"
    every = test_dir / "models_large_offset_all_versions"
    for d in (models, every):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    gen = work / "generated_shm" / "qa_model_repository"
    shutil.rmtree(gen, ignore_errors=True)
    flags = [f"--{b}" for b in backends if b != "python"]
    qa_tree._run_generator(work / "qa" / "common", "gen_qa_models.py", *flags,
                           "--onnx_opset=0", f"--models_dir={gen}", log=log)
    pinned = qa_tree.pin_onnx_versions(work, gen)
    for backend in backends:
        model = f"{backend}_int32_int32_int32"
        d = models / model
        if backend == "python":
            # mkdir -p; cp ../python_models/add_sub/{model.py,config.pbtxt};
            # sed -i 's/TYPE_FP32/TYPE_INT32/g'; echo "max_batch_size: 8" >> config.pbtxt
            (d / "1").mkdir(parents=True)
            py = work / "qa" / "python_models" / "add_sub"
            shutil.copy(py / "model.py", d / "1" / "model.py")
            cfg = (py / "config.pbtxt").read_text().replace("TYPE_FP32", "TYPE_INT32")
            (d / "config.pbtxt").write_text(cfg + "max_batch_size: 8\n")
            shutil.copytree(d, every / model)
        else:
            # cp -r $DATADIR/qa_model_repository/${model}/1, config.pbtxt, output0_labels.txt
            src = gen / model
            d.mkdir()
            shutil.copytree(src / "1", d / "1")
            shutil.copy(src / "config.pbtxt", d / "config.pbtxt")
            shutil.copy(src / "output0_labels.txt", d / "output0_labels.txt")
            shutil.copytree(src, every / model)   # step 5: every version
    return models, every, pinned


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    """The phases of L0_shared_memory/test.sh (none unless SUITE is among `suites`).
    phase_cls is triton_qa.Phase (passed in: triton_qa imports this module)."""
    if SUITE not in suites:
        return []
    log(f"shared_memory: exported {', '.join(export(source, work))}")
    test_dir = work / "qa" / TEST_DIR
    if not (test_dir / TEST_FILE).is_file():
        raise RuntimeError(f"qa/{TEST_DIR}/{TEST_FILE} is missing from Triton's repository")
    models = test_dir / "models"
    _copy_simple(work, models)
    # mkdir -p python_models/simple/1/; cp ../python_models/execute_delayed_model/{model.py,
    # config.pbtxt} (its config already says name: "simple")
    delayed = test_dir / "python_models" / "simple"
    (delayed / "1").mkdir(parents=True, exist_ok=True)
    src = work / "qa" / "python_models" / "execute_delayed_model"
    shutil.copy(src / "model.py", delayed / "1" / "model.py")
    shutil.copy(src / "config.pbtxt", delayed / "config.pbtxt")
    large, every, pinned = _large_offset_models(work, test_dir, log)
    if pinned:
        log(f"shared_memory: {pinned}")

    def phase(key: str, run: str, name: str, repository: Path, args: tuple[str, ...],
              client: str, expected: int | None = 1, env: dict | None = None,
              expected_failure: tuple[str, str] | None = None):
        return phase_cls(key=f"shared_memory.{key}.{client}", suite=TEST_DIR,
                         run=f"{run}, CLIENT_TYPE={client}", test_file=TEST_FILE, names=(name,),
                         repository=repository, server_args=(*VERBOSE, *args),
                         env={"CLIENT_TYPE": client, **(env or {})}, expected=expected,
                         expected_failure=expected_failure)

    out = []
    for client in CLIENT_TYPES:
        out.append(phase("disabled", "no --allow-client-shm",
                         "SharedMemoryTest.test_client_shm_disabled_by_default", models, (),
                         client))
    for case in ALLOWED_CASES:
        for client in CLIENT_TYPES:
            out.append(phase(case, "--allow-client-shm=true", f"SharedMemoryTest.{case}",
                             models, ALLOW, client))
    for case in UNREGISTER_CASES:
        for client in CLIENT_TYPES:
            out.append(phase(case, "python_models (15 s model)",
                             f"TestSharedMemoryUnregister.{case}_{client}",
                             test_dir / "python_models", ALLOW, client))
    backends = " ".join(large_offset_backends())
    case = "SharedMemoryTest.test_large_shm_register_offset"
    for client in CLIENT_TYPES:
        out.append(phase("large_offset", f"large offset, BACKENDS={backends}", case, large,
                         ALLOW, client, expected=None, env={"BACKENDS": backends}))
    # step 5: every version; no BACKENDS (the test stops at its first failing backend),
    # then each backend alone
    for backend in (None, *large_offset_backends()):
        swapped = backend != "python"   # python_int32_int32_int32 has version 1 only
        for client in CLIENT_TYPES:
            out.append(phase(
                f"large_offset_all_versions.{backend or 'unset'}",
                f"large offset, every version, BACKENDS={backend or '(unset)'}", case, every,
                ALLOW, client, expected=None, env={"BACKENDS": backend},
                expected_failure=SWAPPED_LATEST if swapped else None))
    return out
