"""Python-backend models for the tests, written the way Triton's python_backend documents
them (examples/add_sub, BLS, decoupled repeat, auto_complete_config)."""
from __future__ import annotations

import tarfile
import textwrap
from pathlib import Path

from tests.models import write_config

ADD_SUB = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's examples/add_sub/model.py."""

    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])
        self.args = args

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (in_0.as_numpy() + in_1.as_numpy(),
                            in_0.as_numpy() - in_1.as_numpy())
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))
            inference_response = pb_utils.InferenceResponse(
                output_tensors=[out_tensor_0, out_tensor_1])
            responses.append(inference_response)
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

ADD_SUB_CONFIG = '''
name: "{name}"
backend: "python"
{batching}
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}
]
instance_group [{{ kind: KIND_CPU }}]
'''

ARGS = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes initialize()'s args and the request's id and parameters as JSON."""

    def initialize(self, args):
        self.args = args

    def execute(self, requests):
        out = []
        for request in requests:
            info = {"args": self.args, "id": request.request_id(),
                    "parameters": json.loads(request.parameters()),
                    "requested": request.requested_output_names(),
                    "owns_data": request.inputs()[0].as_numpy().flags.owndata}
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("INFO", np.array([json.dumps(info, sort_keys=True)], dtype=object)),
                pb_utils.Tensor("EXTRA", np.array([1], dtype=np.int32))]))
        return out
'''

STRINGS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BYTES in, BYTES and INT32 out: upper-cased text and its length in characters."""

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            decoded = [t.decode("utf-8") for t in text.reshape(-1)]
            upper = np.array([s.upper().encode("utf-8") for s in decoded], dtype=np.object_)
            length = np.array([len(s) for s in decoded], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("UPPER", upper.reshape(text.shape)),
                pb_utils.Tensor("LENGTH", length.reshape(text.shape))]))
        return responses
'''

BLS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's examples/bls/sync_model.py: MODEL_NAME picks the model that computes."""

    def execute(self, requests):
        responses = []
        for request in requests:
            model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME")
            model_name_string = model_name.as_numpy()[0]
            if isinstance(model_name_string, bytes):
                model_name_string = model_name_string.decode("utf-8")
            infer_request = pb_utils.InferenceRequest(
                model_name=model_name_string,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            infer_response = infer_request.exec()
            if infer_response.has_error():
                raise pb_utils.TritonModelException(infer_response.error().message())
            inference_response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT1")])
            responses.append(inference_response)
        return responses
'''

BLS_ASYNC = '''
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's examples/bls/async_model.py: two BLS requests in flight at once; OUTPUT0
    from the first model named in MODEL_NAMES, OUTPUT1 from the second."""

    async def execute(self, requests):
        responses = []
        for request in requests:
            names = [n.decode() for n in
                     pb_utils.get_input_tensor_by_name(request, "MODEL_NAMES").as_numpy()]
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                      pb_utils.get_input_tensor_by_name(request, "INPUT1")]
            awaits = [pb_utils.InferenceRequest(model_name=n, inputs=inputs,
                                                requested_output_names=[o]).async_exec()
                      for n, o in zip(names, ("OUTPUT0", "OUTPUT1"))]
            first, second = await asyncio.gather(*awaits)
            for r in (first, second):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(first, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(second, "OUTPUT1")]))
        return responses
'''

BLS_DECOUPLED = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sums every response a decoupled model streams back for IN."""

    def execute(self, requests):
        responses = []
        for request in requests:
            infer_request = pb_utils.InferenceRequest(
                model_name="repeat", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            total, count = 0, 0
            for r in infer_request.exec(decoupled=True):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
                if r.output_tensors():
                    total += int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
                    count += 1
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("SUM", np.array([total, count], dtype=np.int32))]))
        return responses
'''

REPEAT = '''
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled (Triton's repeat example, simplified): one response per element of IN,
    sent from a thread after execute returned, then the final flag alone. A negative
    element is answered with an error response, and the stream goes on."""

    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            sender = request.get_response_sender()
            t = threading.Thread(target=self.respond, args=(values, sender))
            t.start()
            self.threads.append(t)
        return None

    def respond(self, values, sender):
        for v in values:
            if v < 0:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"negative value {v}")))
                continue
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([v], dtype=np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            t.join()
'''

RAISER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Identity on X; a negative first element raises, an element of 100 answers with a
    TritonError, 5 answers with a complex output no datatype fits, and 7 ends the process
    the way a crashing extension would."""

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                raise ValueError("negative input")
            if x[0] == 7:
                import ctypes
                ctypes.string_at(0)   # SIGSEGV
            if x[0] == 5:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.astype(np.complex64))]))
                continue
            if x[0] == 100:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "one hundred is not allowed", pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
'''

AUTO = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """No config.pbtxt: auto_complete_config fills it (Triton's documented example)."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "IN", "data_type": "TYPE_INT32", "dims": [2]}]
        outputs = [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [2]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for i in inputs:
            if i["name"] not in input_names:
                auto_complete_model_config.add_input(i)
        for o in outputs:
            if o["name"] not in output_names:
                auto_complete_model_config.add_output(o)
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
'''

INIT_FAILS = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("no weights for " + args["model_name"])

    def execute(self, requests):
        return []
'''

EXITS = '''
import os

os._exit(3)
'''

ENV_PROBE = '''
import numpy as np
import triton_python_backend_utils as pb_utils
import trireme_env_probe


class TritonPythonModel:
    """Reads a module that only its EXECUTION_ENV_PATH environment provides."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "VALUE", np.array([trireme_env_probe.VALUE], dtype=np.int32))]) for r in requests]
'''

PROBED = '''
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Ready while the file "healthy" exists in its model folder (is_ready)."""

    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "healthy")

    def is_ready(self):
        return os.path.exists(self.marker)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests]
'''

METERED = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Custom metrics, as Triton's custom_metrics example: a counter and a histogram."""

    def initialize(self, args):
        self.seen = pb_utils.MetricFamily(
            name="requests_seen", description="Requests this model executed",
            kind=pb_utils.MetricFamily.COUNTER).Metric(labels={"model": args["model_name"]})
        self.sizes = pb_utils.MetricFamily(
            name="input_size", description="Elements per request",
            kind=pb_utils.MetricFamily.HISTOGRAM).Metric(labels={"model": args["model_name"]},
                                                         buckets=[1, 4])

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            self.seen.increment(1)
            self.sizes.observe(x.size)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "Y", x.astype("int64").sum(keepdims=True).astype(x.dtype))]))
        return out
