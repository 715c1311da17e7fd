"""Python backend: runs a Triton `model.py` (class TritonPythonModel) unmodified.

The worker hands this backend a whole dynamic batch as requests (no concatenation: a
Python model sees one InferenceRequest per client request, as in Triton), each input a
zero-copy view on the bytes it arrived in. Where Triton runs a stub process beside the
server and copies tensors through a 64 MB shared-memory pool per instance, here the worker
process *is* the stub: there is no pool to size and nothing between the request and
as_numpy().

Responses return from execute() (one per request), or through each request's response
sender (decoupled models, or any execute that returns None), from any thread. An async
execute runs on this worker's event loop thread; BLS calls go through services/workers/python/bls.py.
A request's is_cancelled() turns True when its client goes away, also while execute() runs
(services/workers/python/cancel.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import tarfile
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.common.config import config_from_json, config_to_json, normalize
from services.common.errors import CANCELLED_TEXT, Code, TriremeError, invalid_arg, load_failed_text
from services.common.repository import model_file
from services.common.shm import DEFAULT_INLINE_THRESHOLD
from services.workers.backends.base import BackendBase
from services.workers.backends.common import all_params
from services.workers.python import pb_metrics, pb_utils
from services.workers.python.cancel import Cancels

log = logging.getLogger("trireme.python")

ENV_PARAM = "EXECUTION_ENV_PATH"
_OWN_DIR = str(Path(__file__).parent)
_MODEL_DIR_VAR = "$$TRITON_MODEL_DIRECTORY"

# The worker's SIGTERM handler raises SystemExit wherever the main thread is, often inside a
# model's execute(): these pass every handler around the model's code, so an unload or a
# shutdown stops a busy worker at once instead of turning into one failed batch (and a worker
# that ignores the next SIGTERM). A model that catches them itself cannot be stopped from
# here: the worker's guard ends it TERM_GRACE_S later (services/workers/main.py). A model
# that calls sys.exit() ends its worker, which the supervisor restarts.
_STOP = (SystemExit, KeyboardInterrupt)

# reply(index, outputs | None, error | None, final): the worker's thread-safe send
Reply = Callable[[int, "dict[str, np.ndarray] | None", "TriremeError | None", bool], None]


def _format_exception(e: BaseException) -> str:
    """pybind11's rendering, which Triton's error texts carry: "Type: message" then the
    frames, innermost first, as "  file(line): function"."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(_OWN_DIR)]   # the model's frames, not ours
    at = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
    return f"{type(e).__name__}: {e}\n\nAt:\n{at}"


