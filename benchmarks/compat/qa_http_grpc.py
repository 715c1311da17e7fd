"""L0_http and L0_grpc: the Python test files of their test.sh against Trireme
(triton_qa.py --only http,grpc).

Repositories as Dockerfile.QA and test.sh make them: `models` holds docs/examples'
simple, simple_dyna_sequence, simple_identity, simple_sequence, simple_string (and, L0_grpc,
simple_int8), densenet_onnx without its model.onnx (downloaded by fetch_models.sh, not in
git) and simple_string_dyna_sequence without the C++ dyna_sequence backend test.sh puts in
it: both fail to load, as they would in Triton without those files, and are in the
repository index the aio tests count. generate_endpoint_test.py gets sseclient-py
(test.sh pip-installs it) from <work>/pydeps when the venv lacks it.

L0_http, in test.sh's order (each a fresh server):
  - HTTPClientPluginTest / HTTPClientPluginAsyncTest (http_client_plugin_test.py) on the
    first server (`models`, --allow-client-shm=true)
  - python_http_aio_test.py (`models`, --allow-client-shm=true)
  - http_test.py (python_unit_test_models: onnx_zero_1_float32/_object/_float16,
    onnx_zero_3_float32, onnx_zero_1_object_1_element, onnx_zero_1_float32_queue,
    simple_identity, simple_identity_int64; --model-control-mode=explicit --load-model=*),
    17 tests
  - generate_endpoint_test.py (../python_models/generate_models, --log-verbose=1), 18 tests
  - --http-restricted-api: the two argument errors the server must refuse to start with,
    then http_restricted_api_test.py RestrictedAPITest
  - http_input_size_limit_test.py: the default-limit cases, the --http-max-input-size=2**27
    cases, and the 0 / -1024 limits the server must refuse. test.sh runs each case as its
    own `python` command against one server; here the cases of one server run in one
    command
  - http_request_many_chunks.py (`models`, explicit, --load-model=simple, SERVER_PID set)
Not run: the SDK example clients and image_client (densenet), the C++ cc_client_test, the
curl checks, http_basic_auth_test.py (needs nginx).

L0_grpc:
  - python_unit_test.py GrpcTest (grpc_test_models: simple, ../python_models/string_identity
    with dims [ -1 ])
  - grpc_client_plugin_test.py (client_plugin_models, --grpc-header-forward-pattern=.*
    --http-header-forward-pattern=.*)
  - python_grpc_aio_test.py (`models`, --allow-client-shm=true)
  - --grpc-restricted-protocol: the two argument errors, then python_unit_test.py
    RestrictedProtocolTest
Not run: the SDK example clients, the C++ clients, grpc-health-probe (a Go tool),
grpc_basic_auth_test.py (nginx).
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import qa_gen
import qa_tree

SUITES = ("http", "grpc")
EXAMPLES = "docs/examples/model_repository"
EXPORT_PATHS = ("qa/L0_http", "qa/L0_grpc", "qa/python_models/generate_models",
                "qa/python_models/string_identity", EXAMPLES)
HTTP_MODELS = ("simple", "simple_dyna_sequence", "simple_identity", "simple_sequence",
               "simple_string")
GRPC_MODELS = (*HTTP_MODELS, "simple_int8")
SIZE_DEFAULT = ("test_default_limit_raw_binary", "test_default_limit_json",
                "test_large_string_in_json", "test_default_limit_compressed",
                "test_json_dtype_size_expansion_exceeds_limit_error",
                "test_no_leak_on_invalid_inference_header_length")
SIZE_INCREASED = ("test_large_input_raw_binary", "test_large_input_json",
                  "test_large_input_compressed")
SHM = ("--allow-client-shm=true",)


def _examples(work: Path, dest: Path, names: tuple[str, ...], full: bool = False) -> Path:
    """Dockerfile.QA's copies of docs/examples models; full: also densenet_onnx (config and
    labels: its model.onnx comes from fetch_models.sh, not git) and test.sh's
    simple_string_dyna_sequence (its seds; the C++ libtriton_dyna_sequence.so it copies in
    is not there), so the repository index has the entries the tests count."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for n in names:
        qa_gen.copytree(work / EXAMPLES / n, dest / n)
    if full:
        qa_gen.copytree(work / EXAMPLES / "densenet_onnx", dest / "densenet_onnx")
        d = dest / "simple_string_dyna_sequence"
        (d / "1").mkdir(parents=True)
        cfg = (dest / "simple_dyna_sequence" / "config.pbtxt").read_text()
        cfg = cfg.replace("simple_dyna_sequence", "simple_string_dyna_sequence")
        cfg = re.sub(r"(?m)^platform: .*", 'backend: "dyna_sequence"', cfg)
        cfg = re.sub(r"(CONTROL_SEQUENCE_CORRID[^\n]*\n[^\n]*?)data_type:.*",
                     r"\1data_type: TYPE_STRING", cfg)
        (d / "config.pbtxt").write_text(cfg)
    return dest


