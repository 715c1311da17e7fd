"""L0_model_namespacing against Trireme (triton_qa.py --only model_namespacing).

Replays qa/L0_model_namespacing/test.sh: for each of test_duplication,
test_dynamic_resolution, test_ensemble_duplication, test_no_duplication (version folders
`1` made in every model, as test.sh does), ModelNamespacePoll.<test> with
`--model-namespacing=true --model-repository=<copy>/addsub_repo
--model-repository=<copy>/subadd_repo --model-control-mode=POLL --repository-poll-secs=2`,
then ModelNamespaceExplicit.<test> with `--model-control-mode=EXPLICIT`, a fresh copy of
the test folder each time (test.sh's test_dir; here test_dir_<mode>_<test>, as every
repository is built before the first server starts). The test gets TRITON_QA_ROOT_DIR,
TRITON_QA_PYTHON_MODEL_DIR, NAMESPACE_TESTING_DIRCTORY and PYTHONDONTWRITEBYTECODE=1; the
server the two test.sh exports before run_server (the models import their code from
TRITON_QA_PYTHON_MODEL_DIR; no __pycache__ may change a polled model folder).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import qa_gen
import qa_tree

SUITE = "model_namespacing"
SUITES = (SUITE,)
TEST_DIR = "L0_model_namespacing"
EXPORT_PATHS = ("qa/L0_model_namespacing",)
TEST_LIST = ("test_duplication", "test_dynamic_resolution", "test_ensemble_duplication",
             "test_no_duplication")
MODES = (("ModelNamespacePoll", ("--model-control-mode=POLL", "--repository-poll-secs=2")),
         ("ModelNamespaceExplicit", ("--model-control-mode=EXPLICIT",)))


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    if SUITE not in suites:
        return []
    log(f"model_namespacing: exported {', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    qa = work / "qa"
    test_dir = qa / TEST_DIR
    for name in TEST_LIST:
        for model_dir in (test_dir / name).glob("*/*"):
            (model_dir / "1").mkdir(exist_ok=True)
    phase = qa_gen.make_phase(phase_cls, "model_namespacing", TEST_DIR)
    out = []
    exported = {"TRITON_QA_PYTHON_MODEL_DIR": str(test_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    for suite, mode_args in MODES:
        for name in TEST_LIST:
            td = test_dir / f"test_dir_{suite}_{name}"
            shutil.rmtree(td, ignore_errors=True)
            shutil.copytree(test_dir / name, td)
            out.append(phase(
                f"{suite}.{name}", suite.replace("ModelNamespace", "").lower(), "test.py",
                (f"{suite}.{name}",), td / "addsub_repo",
                ("--model-namespacing=true", f"--model-repository={td / 'subadd_repo'}",
                 *mode_args),
                expected=1,
                env={"TRITON_QA_ROOT_DIR": str(qa), "NAMESPACE_TESTING_DIRCTORY": str(td),
                     **exported},
                server_env=exported))
    return out