def _activate_env(spec: str, model_dir: Path) -> None:
    """EXECUTION_ENV_PATH: a packed environment (.tar.gz, conda-pack or a tarred venv) or
    a venv folder. Its site-packages go in front of sys.path before model.py is imported.
    The worker's own interpreter runs the model, so the environment must be for the same
    Python major.minor (Triton's rule for its stub as well)."""
    path = Path(spec.replace(_MODEL_DIR_VAR, str(model_dir)))
    if not path.exists():
        raise invalid_arg(f"{ENV_PARAM} '{path}' does not exist")
    if path.is_file():
        key = hashlib.sha256(f"{path}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:16]
        target = Path(tempfile.gettempdir()) / f"trireme-env-{key}"
        if not target.exists():
            tmp = Path(tempfile.mkdtemp(prefix="trireme-env-"))
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
            try:
                os.rename(tmp, target)
            except OSError:   # another instance unpacked it first
                pass
        path = target
    wanted = f"python{sys.version_info.major}.{sys.version_info.minor}"
    sites = sorted(path.glob("lib/python3*/site-packages"))
    if not sites:
        raise invalid_arg(f"{ENV_PARAM} '{spec}' holds no lib/python3.*/site-packages")
    mine = [s for s in sites if s.parent.name == wanted]
    if not mine:
        raise invalid_arg(
            f"{ENV_PARAM} '{spec}' is for {sites[0].parent.name}, but this worker runs {wanted}")
    sys.path.insert(0, str(mine[0]))


def _import_model(path: Path, name: str) -> Any:
    """model.py as a module of its own; its folder is importable (helper modules beside it)."""
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"trireme_model_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, "TritonPythonModel", None)
    if cls is None:
        raise invalid_arg(f"{path} does not define class TritonPythonModel")
    return cls


class PythonBackend(BackendBase):
    per_request = True

    def __init__(self, cfg, load) -> None:
        self.name = load.model
        self.instance = load.instance_name
        pb_utils._model_name = load.model
        params = all_params(cfg)
        if params.get(ENV_PARAM):
            _activate_env(params[ENV_PARAM], Path(load.model_dir))
        path = model_file(cfg, load.model_dir, load.version)
        try:
            cls = _import_model(path, f"{load.model}_{load.version}")
        except (TriremeError, *_STOP):
            raise
        except BaseException as e:  # noqa: BLE001 - whatever model.py raises fails the load
            raise invalid_arg(load_failed_text(load.model, load.version,
                                               _format_exception(e))) from None
        if load.autocomplete and hasattr(cls, "auto_complete_config"):
            cfg = self._auto_complete(cls, cfg)
        self.config = cfg
        self.config_dict = config_to_json(cfg)
        self.decoupled = cfg.model_transaction_policy.decoupled
        # Cancel flags behind is_cancelled(); the worker opens their channel (cancel.py).
        self.cancels = Cancels()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bls: Any = None
        self._bls_lock = threading.Lock()
        self._frontend_addr = load.frontend_addr
        pb_utils._bls = self._bls_client
        self.model = cls()
        args = {
            "model_config": json.dumps(self.config_dict),
            "model_instance_kind": "GPU" if load.kind == "KIND_GPU" else "CPU",
            "model_instance_name": load.instance_name,
            "model_instance_device_id": str(load.device_id),
            "model_repository": str(load.model_dir),
            "model_version": str(load.version),
            "model_name": load.model,
        }
        if hasattr(self.model, "initialize"):
            self._call_model("initialize", self.model.initialize, args)
        # The worker answers readiness probes with the model's is_ready, when it has one.
        self.probes_ready = hasattr(self.model, "is_ready")

    def _bls_client(self) -> Any:
        """Started on the first BLS call: most Python models never make one."""
        with self._bls_lock:
            if self._bls is None:
                from services.workers.python.bls import BlsClient
                self._bls = BlsClient(self._frontend_addr, DEFAULT_INLINE_THRESHOLD, True)
            return self._bls

    def _auto_complete(self, cls: Any, cfg) -> Any:
        wrapped = pb_utils.ModelConfig(config_to_json(cfg))
        try:
            result = cls.auto_complete_config(wrapped)
            out = config_from_json((result or wrapped).as_dict())
        except _STOP:
            raise
        except BaseException as e:  # noqa: BLE001 - the model's code: any error fails the load
            raise invalid_arg(f"auto-complete of '{cfg.name}' failed: "
                                                 f"{e}") from None
        normalize(out)
        return out

    def _call_model(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                result = self._run_async(result).result()
            return result
        except _STOP:
            raise
        except BaseException as e:  # noqa: BLE001 - the model's code: any error is reported
            raise TriremeError(Code.INVALID_ARG if what == "initialize" else Code.INTERNAL,
                               f"{what} of model '{self.name}' failed: {_format_exception(e)}") from None

    def _run_async(self, coro: Any) -> Any:
        """Coroutines run on one loop thread per worker, which BLS async_exec awaits on too."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="trireme-model-loop",
                             daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def is_ready(self) -> bool:
        return self._call_model("is_ready", self.model.is_ready) if self.probes_ready else True

    def take_metrics(self) -> list | None:
        """The model's custom metrics (pb_utils.MetricFamily), when they changed."""
        return pb_metrics.take_metrics()

    # ---------------------------------------------------------------------------- execute
    def execute_requests(self, items: list[Any], inputs: list[dict[str, np.ndarray]],
                         reply: Reply) -> list[Any]:
        """Run execute() on the batch. Returns, per request, its outputs dict, a
        TriremeError, or None when its response sender answers (now or later). Each
        request's cancel flag is followed until its final response."""
        keys = [(item.reply_to, item.req_id) for item in items]
        cancels = self.cancels

        def answer(i: int, out: Any, err: Any, final: bool) -> None:
            if final:
                cancels.done(keys[i])
            reply(i, out, err, final)

        requests = []
        for i, (item, tensors) in enumerate(zip(items, inputs)):
            req = _request(self.name, item, tensors)
            req._flag = cancels.track(keys[i])
            req._sender = pb_utils.InferenceResponseSender(_sender(i, answer), req._flag)
            requests.append(req)
        answers = self._execute(requests, answer)
        for key, req, ans in zip(keys, requests, answers):
            if ans is not None or req._sender._closed:   # answered: nothing more will come
                cancels.done(key)
        return answers

    def _execute(self, requests: list[pb_utils.InferenceRequest], reply: Reply) -> list[Any]:
        try:
            result = self.model.execute(requests)
            if inspect.isawaitable(result):
                future = self._run_async(result)
                if self.decoupled:   # responses come through the senders; don't wait
                    future.add_done_callback(lambda f: self._async_done(f, requests, reply))
                    return [None] * len(requests)
                result = future.result()
        except _STOP:   # SIGTERM (unload, shutdown) stops the worker, not this batch
            raise
        except BaseException as e:  # noqa: BLE001 - the model's code: any error is the requests'
            err = TriremeError(Code.INTERNAL, f"Failed to process the request(s) for model "
                               f"'{self.instance}', message: {_format_exception(e)}")
            return [err if not r.get_response_sender()._closed else None for r in requests]
        if result is None:
            if not self.decoupled and not all(r.get_response_sender()._closed for r in requests):
                return [None if r.get_response_sender()._closed else TriremeError(
                    Code.INTERNAL, "Python model '" + self.instance + "' returned None without "
                    "sending a final response for each request") for r in requests]
            return [None] * len(requests)
        if self.decoupled:
            err = TriremeError(Code.INTERNAL, "Python model '" + self.instance + "' is using the "
                               "decoupled mode and the execute function must return None.")
            return [err] * len(requests)
        result = list(result)
        if len(result) != len(requests):
            err = TriremeError(Code.INTERNAL, (
                "Number of InferenceResponse objects do not match the number of InferenceRequest "
                f"objects. InferenceRequest(s) size is:{len(requests)}, and InferenceResponse(s) "
                f"size is:{len(result)}\n"))
            return [err] * len(requests)
        return [_returned(r, req) for r, req in zip(result, requests)]

    def _async_done(self, future: Any, requests: list[Any], reply: Reply) -> None:
        """A decoupled async execute ended: if it raised, every request it left open fails."""
        e = future.exception()
        if e is None:
            return
        err = TriremeError(Code.INTERNAL, f"Failed to process the request(s) for model "
                           f"'{self.instance}', message: {_format_exception(e)}")
        for i, r in enumerate(requests):
            if not r.get_response_sender()._closed:
                r.get_response_sender()._closed = True
                reply(i, None, err, True)

    def close(self) -> None:
        if hasattr(self.model, "finalize"):
            try:
                self._call_model("finalize", self.model.finalize)
            except TriremeError as e:
                log.error("%s", e.message)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._bls is not None:
            self._bls.close()


def _request(model: str, item: Any, tensors: dict[str, np.ndarray]) -> pb_utils.InferenceRequest:
    params = item.parameters
    flags = ((pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0)
             | (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0))
    return pb_utils.InferenceRequest(
        model, [pb_utils.Tensor(n, a) for n, a in tensors.items()], item.outputs,
        request_id=item.request_id, correlation_id=params.get("sequence_id", 0), flags=flags,
        timeout=int(params.get("timeout", 0) or 0), parameters=params)


def _returned(resp: Any, req: pb_utils.InferenceRequest) -> Any:
    """A response execute() returned for ``req``. None stands for no response: the request
    was answered through its sender, or it was cancelled and the model stopped (Triton's
    execute_cancel example returns None for those)."""
    if resp is None:
        if req.get_response_sender()._closed:
            return None
        if req.is_cancelled():
            return TriremeError(Code.CANCELLED, CANCELLED_TEXT)
    return _outputs_or_error(resp)


def _outputs_or_error(resp: Any) -> dict[str, np.ndarray] | TriremeError:
    if not isinstance(resp, pb_utils.InferenceResponse):
        return TriremeError(Code.INTERNAL, f"Expected an InferenceResponse object in the execute "
                                           f"function return list, found type '{type(resp).__name__}'.")
    if resp.has_error():
        e = resp.error()
        return TriremeError(e.code(), e.message())
    return {t.name(): t._numpy() for t in resp.output_tensors()}


def _sender(index: int, reply: Reply) -> Callable[[Any, bool], None]:
    def send(response: pb_utils.InferenceResponse | None, final: bool) -> None:
        if response is None:
            reply(index, None, None, final)
            return
        out = _outputs_or_error(response)
        if isinstance(out, TriremeError):
            reply(index, None, out, final)
        else:
            reply(index, out, None, final)
    return send


BACKEND = PythonBackend