def pydeps(work: Path, log, *packages: str) -> str:
    """test.sh's `pip install sseclient-py psutil`, into <work>/pydeps (not the venv) for
    the modules the venv lacks; that folder, for the test's PYTHONPATH."""
    d = work / "pydeps"
    missing = [p for p, mod in packages if importlib.util.find_spec(mod) is None]
    if missing:
        log(f"pip install --target {d} {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(d),
                        *missing], check=False)
    return str(d)


def _http(work: Path, phase_cls, log) -> list:
    test_dir = work / "qa" / "L0_http"
    models = _examples(work, test_dir / "models", HTTP_MODELS, full=True)
    ident = qa_gen.datadir(work, "qa_identity_model_repository", log)
    # python_unit_test_models
    unit = test_dir / "python_unit_test_models"
    shutil.rmtree(unit, ignore_errors=True)
    unit.mkdir()
    for n in ("onnx_zero_1_float32", "onnx_zero_1_object", "onnx_zero_1_float16",
              "onnx_zero_3_float32"):
        qa_gen.copytree(ident / n, unit / n)
    e = qa_gen.copytree(unit / "onnx_zero_1_object", unit / "onnx_zero_1_object_1_element")
    qa_gen.sed(e / "config.pbtxt", "onnx_zero_1_object", "onnx_zero_1_object_1_element")
    qa_gen.sed(e / "config.pbtxt", "-1", "1", count=1)          # sed "0,/-1/{s/-1/1/}"
    q = qa_gen.copytree(unit / "onnx_zero_1_float32", unit / "onnx_zero_1_float32_queue")
    qa_gen.sed(q / "config.pbtxt", "onnx_zero_1_float32", "onnx_zero_1_float32_queue")
    qa_gen.append(q / "config.pbtxt", "dynamic_batching { \n"
                  "    max_queue_delay_microseconds: 1000000\n"
                  "    preferred_batch_size: [ 8 ]\n"
                  "    default_queue_policy {\n"
                  "        max_queue_size: 1\n"
                  "    }\n"
                  "}\n")
    qa_gen.copytree(models / "simple_identity", unit / "simple_identity")
    i64 = qa_gen.copytree(models / "simple_identity", unit / "simple_identity_int64")
    qa_gen.sed(i64 / "config.pbtxt", "TYPE_STRING", "TYPE_INT64")
    qa_gen.sed(i64 / "config.pbtxt", "simple_identity", "simple_identity_int64")
    # http_input_size_limit_test_models
    size = test_dir / "http_input_size_limit_test_models"
    shutil.rmtree(size, ignore_errors=True)
    size.mkdir()
    qa_gen.copytree(ident / "onnx_zero_1_float32", size / "onnx_zero_1_float32")
    qa_gen.copytree(models / "simple_identity", size / "simple_identity")
    generate = work / "qa" / "python_models" / "generate_models"

    phase = qa_gen.make_phase(phase_cls, "http", "L0_http")
    size_test = "http_input_size_limit_test.py"
    must = "Error: --http-max-input-size must be greater than 0."
    return [
        phase("client_plugin", "models, --allow-client-shm=true", "http_client_plugin_test.py",
              repository=models, args=SHM),
        phase("aio", "models, --allow-client-shm=true", "python_http_aio_test.py",
              repository=models, args=SHM),
        phase("http_test", "python_unit_test_models, explicit, --load-model=*", "http_test.py",
              repository=unit, args=("--model-control-mode=explicit", "--load-model=*"),
              expected=17),
        phase("generate", "generate_models, --log-verbose=1", "generate_endpoint_test.py",
              repository=generate, args=("--log-verbose=1",), expected=18,
              env={"PYTHONPATH": pydeps(work, log, ("sseclient-py", "sseclient"),
                                        ("psutil", "psutil")) + f":{work / 'shims'}"}),
        phase("restricted_dup", "--http-restricted-api health in two groups", None,
              repository=models, server_must_fail=True,
              args=("--http-restricted-api=model-repository,health:k1=v1",
                    "--http-restricted-api=metadata,health:k2=v2"),
              log_checks=(("the duplicate is refused",
                           "api 'health' can not be specified in multiple config groups"),)),
        phase("restricted_unknown", "--http-restricted-api model-reposit", None,
              repository=models, server_must_fail=True,
              args=("--http-restricted-api=model-reposit,health:k1=v1",
                    "--http-restricted-api=metadata,health:k2=v2"),
              log_checks=(("the unknown api is refused",
                           "unknown restricted api 'model-reposit'"),)),
        phase("restricted", "--http-restricted-api admin/infer keys",
              "http_restricted_api_test.py", ("RestrictedAPITest",), models,
              ("--http-restricted-api=model-repository:admin-key=admin-value",
               "--http-restricted-api=inference,metadata:infer-key=infer-value")),
        phase("size_default", "input size, default limit", size_test,
              tuple(f"InferSizeLimitTest.{c}" for c in SIZE_DEFAULT), size,
              env={"SERVER_PID": "<server pid>"}),
        phase("size_increased", "input size, --http-max-input-size=2**27", size_test,
              tuple(f"InferSizeLimitTest.{c}" for c in SIZE_INCREASED), size,
              (f"--http-max-input-size={2 ** 27}",)),
        phase("size_zero", "--http-max-input-size=0", None, repository=size,
              args=("--http-max-input-size=0",), server_must_fail=True,
              log_checks=(("the zero limit is refused", must),)),
        phase("size_negative", "--http-max-input-size=-1024", None, repository=size,
              args=("--http-max-input-size=-1024",), server_must_fail=True,
              log_checks=(("the negative limit is refused", must),)),
        phase("many_chunks", "models, explicit, --load-model=simple, --log-verbose=1",
              "http_request_many_chunks.py", repository=models,
              args=(*SHM, "--log-verbose=1", "--model-control-mode=explicit",
                    "--load-model=simple"),
              env={"SERVER_PID": "<server pid>"}),
    ]


