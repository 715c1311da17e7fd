"""Shared pieces of the suite modules qa_infer.py, qa_http_grpc.py, qa_small.py, qa_batcher.py
and qa_namespacing.py (triton_qa.py): export, the generated QA model repositories, the
test.sh steps several suites repeat.

Generated repositories are what qa/common/gen_qa_model_repository leaves in
/data/inferenceserver/<version>/, its ONNX and ensemble lines only (the TensorRT, PyTorch,
TensorFlow and OpenVINO generators need those frameworks or a GPU):

  qa_model_repository                         gen_qa_models.py --onnx
  qa_variable_model_repository                gen_qa_models.py --onnx --variable
  qa_identity_model_repository                gen_qa_identity_models.py --onnx
  qa_sequence_model_repository                gen_qa_sequence_models.py --onnx
  qa_ensemble_model_repository/qa_model_repository   gen_qa_models.py --ensemble

Each is generated once per run (under <work>/generated_qa/) and its ONNX files pinned to
the IR version and opset of the onnx release gen_qa_model_repository pins
(qa_tree.pin_onnx_versions).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import qa_tree

GENERATORS = {
    "qa_model_repository": ("gen_qa_models.py", "--onnx", "--onnx_opset=0"),
    "qa_variable_model_repository": ("gen_qa_models.py", "--onnx", "--onnx_opset=0",
                                     "--variable"),
    "qa_identity_model_repository": ("gen_qa_identity_models.py", "--onnx", "--onnx_opset=0"),
    "qa_sequence_model_repository": ("gen_qa_sequence_models.py", "--onnx", "--onnx_opset=0"),
    "qa_ensemble_model_repository/qa_model_repository": ("gen_qa_models.py", "--ensemble"),
}

# the libraries and tools some test.sh steps need that no suite here has: what stands in
SKIPPED_ARGS_NOTE = ("--backend-directory and --backend-config=python,... left out of "
                     "SERVER_ARGS (Triton install paths / python stub settings; trireme "
                     "serve has neither option)")


_COMPAT_SITE = '''"""What Triton's QA container has and this venv lacks (written by triton_qa.py).

Dockerfile.QA installs "numpy<2": NumPy 1's aliases that NumPy 2 removed are put back.
"""
try:
    import numpy as _np
    for _name, _value in (("NINF", -_np.inf), ("PINF", _np.inf), ("NAN", _np.nan),
                          ("NZERO", -0.0), ("PZERO", 0.0)):
        if not hasattr(_np, _name):
            setattr(_np, _name, _value)
except ImportError:
    pass
'''

_COMPAT_GRPC = '''"""Old Triton client module name, as the deprecated tritongrpcclient package had it:
tritonclient.grpc plus grpc_service_pb2 / grpc_service_pb2_grpc, today's service_pb2 /
service_pb2_grpc (written by triton_qa.py)."""
import importlib
import sys

_m = importlib.import_module("tritonclient.grpc")
_m.grpc_service_pb2 = importlib.import_module("tritonclient.grpc.service_pb2")
_m.grpc_service_pb2_grpc = importlib.import_module("tritonclient.grpc.service_pb2_grpc")
sys.modules["tritonclient.grpc.grpc_service_pb2"] = _m.grpc_service_pb2
sys.modules["tritonclient.grpc.grpc_service_pb2_grpc"] = _m.grpc_service_pb2_grpc
sys.modules[__name__] = _m
'''


def compat_pythonpath(work: Path) -> str:
    """A PYTHONPATH for the tests that need what Triton's QA container has beyond the
    shims: NumPy 1's NINF/PINF/... aliases (Dockerfile.QA: "numpy<2"; a sitecustomize.py)
    and tritongrpcclient.grpc_service_pb2(_grpc), the old client package's names for
    tritonclient.grpc.service_pb2(_grpc). The compat folder first, then the shims."""
    d = work / "shims_compat"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(_COMPAT_SITE)
    (d / "tritongrpcclient.py").write_text(_COMPAT_GRPC)
    return f"{d}:{work / 'shims'}"


def export(source: qa_tree.TritonSource, work: Path, paths: tuple[str, ...]) -> list[str]:
    """Export `paths` from Triton's repository (TritonSource.export exports
    qa_tree.EXPORT_PATHS: swapped for `paths` for the one call)."""
    saved = qa_tree.EXPORT_PATHS
    qa_tree.EXPORT_PATHS = paths
    try:
        return source.export(work)
    finally:
        qa_tree.EXPORT_PATHS = saved


def datadir(work: Path, name: str, log) -> Path:
    """The generated repository `name` (a key of GENERATORS), generated on first use."""
    dest = work / "generated_qa" / name
    if (dest / ".done").exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    script, *args = GENERATORS[name]
    qa_tree._run_generator(work / "qa" / "common", script, *args, f"--models_dir={dest}",
                           log=log)
    note = qa_tree.pin_onnx_versions(work, dest)
    if note:
        log(f"{name}: {note}")
    (dest / ".done").write_text("")
    return dest


def sed(path: Path, pattern: str, repl: str, count: int = 0, flags: int = 0) -> None:
    """sed -i 's/pattern/repl/g' (count=1: only the first match in the file)."""
    path.write_text(re.sub(pattern, repl, path.read_text(), count=count, flags=flags))


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def copytree(src: Path, dest: Path) -> Path:
    """cp -r src dest (dest is the new folder's path)."""
    shutil.copytree(src, dest, dirs_exist_ok=True)
    return dest


def python_from_onnx(onnx_model: Path, dest_root: Path, model_py: Path,
                     platform_to_backend: bool = False) -> Path:
    """The L0_infer / L0_batcher step that makes a python_* model out of an onnx_* one:
    the config with `platform:` removed (L0_infer: `sed 's/platform:.*//g' | sed
    's/version_policy.*/backend: "python"/g'`; L0_batcher, platform_to_backend:
    `sed 's/platform:.*/backend: "python"/g'`) and `s/onnx/python/g`, output0_labels.txt,
    and `model_py` as 1/model.py."""
    name = onnx_model.name.replace("onnx", "python")
    d = dest_root / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    cfg = (onnx_model / "config.pbtxt").read_text()
    if platform_to_backend:
        cfg = re.sub(r"platform:.*", 'backend: "python"', cfg)
    else:
        cfg = re.sub(r"platform:.*", "", cfg)
        cfg = re.sub(r"version_policy.*", 'backend: "python"', cfg)
    (d / "config.pbtxt").write_text(cfg.replace("onnx", "python"))
    if (onnx_model / "output0_labels.txt").exists():
        shutil.copy(onnx_model / "output0_labels.txt", d)
    shutil.copy(model_py, d / "1" / "model.py")
    return d


def make_phase(phase_cls, prefix: str, suite_dir: str):
    """A Phase factory for one suite: key `<prefix>.<key>`, suite folder `suite_dir`."""
    def phase(key: str, run: str, test_file: str | None, names: tuple[str, ...] = (),
              repository: Path = Path(), args: tuple[str, ...] = (), **kw):
        return phase_cls(key=f"{prefix}.{key}", suite=suite_dir, run=run, test_file=test_file,
                         names=names, repository=repository, server_args=args, **kw)
    return phase
