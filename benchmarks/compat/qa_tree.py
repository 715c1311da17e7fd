"""The Triton QA files on disk: export, import shims, and the model repositories.

Everything here writes under one work folder, never into the Trireme checkout:

  <work>/qa/common, qa/L0_simple_ensemble, qa/L0_infer_zero, qa/python_models/...
                        exported unmodified from Triton's server repository
  <work>/docs/examples/model_repository/simple
                        the 'simple' add/sub ONNX model (INT32) that Dockerfile.QA copies
                        into L0_simple_ensemble/models/simple/{1,2}
  <work>/shims          tritonhttpclient, tritongrpcclient, tritonclientutils and
                        tritonshmutils: the old module names the QA tests import, mapped to
                        tritonclient.http / .grpc / .utils as Triton's CI containers do
  <work>/generated      what qa/common/gen_qa_model_repository would leave in
                        /data/inferenceserver/<version>/ (only the ONNX and ensemble
                        generators: the TensorRT, TensorFlow, PyTorch and OpenVINO ones need
                        those frameworks or a GPU)

The model repositories of each test.sh are then built inside the exported test folders,
step by step as test.sh does them (comments name the test.sh lines they replicate).
"""
from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_MIRROR = Path("/work/.mirror/triton-inference-server+server/repo")

# What the runner needs from Triton's repository (paths that do not exist are left out:
# qa/clients, for one, is filled by Dockerfile.QA with client binaries, not kept in git).
EXPORT_PATHS = (
    "qa/common",
    "qa/clients",
    "qa/L0_simple_ensemble",
    "qa/L0_infer_zero",
    "qa/python_models/ground_truth",
    "qa/python_models/join_add_sub",
    "docs/examples/model_repository/simple",
)

SHIMS = {
    "tritonhttpclient": "tritonclient.http",
    "tritongrpcclient": "tritonclient.grpc",
    "tritonclientutils": "tritonclient.utils",
}
SHM_SHIMS = {
    "shared_memory": "tritonclient.utils.shared_memory",
    "cuda_shared_memory": "tritonclient.utils.cuda_shared_memory",
}
_ALIAS = '''"""Old Triton client module name: {old} is {new} (written by triton_qa.py)."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("{new}")
'''

# Stands in for Triton's identity backend (backend: "identity"), which the nop_* models of
# the ensemble generators use: every input INPUTn comes back as output OUTPUTn.
NOP_PYTHON_MODEL = '''"""Triton's identity backend as a Python model: OUTPUTn = INPUTn (triton_qa.py)."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = [pb_utils.Tensor("OUTPUT" + t.name()[len("INPUT"):], t.as_numpy())
                       for t in request.inputs()]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
'''


class SourceMissing(Exception):
    pass


class TritonSource:
    """Triton's server repository: a git directory (bare or not) or a plain checkout."""

    def __init__(self, path: Path):
        self.path = path
        self.is_git = False
        if not path.exists():
            raise SourceMissing(f"{path} does not exist")
        if (path / "qa" / "common" / "test_util.py").is_file():
            self.is_git = (path / ".git").exists()
            self.plain = not self.is_git
        else:
            self.plain = False
            self.is_git = self._git("rev-parse", "--git-dir", check=False).returncode == 0
            if not self.is_git:
                raise SourceMissing(f"{path} is neither a git repository nor a checkout "
                                    "of triton-inference-server/server")
            if self._git("cat-file", "-e", "HEAD:qa/common/test_util.py",
                         check=False).returncode != 0:
                raise SourceMissing(f"{path} has no qa/common/test_util.py at HEAD")

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(self.path), *args], capture_output=True,
                              check=check)

    def describe(self) -> str:
        if not self.is_git:
            return f"{self.path} (plain folder)"
        out = self._git("log", "-1", "--format=%H %cs %s", "HEAD", check=False)
        return out.stdout.decode().strip() or str(self.path)

    def _has(self, rel: str) -> bool:
        if self.plain:
            return (self.path / rel).exists()
        return self._git("cat-file", "-e", f"HEAD:{rel}", check=False).returncode == 0

    def export(self, dest: Path) -> list[str]:
        """Export EXPORT_PATHS under dest; the paths exported."""
        paths = [p for p in EXPORT_PATHS if self._has(p)]
        dest.mkdir(parents=True, exist_ok=True)
        if self.plain:
            for rel in paths:
                shutil.copytree(self.path / rel, dest / rel, dirs_exist_ok=True)
        else:
            tar = self._git("archive", "--format=tar", "HEAD", *paths).stdout
            with tarfile.open(fileobj=io.BytesIO(tar)) as t:
                t.extractall(dest, filter="data")
        return paths