def _grpc(work: Path, phase_cls, log) -> list:
    test_dir = work / "qa" / "L0_grpc"
    models = _examples(work, test_dir / "models", GRPC_MODELS, full=True)
    gtm = _examples(work, test_dir / "grpc_test_models", ("simple",))
    si = qa_gen.copytree(work / "qa" / "python_models" / "string_identity",
                         gtm / "string_identity")
    (si / "1").mkdir()
    shutil.move(si / "model.py", si / "1" / "model.py")
    qa_gen.sed(si / "config.pbtxt", r"dims: \[ 1 \]", "dims: [ -1 ]")
    plugin = test_dir / "client_plugin_models"
    phase = qa_gen.make_phase(phase_cls, "grpc", "L0_grpc")
    unit = "python_unit_test.py"
    return [
        phase("GrpcTest", "grpc_test_models", unit, ("GrpcTest",), gtm),
        phase("client_plugin", "client_plugin_models, header forward patterns",
              "grpc_client_plugin_test.py", repository=plugin,
              args=("--http-header-forward-pattern=.*", "--grpc-header-forward-pattern=.*")),
        phase("aio", "models, --allow-client-shm=true", "python_grpc_aio_test.py",
              repository=models, args=SHM),
        phase("restricted_dup", "--grpc-restricted-protocol health in two groups", None,
              repository=models, server_must_fail=True,
              args=("--grpc-restricted-protocol=model-repository,health:k1=v1",
                    "--grpc-restricted-protocol=metadata,health:k2=v2"),
              log_checks=(("the duplicate is refused",
                           "protocol 'health' can not be specified in multiple config "
                           "groups"),)),
        phase("restricted_unknown", "--grpc-restricted-protocol model-reposit", None,
              repository=models, server_must_fail=True,
              args=("--grpc-restricted-protocol=model-reposit,health:k1=v1",
                    "--grpc-restricted-protocol=metadata,health:k2=v2"),
              log_checks=(("the unknown protocol is refused",
                           "unknown restricted protocol 'model-reposit'"),)),
        phase("restricted", "--grpc-restricted-protocol admin/infer keys", unit,
              ("RestrictedProtocolTest",), models,
              ("--grpc-restricted-protocol=model-repository:admin-key=admin-value",
               "--grpc-restricted-protocol=inference,health:infer-key=infer-value")),
    ]


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    wanted = [s for s in SUITES if s in suites]
    if not wanted:
        return []
    log(f"{', '.join(wanted)}: exported {', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    out = []
    if "http" in wanted:
        out += _http(work, phase_cls, log)
    if "grpc" in wanted:
        out += _grpc(work, phase_cls, log)
    return out