'''

IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''

# Hangs in execute() when IN[0] > 0 (after writing its pid to <model dir>/hanging), for the
# exit-timeout, unload and watchdog tests.
HANG = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "hanging")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] > 0:
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(600)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
'''


# OUT = 2 * IN, any shape (the response cache and ensemble-chain tests' second step)
SCALE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", 2 * pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
'''

def python_model(root: Path, name: str, source: str, config: str | None) -> Path:
    d = root / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "1" / "model.py").write_text(textwrap.dedent(source).lstrip())
    if config is not None:
        write_config(d, textwrap.dedent(config).lstrip())
    return d


def io_config(name: str, inputs: list[tuple[str, str, str]], outputs: list[tuple[str, str, str]],
              extra: str = "", max_batch_size: int = 0) -> str:
    def block(items):
        return ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in items)
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n{extra}\n'
            f'input [\n{block(inputs)}\n]\noutput [\n{block(outputs)}\n]\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n')


def execution_env(root: Path, value: int, packed: bool) -> Path:
    """A Python environment holding one module, as a venv-style folder or a .tar.gz of one."""
    env = root / f"env_{value}"
    site = env / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / "trireme_env_probe.py").write_text(f"VALUE = {value}\n")
    if not packed:
        return env
    tar = root / f"env_{value}.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        t.add(env / "lib", arcname="lib")
    return tar


def python_repository(root: Path) -> Path:
    """Every Python model the backend tests serve, beside one ONNX add_sub for BLS."""
    from tests import models
    python_model(root, "add_sub", ADD_SUB, ADD_SUB_CONFIG.format(name="add_sub", batching=""))
    python_model(root, "add_sub_batched", ADD_SUB, ADD_SUB_CONFIG.format(
        name="add_sub_batched", batching="max_batch_size: 8\ndynamic_batching { "
        "preferred_batch_size: [4] max_queue_delay_microseconds: 2000000 }"))
    python_model(root, "identity", IDENTITY, io_config(
        "identity", [("INPUT0", "TYPE_FP32", "[ -1 ]")], [("OUTPUT0", "TYPE_FP32", "[ -1 ]")],
        max_batch_size=8))
    python_model(root, "args", ARGS, io_config(
        "args", [("X", "TYPE_INT32", "[ 1 ]")], [("INFO", "TYPE_STRING", "[ 1 ]"),
                                                  ("EXTRA", "TYPE_INT32", "[ 1 ]")]))
    python_model(root, "strings", STRINGS, io_config(
        "strings", [("TEXT", "TYPE_STRING", "[ -1 ]")],
        [("UPPER", "TYPE_STRING", "[ -1 ]"), ("LENGTH", "TYPE_INT32", "[ -1 ]")]))
    bls_io = [("MODEL_NAME", "TYPE_STRING", "[ 1 ]"), ("INPUT0", "TYPE_FP32", "[ 4 ]"),
              ("INPUT1", "TYPE_FP32", "[ 4 ]")]
    out_io = [("OUTPUT0", "TYPE_FP32", "[ 4 ]"), ("OUTPUT1", "TYPE_FP32", "[ 4 ]")]
    python_model(root, "bls", BLS, io_config("bls", bls_io, out_io))
    python_model(root, "bls_async", BLS_ASYNC, io_config(
        "bls_async", [("MODEL_NAMES", "TYPE_STRING", "[ 2 ]")] + bls_io[1:], out_io))
    python_model(root, "bls_decoupled", BLS_DECOUPLED, io_config(
        "bls_decoupled", [("IN", "TYPE_INT32", "[ -1 ]")], [("SUM", "TYPE_INT32", "[ 2 ]")]))
    python_model(root, "repeat", REPEAT, io_config(
        "repeat", [("IN", "TYPE_INT32", "[ -1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    python_model(root, "raiser", RAISER, io_config(
        "raiser", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    python_model(root, "auto", AUTO, None)
    python_model(root, "init_fails", INIT_FAILS, io_config(
        "init_fails", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    python_model(root, "exits", EXITS, io_config(
        "exits", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    for name, value, packed in (("env_dir", 41, False), ("env_tar", 42, True)):
        env = execution_env(root.parent / "envs", value, packed)
        python_model(root, name, ENV_PROBE, io_config(
            name, [("X", "TYPE_INT32", "[ 1 ]")], [("VALUE", "TYPE_INT32", "[ 1 ]")],
            extra=f'parameters {{ key: "EXECUTION_ENV_PATH" value {{ string_value: "{env}" }} }}'))
    probed = python_model(root, "probed", PROBED, io_config(
        "probed", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    (probed / "healthy").touch()
    python_model(root, "metered", METERED, io_config(
        "metered", [("X", "TYPE_INT32", "[ -1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    models.add_sub(root / "onnx_add_sub", size=4, batch=False)
    write_config(root / "onnx_add_sub", 'backend: "onnxruntime"\n'
                 'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    return root