def write_shims(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for old, new in SHIMS.items():
        (dest / f"{old}.py").write_text(_ALIAS.format(old=old, new=new))
    pkg = dest / "tritonshmutils"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text('"""Old Triton client package name for tritonclient.utils '
                                     'shared memory modules (written by triton_qa.py)."""\n')
    for old, new in SHM_SHIMS.items():
        (pkg / f"{old}.py").write_text(_ALIAS.format(old=f"tritonshmutils.{old}", new=new))
    return dest


def _run_generator(common: Path, *args: str, log) -> None:
    cmd = [sys.executable, *args]
    log(f"  {' '.join(args)}")
    out = subprocess.run(cmd, cwd=common, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")


# ------------------------------------------------------------------------- L0_simple_ensemble
def setup_simple_ensemble(work: Path) -> Path:
    """test.sh's setup plus Dockerfile.QA's 'simple' model versions; the models folder."""
    test_dir = work / "qa" / "L0_simple_ensemble"
    models = test_dir / "models"
    # test.sh: "ensure ensemble models have version sub-directory"
    (models / "ensemble_add_sub_int32_int32_int32" / "1").mkdir(parents=True, exist_ok=True)
    (models / "ensemble_partial_add_sub" / "1").mkdir(parents=True, exist_ok=True)
    # Dockerfile.QA: docs/examples/model_repository/simple/1/model.onnx -> simple/1 and simple/2
    onnx = work / "docs" / "examples" / "model_repository" / "simple" / "1" / "model.onnx"
    if not onnx.is_file():
        raise RuntimeError("docs/examples/model_repository/simple/1/model.onnx is missing from "
                           "Triton's repository (L0_simple_ensemble's 'simple' model)")
    for version in ("1", "2"):
        (models / "simple" / version).mkdir(parents=True, exist_ok=True)
        shutil.copy(onnx, models / "simple" / version / "model.onnx")
    return models


def _sed(path: Path, old: str, new: str) -> None:
    path.write_text(path.read_text().replace(old, new))


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


_QUEUE_LIMIT = """
dynamic_batching {{
  preferred_batch_size: [ 1 ]
  default_queue_policy {{
    max_queue_size: {n}
  }}
}}
"""


def setup_backpressure(work: Path) -> dict[str, Path]:
    """The four model repositories of test.sh's max_queue_size, parallel failed enqueue,
    max_inflight_requests and invalid max_inflight_requests sections."""
    test_dir = work / "qa" / "L0_simple_ensemble"
    bp = test_dir / "backpressure_test_models"
    gt = work / "qa" / "python_models" / "ground_truth"
    join = work / "qa" / "python_models" / "join_add_sub"
    producer = bp / "decoupled_producer"
    ens_cfg = bp / "ensemble_disabled_max_inflight_requests" / "config.pbtxt"

    def producer_files(dest: Path, new_name: str | None = None) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "1").mkdir(exist_ok=True)
        shutil.copy(producer / "1" / "model.py", dest / "1" / "model.py")
        shutil.copy(producer / "config.pbtxt", dest / "config.pbtxt")
        if new_name:
            _sed(dest / "config.pbtxt", 'name: "decoupled_producer"', f'name: "{new_name}"')
        return dest

    def ground_truth(dest: Path, new_name: str) -> Path:
        (dest / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(gt / "model.py", dest / "1" / "model.py")
        shutil.copy(gt / "config.pbtxt", dest / "config.pbtxt")
        _sed(dest / "config.pbtxt", 'name: "ground_truth"', f'name: "{new_name}"')
        _sed(dest / "config.pbtxt", "max_batch_size: 64", "max_batch_size: 1")
        return dest

    repos: dict[str, Path] = {}

    # ---- "Test max_queue_size dynamic batching parameter in ensemble steps"
    mq = test_dir / "max_queue_size_test_models"
    shutil.rmtree(mq, ignore_errors=True)
    (mq / "ensemble_step1_enabled_max_queue_size" / "1").mkdir(parents=True)
    shutil.copy(ens_cfg, mq / "ensemble_step1_enabled_max_queue_size")
    _sed(mq / "ensemble_step1_enabled_max_queue_size" / "config.pbtxt",
         '"decoupled_producer"', '"decoupled_producer_enabled_max_queue_size"')
    ground_truth(mq / "slow_consumer", "slow_consumer")
    p = producer_files(mq / "decoupled_producer_enabled_max_queue_size",
                       "decoupled_producer_enabled_max_queue_size")
    _append(p / "config.pbtxt", _QUEUE_LIMIT.format(n=4))
    (mq / "ensemble_step2_enabled_max_queue_size" / "1").mkdir(parents=True)
    shutil.copy(ens_cfg, mq / "ensemble_step2_enabled_max_queue_size")
    _sed(mq / "ensemble_step2_enabled_max_queue_size" / "config.pbtxt",
         '"slow_consumer"', '"slow_consumer_enabled_max_queue_size"')
    producer_files(mq / "decoupled_producer")
    c = ground_truth(mq / "slow_consumer_enabled_max_queue_size",
                     "slow_consumer_enabled_max_queue_size")
    _append(c / "config.pbtxt", _QUEUE_LIMIT.format(n=4))
    repos["max_queue_size"] = mq

    # ---- "Test parallel-step failed enqueue path in ensemble scheduler"
    pf = test_dir / "parallel_failed_enqueue_test_models"
    shutil.rmtree(pf, ignore_errors=True)
    (pf / "ensemble_parallel_step_failed_enqueue" / "1").mkdir(parents=True)
    p = producer_files(pf / "decoupled_producer_parallel_queue", "decoupled_producer_parallel_queue")
    _sed(p / "1" / "model.py", "0.5", "2.0")
    c = ground_truth(pf / "slow_consumer_queue_limited", "slow_consumer_queue_limited")
    _append(c / "config.pbtxt", _QUEUE_LIMIT.format(n=1))
    f = ground_truth(pf / "fast_consumer", "fast_consumer")
    _sed(f / "1" / "model.py", "time.sleep(delay)", "time.sleep(0)")
    (pf / "join_add_sub" / "1").mkdir(parents=True)
    shutil.copy(join / "model.py", pf / "join_add_sub" / "1" / "model.py")
    shutil.copy(join / "config.pbtxt", pf / "join_add_sub" / "config.pbtxt")
    (pf / "ensemble_parallel_step_failed_enqueue" / "config.pbtxt").write_text(
        _PARALLEL_ENSEMBLE)
    repos["parallel_failed_enqueue"] = pf

    # ---- "Test backpressure feature - 'max_inflight_requests' config option"
    eb = test_dir / "ensemble_backpressure_test_models"
    shutil.rmtree(eb, ignore_errors=True)
    p = producer_files(eb / "decoupled_producer")
    _sed(p / "config.pbtxt", "max_batch_size: 1", "max_batch_size: 2")
    for name, delay in (("consumer_high_delay", "0.5"), ("consumer_low_delay", "0.1")):
        (eb / name / "1").mkdir(parents=True)
        (eb / name / "1" / "model.py").write_text(_CONSUMER_PY.format(delay=delay))
        (eb / name / "config.pbtxt").write_text(_CONSUMER_CFG.format(name=name))
    for name, limit in (("ensemble_disabled", ""), ("ensemble_limit_1", "1"),
                        ("ensemble_limit_4", "4")):
        (eb / name / "1").mkdir(parents=True)
        limit_str = f"max_inflight_requests: {limit}" if limit else ""
        (eb / name / "config.pbtxt").write_text(
            _BACKPRESSURE_ENSEMBLE.format(name=name, limit_str=limit_str))
    repos["max_inflight_requests"] = eb

    # ---- "Test invalid values for 'max_inflight_requests' config option"
    inv = test_dir / "invalid_param_test_models"
    shutil.rmtree(inv, ignore_errors=True)
    inv.mkdir()
    for model in ("decoupled_producer", "slow_consumer"):
        shutil.copytree(mq / model, inv / model)
    for name, value in (("ensemble_invalid_negative_limit", "-5"),
                        ("ensemble_invalid_string_limit", '"invalid_value"'),
                        ("ensemble_invalid_large_value_limit", "12345678901")):
        (inv / name / "1").mkdir(parents=True)
        shutil.copy(ens_cfg, inv / name)
        _sed(inv / name / "config.pbtxt", "ensemble_scheduling {",
             f"ensemble_scheduling {{\n  max_inflight_requests: {value}")
    repos["invalid_max_inflight_requests"] = inv
    return repos


_PARALLEL_ENSEMBLE = """name: "ensemble_parallel_step_failed_enqueue"
platform: "ensemble"
max_batch_size: 0

input [
  {
    name: "IN"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }
]

output [
  {
    name: "OUT"
    data_type: TYPE_FP32
    dims: [ 1 ]
  }
]

ensemble_scheduling {
  step [
    {
      model_name: "decoupled_producer_parallel_queue"
      model_version: -1
      input_map {
        key: "IN"
        value: "IN"
      }
      output_map {
        key: "OUT"
        value: "intermediate"
      }
    },
    {
      model_name: "slow_consumer_queue_limited"
      model_version: -1
      input_map {
        key: "INPUT0"
        value: "intermediate"
      }
      output_map {
        key: "OUTPUT0"
        value: "slow_out"
      }
    },
    {
      model_name: "fast_consumer"
      model_version: -1
      input_map {
        key: "INPUT0"
        value: "intermediate"
      }
      output_map {
        key: "OUTPUT0"
        value: "fast_out"
      }
    },
    {
      model_name: "join_add_sub"
      model_version: -1
      input_map {
        key: "INPUT0"
        value: "slow_out"
      }
      input_map {
        key: "INPUT1"
        value: "fast_out"
      }
      output_map {
        key: "OUTPUT0"
        value: "OUT"
      }
    }
  ]
}
"""

_CONSUMER_PY = """import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            out_tensor = pb_utils.Tensor("OUTPUT0", in_tensor.as_numpy())
            responses.append(pb_utils.InferenceResponse([out_tensor]))
            time.sleep({delay})
        return responses
"""

_CONSUMER_CFG = """name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
dynamic_batching {{ preferred_batch_size: [ 2 ] }}
"""

_BACKPRESSURE_ENSEMBLE = """name: "{name}"
platform: "ensemble"
max_batch_size: 2
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] }} ]
ensemble_scheduling {{
  {limit_str}
  step [
    {{
      model_name: "decoupled_producer"
      model_version: -1
      input_map {{ key: "IN", value: "IN" }}
      output_map {{ key: "OUT", value: "intermediate_1" }}
    }},
    {{
      model_name: "consumer_high_delay"
      model_version: -1
      input_map {{ key: "INPUT0", value: "intermediate_1" }}
      output_map {{ key: "OUTPUT0", value: "intermediate_2" }}
    }},
    {{
      model_name: "consumer_low_delay"
      model_version: -1
      input_map {{ key: "INPUT0", value: "intermediate_2" }}
      output_map {{ key: "OUTPUT0", value: "OUT" }}
    }}
  ]
}}
"""


# ------------------------------------------------------------------------------ L0_infer_zero
def generate_identity_repositories(work: Path, log) -> Path:
    """gen_qa_model_repository's ONNX-script lines for the two repositories L0_infer_zero
    copies: gen_qa_identity_models.py --onnx (qa_identity_model_repository) and --ensemble
    (qa_ensemble_model_repository/qa_identity_model_repository). The generated root."""
    common = work / "qa" / "common"
    gen = work / "generated"
    if gen.exists():
        shutil.rmtree(gen)
    _run_generator(common, "gen_qa_identity_models.py", "--onnx", "--onnx_opset=0",
                   f"--models_dir={gen / 'qa_identity_model_repository'}", log=log)
    _run_generator(common, "gen_qa_identity_models.py", "--ensemble",
                   f"--models_dir={gen / 'qa_ensemble_model_repository' / 'qa_identity_model_repository'}",
                   log=log)
    return gen


def pin_onnx_versions(work: Path, gen: Path) -> str:
    """Give every generated model.onnx the IR version and default-domain opset that the
    onnx release gen_qa_model_repository pins (ONNX_VERSION=...) writes, where the installed
    onnx wrote newer ones: Triton generates its QA models with that release, and a newer
    onnx's IR version can be beyond what the installed onnxruntime loads (onnx 1.23 writes
    IR 14; onnxruntime 1.23 reads up to 13). The graphs are unchanged. A note of what was
    done ('' when nothing)."""
    import re

    import onnx
    from onnx import helper

    script = (work / "qa" / "common" / "gen_qa_model_repository").read_text()
    m = re.search(r"^ONNX_VERSION=([0-9.]+)", script, re.M)
    pinned = m.group(1) if m else "1.20.1"
    row = next((r for r in helper.VERSION_TABLE if r[0] == pinned), None)
    if row is None:
        return f"onnx {pinned} (pinned by gen_qa_model_repository) unknown to onnx {onnx.__version__}"
    ir, opset = row[1], row[2]
    changed: dict[str, int] = {}
    for path in sorted(gen.rglob("*.onnx")):
        model = onnx.load(str(path))
        edits = []
        if model.ir_version > ir:
            edits.append(f"IR {model.ir_version}->{ir}")
            model.ir_version = ir
        for op in model.opset_import:
            if op.domain in ("", "ai.onnx") and op.version > opset:
                edits.append(f"opset {op.version}->{opset}")
                op.version = opset
        if edits:
            onnx.save(model, str(path))
            key = ", ".join(edits)
            changed[key] = changed.get(key, 0) + 1
    if not changed:
        return ""
    what = "; ".join(f"{n} files {k}" for k, n in changed.items())
    return (f"ONNX models written by onnx {onnx.__version__} set to the IR version and opset of "
            f"onnx {pinned}, the release gen_qa_model_repository pins ({what})")


def setup_infer_zero(work: Path, gen: Path) -> Path:
    """test.sh's models folder (the repositories copied together, plan_compatible* removed,
    create_nop_version_dir)."""
    models = work / "qa" / "L0_infer_zero" / "models"
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir()
    for src in (gen / "qa_identity_model_repository",
                gen / "qa_ensemble_model_repository" / "qa_identity_model_repository"):
        for d in sorted(src.iterdir()):
            shutil.copytree(d, models / d.name, dirs_exist_ok=True)
    for d in models.glob("plan_compatible*"):
        shutil.rmtree(d)
    for d in models.iterdir():   # util.sh create_nop_version_dir: `ls | grep "nop_"`
        if "nop_" in d.name:
            (d / "1").mkdir(exist_ok=True)
    return models


def nop_on_python(models: Path, dest: Path) -> tuple[Path, list[str]]:
    """A copy of `models` whose nop_* models (backend "identity") run NOP_PYTHON_MODEL on
    the Python backend instead; the copy and the names of the models changed."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(models, dest)
    changed = []
    for d in sorted(dest.iterdir()):
        cfg = d / "config.pbtxt"
        if cfg.is_file() and 'backend: "identity"' in cfg.read_text():
            _sed(cfg, 'backend: "identity"', 'backend: "python"')
            (d / "1").mkdir(exist_ok=True)
            (d / "1" / "model.py").write_text(NOP_PYTHON_MODEL)
            changed.append(d.name)
    return dest, changed
