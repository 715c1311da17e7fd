"""Model configuration: read config.pbtxt, auto-complete it as Triton does, validate it,
and render it as the JSON of GET /v2/models/{m}/config. No framework imports.

Follows Triton core's model_config_utils.cc (AutoCompleteBackendFields, NormalizeModelConfig,
NormalizeInstanceGroup, SetDefaultInstanceCount, ValidateModelConfig, ModelConfigToJson),
model_repository_manager.cc (name check) and onnxruntime_backend's AutoCompleteMaxBatch /
AutoCompleteIO / ValidateInputs (complete_io). Error texts are Triton's where it has one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from protos import model_config_pb2 as mc
from services.common.batch_io_config import validate_batch_io
from services.common.canary import version_split
from services.common.errors import expects_datatype_text, expects_inputs_text, invalid_arg, unexpected_io_text
from services.common.repository import available_versions

CONFIG_PBTXT, CONFIGS_FOLDER = "config.pbtxt", "configs"

# Platforms / backends / default files (Triton core constants.h).
ENSEMBLE = "ensemble"
TF_SAVEDMODEL, TF_GRAPHDEF = "tensorflow_savedmodel", "tensorflow_graphdef"
TRT_PLAN, ORT_ONNX = "tensorrt_plan", "onnxruntime_onnx"
TORCH_LIBTORCH, TORCH_LIBTORCH_ALT, TORCH_AOTI = "pytorch_libtorch", "libtorch", "torch_aoti"
TF_SAVEDMODEL_FILE, TF_GRAPHDEF_FILE = "model.savedmodel", "model.graphdef"
TRT_FILE, ORT_FILE, OV_FILE = "model.plan", "model.onnx", "model.xml"
TORCH_FILE, TORCH_AOTI_FILE, PYTHON_FILE = "model.pt", "model.pt2", "model.py"

# backend type of a platform, for the "unexpected 'platform' and 'backend' pair" check
_PLATFORM_BACKEND = {
    TF_SAVEDMODEL: "tensorflow", TF_GRAPHDEF: "tensorflow", TRT_PLAN: "tensorrt",
    ORT_ONNX: "onnxruntime", TORCH_LIBTORCH: "pytorch", TORCH_LIBTORCH_ALT: "pytorch",
    TORCH_AOTI: "pytorch",
}
_TYPED_BACKENDS = set(_PLATFORM_BACKEND.values())  # Triton's GetBackendType
# Backends whose KIND_AUTO groups may resolve to KIND_GPU (OpenVINO runs on CPU only).
_GPU_BACKENDS = {"onnxruntime", "pytorch", "tensorflow", "tensorrt", "python"}
# Backends that need inputs/outputs before a worker can run them (validate(require_io)).
_IO_BACKENDS = {"onnxruntime", "pytorch", "tensorflow", "tensorrt", "openvino"}
_DEFAULT_CPU_COUNT_2 = {"onnxruntime", "tensorflow"}  # SetDefaultInstanceCount
SEQUENCE_IDLE_DEFAULT_US = 1_000_000


# ---------------------------------------------------------------------------- loading
def config_path(model_dir: Path, config_name: str | None = None) -> Path:
    """`configs/<name>.pbtxt` when asked for and present, else `config.pbtxt`
    (Triton's --model-config-name, GetModelConfigFullPath)."""
    model_dir = Path(model_dir)
    if config_name:
        custom = model_dir / CONFIGS_FOLDER / f"{config_name}.pbtxt"
        if custom.is_file():
            return custom
    return model_dir / CONFIG_PBTXT


def parse_pbtxt(text: str, source: str = "<string>") -> mc.ModelConfig:
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise invalid_arg(f"failed to read text proto from {source}: {e}") from None
    return cfg


def load_config(model_dir: Path, config_name: str | None = None) -> mc.ModelConfig:
    """Parse the model's config; a missing file gives an empty config (auto-complete fills it)."""
    path = config_path(model_dir, config_name)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return mc.ModelConfig()
    except (OSError, UnicodeDecodeError) as e:
        raise invalid_arg(f"failed to read text proto from {path}: {e}") from None
    return parse_pbtxt(text, str(path))


# ---------------------------------------------------------------------- auto-complete
# Triton's order after TensorFlow: (backend, platform it implies, default file, platforms that
# select it, whether the file must be a dir (None: either)).
_RULES: tuple[tuple[str, str, str, set[str], bool | None], ...] = (
    ("tensorrt", TRT_PLAN, TRT_FILE, {TRT_PLAN}, False),
    ("onnxruntime", ORT_ONNX, ORT_FILE, {ORT_ONNX}, None),  # a dir holds a large model
    ("openvino", "", OV_FILE, set(), None),
    ("pytorch", TORCH_LIBTORCH, TORCH_FILE, {TORCH_LIBTORCH, TORCH_LIBTORCH_ALT}, False),
    ("pytorch", TORCH_AOTI, TORCH_AOTI_FILE, {TORCH_AOTI}, False),
    ("python", "", PYTHON_FILE, set(), None),
)


def _complete_backend_fields(cfg: mc.ModelConfig, model_dir: Path, model_name: str) -> None:
    """AutoCompleteBackendFields: platform <-> backend <-> default_model_filename <-> files."""
    # Triton inspects the first version folder it lists; we take the newest valid one.
    versions = available_versions(model_dir)
    vdir = model_dir / str(versions[-1]) if versions else None
    try:
        files = {p.name for p in vdir.iterdir()} if vdir else set()
    except OSError:
        files = set()
    dmf = cfg.default_model_filename

    def has(name: str, is_dir: bool | None) -> bool:  # files decide only if nothing else does
        if vdir is None or cfg.platform or dmf or name not in files:
            return False
        return is_dir is None or (vdir / name).is_dir() == is_dir

    if not cfg.platform and not cfg.backend and cfg.HasField("ensemble_scheduling"):
        cfg.platform = ENSEMBLE  # convenience; Triton requires the platform to be written
    # TensorFlow first: only the platform tells savedmodel from graphdef
    if not cfg.platform and cfg.backend in ("", "tensorflow"):
        if dmf == TF_SAVEDMODEL_FILE or has(TF_SAVEDMODEL_FILE, True):
            cfg.platform = TF_SAVEDMODEL
        elif dmf == TF_GRAPHDEF_FILE or has(TF_GRAPHDEF_FILE, False):
            cfg.platform = TF_GRAPHDEF
    if cfg.platform in (TF_SAVEDMODEL, TF_GRAPHDEF):
        cfg.backend = cfg.backend or "tensorflow"
        cfg.default_model_filename = dmf or (
            TF_SAVEDMODEL_FILE if cfg.platform == TF_SAVEDMODEL else TF_GRAPHDEF_FILE)
        return
    if not cfg.backend:
        for backend, platform, filename, platforms, is_dir in _RULES:
            if cfg.platform in platforms or dmf == filename or has(filename, is_dir):
                cfg.backend, cfg.platform = backend, cfg.platform or platform
                break
    rows = [r for r in _RULES if r[0] == cfg.backend]
    if rows:
        row = next((r for r in rows if cfg.platform in r[3]), rows[0])
        cfg.platform = cfg.platform or row[1]
        # (Triton leaves the file empty for an explicit libtorch platform; we always name it.)
        cfg.default_model_filename = dmf or row[2]
        return
    # Custom backend: named by the model folder "x.<backend>", or given with no file name.
    if not cfg.backend and not cfg.platform and not dmf:
        if "." not in model_name:
            raise invalid_arg(f"Invalid model name: Could not determine backend for model "
                             f"'{model_name}' with no backend in model configuration. Expected model "
                             "name of the form 'model.<backend_name>'.")
        cfg.backend = model_name.split(".", 1)[1]
    if cfg.backend and not dmf:
        cfg.default_model_filename = f"model.{cfg.backend}"


def normalize(cfg: mc.ModelConfig) -> None:
    """NormalizeModelConfig, in place. Run after auto-complete and again after complete_io."""
    if not cfg.HasField("version_policy"):
        cfg.version_policy.latest.num_versions = 1
    # Triton (and ../shared/reference/protocol.md §3) fill preferred_batch_size with
    # [max_batch_size] when empty.
    if cfg.HasField("dynamic_batching") and not cfg.dynamic_batching.preferred_batch_size \
            and cfg.max_batch_size > 0:
        cfg.dynamic_batching.preferred_batch_size.append(cfg.max_batch_size)
    if cfg.HasField("sequence_batching"):
        sb = cfg.sequence_batching
        if sb.max_sequence_idle_microseconds == 0:
            sb.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_US
        if sb.HasField("oldest") and not sb.oldest.preferred_batch_size and cfg.max_batch_size > 0:
            sb.oldest.preferred_batch_size.append(cfg.max_batch_size)
    if not cfg.HasField("ensemble_scheduling"):
        for pinned in ("input_pinned_memory", "output_pinned_memory"):
            if not cfg.optimization.HasField(pinned):
                getattr(cfg.optimization, pinned).enable = True


def _normalize_instance_groups(cfg: mc.ModelConfig, has_gpu: bool, gpu_ids: Sequence[int]) -> None:
    """NormalizeInstanceGroup + SetDefaultInstanceCount."""
    if cfg.HasField("ensemble_scheduling") or cfg.platform == ENSEMBLE:
        return
    gpu_ok = has_gpu and cfg.backend in _GPU_BACKENDS
    if not cfg.instance_group:  # Triton names the implicit group after the model
        cfg.instance_group.add(name=cfg.name)
    G = mc.ModelInstanceGroup
    for i, group in enumerate(cfg.instance_group):
        if not group.name:
            group.name = f"{cfg.name}_{i}"
        if group.kind == G.KIND_AUTO:
            bad = gpu_ids and any(g not in gpu_ids for g in group.gpus)
            group.kind = G.KIND_GPU if gpu_ok and not bad else G.KIND_CPU
        if group.count < 1:
            group.count = 2 if (group.kind == G.KIND_CPU and cfg.backend in _DEFAULT_CPU_COUNT_2) else 1
        if group.kind == G.KIND_GPU:
            if not has_gpu:
                raise invalid_arg(f"instance group {group.name} of model {cfg.name} has kind KIND_GPU "
                                 "but no GPUs are available")
            if not group.gpus:
                group.gpus.extend(gpu_ids)


def autocomplete(cfg: mc.ModelConfig, model_dir: Path, model_name: str, *, has_gpu: bool = False,
                 gpu_ids: Sequence[int] | None = None) -> mc.ModelConfig:
    """The server-side half of Triton's auto-complete; returns a completed copy.

    IO/max_batch_size from the model file are filled later by a worker (complete_io).
    `gpu_ids` fills `gpus` of KIND_GPU groups that list none (default [0] when has_gpu)."""
    out = copy.deepcopy(cfg)
    if not out.name:
        out.name = model_name
    elif out.name != model_name:
        raise invalid_arg(f"unexpected directory name '{model_name}' for model '{out.name}', "
                         "directory name must equal model name")
    _complete_backend_fields(out, Path(model_dir), model_name)
    normalize(out)
    ids = list(gpu_ids) if gpu_ids is not None else ([0] if has_gpu else [])
    _normalize_instance_groups(out, has_gpu or bool(ids), ids)
    return out


# -------------------------------------------------------------------------- complete_io
def _to_dtype(datatype: str) -> int:
    """API datatype ("FP32", "BYTES") or config name ("TYPE_FP32") -> mc.DataType value."""
    name = datatype.upper().removeprefix("TYPE_")
    try:
        return mc.DataType.Value("TYPE_" + ("STRING" if name == "BYTES" else name))
    except ValueError:
        raise invalid_arg(f"unsupported datatype {datatype}") from None


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _fill_io(io, shape: Sequence[int], dtype: int, mbs: int) -> None:
    if io.data_type == mc.TYPE_INVALID:
        io.data_type = dtype
    if not io.dims and not io.HasField("reshape"):
        dims = list(shape[1:] if mbs > 0 else shape)
        io.dims.extend(dims or [1])  # a scalar (per item) in the file: dims [1] ...
        if not dims and mbs > 0:
            io.reshape.SetInParent()  # ... and an empty reshape when batching


def _check_io(kind: str, name: str, cfg: mc.ModelConfig, io, shape: Sequence[int], dtype: int) -> None:
    """onnxruntime backend's ValidateInputs/ValidateOutputs + CompareDimsSupported."""
    if io.data_type != dtype:
        raise invalid_arg(expects_datatype_text(name, kind, io.name, mc.DataType.Name(io.data_type),
                                                mc.DataType.Name(dtype)))
    if kind == "input" and io.allow_ragged_batch:  # the model takes one flat run of elements
        pre = f"unable to load model '{name}', configuration expects model provides input with shape [-1]"
        if io.optional:
            raise invalid_arg(f"{pre} for ragged input '{io.name}', "
                              "which is not supported for optional input")
        if list(shape) != [-1]:  # (Triton's text has the double space)
            raise invalid_arg(f"{pre}  for ragged input '{io.name}', model provides {_fmt(shape)}")
        return
    if kind == "output" and any(io.name in b.target_name for b in cfg.batch_output):
        return  # a batch output's shape need not match the model's (Triton skips it too)
    dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
    if not shape:  # scalar tensor in the file
        if any(d != 1 for d in dims):
            raise invalid_arg(f"unable to load model '{name}', scalar tensor '{io.name}', should only "
                             "provide 1 in the model configuration when the model doesn't support "
                             f"batching. Model configuration provided: {_fmt(dims)}.")
        return
    model = shape
    pre = f"model '{name}', tensor '{io.name}': "
    if cfg.max_batch_size > 0:
        if model[0] != -1:
            raise invalid_arg(f"{pre}for the model to support batching the shape should have at least "
                             "1 dimension and the first dimension must be -1; but shape expected by "
                             f"the model is {_fmt(model)}")
        full = [-1, *dims]
        what = (f"{len(full)} dimensions (an initial batch dimension because max_batch_size > 0 "
                f"followed by the explicit tensor shape, making complete shape {_fmt(full)})")
    else:
        full = dims
        what = f"{len(full)} dimensions (shape {_fmt(full)})"
    exact = kind == "output"  # outputs must match exactly, inputs may narrow a -1
    ok = len(model) == len(full) and all(
        m == d for m, d in zip(model, full) if exact or m != -1)
    if not ok:
        raise invalid_arg(f"{pre}the model expects {len(model)} dimensions (shape {_fmt(model)}) but "
                         f"the model configuration specifies {what}")


TensorSpec = tuple[str, str, Sequence[int]]


def complete_io(cfg: mc.ModelConfig, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], *,
                default_max_batch_size: int = 4,
                overridable: Sequence[TensorSpec] = ()) -> mc.ModelConfig:
    """The backend half of auto-complete (Triton's onnxruntime rules), from the tensors a
    worker read in the model file: `(name, API datatype, shape with -1 for dynamic)`.
    ``overridable``: tensors the model has a value for that a config may declare as inputs
    (an ONNX initializer that is also a graph input); never added by auto-complete.
    Returns a completed and checked copy."""
    out = copy.deepcopy(cfg)
    name = out.name
    fin = {n: (list(s), _to_dtype(dt)) for n, dt, s in inputs}
    fout = {n: (list(s), _to_dtype(dt)) for n, dt, s in outputs}
    had_in, had_out = len(out.input) + len(out.batch_input) > 0, len(out.output) > 0
    if not (had_in and had_out):  # Triton skips auto-complete when both are given
        batchable = all(s and s[0] == -1 for s, _ in (*fin.values(), *fout.values()))
        if batchable:
            if out.max_batch_size == 0:
                out.max_batch_size = max(default_max_batch_size, 0)
            if out.max_batch_size > 1 and out.WhichOneof("scheduling_choice") is None:
                out.dynamic_batching.SetInParent()
        elif out.max_batch_size != 0:
            raise invalid_arg(f"autofill failed for model '{name}': model does not support batching "
                             "while non-zero max_batch_size is specified")
    mbs = out.max_batch_size
    known_in = {**{n: (list(s), _to_dtype(dt)) for n, dt, s in overridable}, **fin}
    for kind, ios, found, known, had in (("input", out.input, fin, known_in, had_in),
                                         ("output", out.output, fout, fout, had_out)):
        if not had:
            for tname, (shape, dtype) in found.items():
                _fill_io(ios.add(name=tname), shape, dtype, mbs)
        for io in ios:
            if io.name not in known:
                raise invalid_arg(unexpected_io_text(kind, io.name, found))
            shape, dtype = known[io.name]
            _fill_io(io, shape, dtype, mbs)  # fills only what the config left unset
            _check_io(kind, name, out, io, shape, dtype)
    targets = [t for b in out.batch_input for t in b.target_name]
    for t in targets:  # generated by the worker for the model: the model must take them
        if t not in fin:
            raise invalid_arg(unexpected_io_text("input", t, fin))
    covered = {io.name for io in out.input} | set(targets)
    covered |= {c.name for c in out.sequence_batching.control_input}
    covered |= {st.input_name for st in out.sequence_batching.state}
    if set(fin) - covered:  # Triton: "configuration expects N inputs, model provides M"
        raise invalid_arg(expects_inputs_text(name, len(covered), len(fin)))
    normalize(out)
    return out


# ---------------------------------------------------------------------------- validate
def _element_count(shape: Sequence[int]) -> int:
    """Triton's GetElementCount: -1 with a variable dimension, 0 for an empty shape."""
    if any(d == -1 for d in shape):
        return -1
    n = 0
    for i, d in enumerate(shape):
        n = d if i == 0 else n * d
    return n


def _chunks(shape: Sequence[int]) -> list[int]:
    """Element counts of the runs of fixed dimensions between variable ones."""
    out, n = [], 1
    for d in shape:
        if d == -1:
            out.append(n)
            n = 1
        else:
            n *= d
    return [*out, n]


def _validate_reshape(io, pre: str, model: str) -> None:
    """ValidateIOShape's reshape rules: the client's dims and the model's reshape hold the
    same elements (an empty reshape, a scalar per item, goes with dims of one element), and
    variable dimensions split both into runs of equal size."""
    reshape = list(io.reshape.shape)
    if any(d < 1 and d != -1 for d in reshape):
        raise invalid_arg(f"{pre}reshape dimensions must be integer >= 1, or -1 to indicate a "
                         f"variable-size dimension for {model}")
    dims_size, reshape_size = _element_count(io.dims), _element_count(reshape)
    if dims_size != reshape_size and (reshape_size != 0 or dims_size != 1):
        raise invalid_arg(f"{pre}has different size for dims and reshape for {model}")
    if dims_size == -1:
        a, b = _chunks(io.dims), _chunks(reshape)
        if len(a) != len(b):
            raise invalid_arg(f"{pre}has different number of variable-size dimensions for dims and "
                             f"reshape for {model}")
        if a != b:
            raise invalid_arg(f"{pre}has different size for dims and reshape for {model}")


def _validate_io(io, kind: str, cfg: mc.ModelConfig) -> None:
    pre = f"model {kind} "
    if not io.name:
        raise invalid_arg(f"{pre}must specify 'name' for {cfg.name}")
    pre += f"'{io.name}' "
    if io.data_type == mc.TYPE_INVALID:
        raise invalid_arg(f"{pre}must specify 'data_type' for {cfg.name}")
    if not io.dims:
        raise invalid_arg(f"{pre}must specify 'dims' for {cfg.name}")
    if io.HasField("reshape") and not io.reshape.shape and cfg.max_batch_size == 0:
        raise invalid_arg(f"{pre}cannot have empty reshape for non-batching model as scalar tensors "
                         f"are not supported for {cfg.name}")
    for d in io.dims:
        if d < 1 and d != -1:
            raise invalid_arg(f"{pre}dimension must be integer >= 1, or -1 to indicate a "
                             f"variable-size dimension for {cfg.name}")
    if io.HasField("reshape"):
        _validate_reshape(io, pre, cfg.name)
    if io.is_shape_tensor and cfg.platform != TRT_PLAN:
        raise invalid_arg(f"shape tensors are only supported for TensorRT platform for {cfg.name}")


def validate(cfg: mc.ModelConfig, *, require_io: bool = True) -> None:
    """Load-time checks (Triton's ValidateModelConfig + ValidateModelIOConfig, plus unique
    names). `require_io=False` before a worker has filled inputs/outputs from the file."""
    n = cfg.name
    if not n:
        raise invalid_arg("model configuration must specify 'name'")
    if not cfg.backend and cfg.platform != ENSEMBLE:
        raise invalid_arg(f"unexpected platform type '{cfg.platform}' for {n}")
    if cfg.backend and cfg.platform == ENSEMBLE:
        raise invalid_arg(f"Ensemble model '{n}' must have platform type '{cfg.platform}' "
                          "and empty backend type")
    if cfg.backend in _TYPED_BACKENDS and _PLATFORM_BACKEND.get(cfg.platform) != cfg.backend:
        raise invalid_arg(f"unexpected 'platform' and 'backend' pair, got:{cfg.platform}, {cfg.backend}")
    if cfg.max_batch_size < 0:
        raise invalid_arg(f"'max_batch_size' must be non-negative value for {n}")
    if not cfg.HasField("version_policy"):
        raise invalid_arg(f"must specify 'version policy' for {n}")
    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        for size in db.preferred_batch_size:
            if size <= 0:
                raise invalid_arg(f"dynamic batching preferred size must be positive for {n}")
            if size > cfg.max_batch_size:
                raise invalid_arg(f"dynamic batching preferred size must be <= max batch size for {n}")
        if db.priority_levels and not 1 <= db.default_priority_level <= db.priority_levels:
            raise invalid_arg(f"default priority level must be in range [1, {db.priority_levels}] for {n}")
        for level in db.priority_queue_policy:
            if not 1 <= level <= db.priority_levels:
                raise invalid_arg(f"priority queue policy must have priority level in range "
                                 f"[1, {db.priority_levels}] for {n}")
    if cfg.HasField("sequence_batching") and cfg.response_cache.enable:
        raise invalid_arg(f"Response Cache does not currently support model {n} with sequence batching "
                         "scheduler. Please disable the response cache.")
    if cfg.HasField("ensemble_scheduling"):
        if cfg.platform != ENSEMBLE:
            raise invalid_arg(f"ensemble scheduling cannot be set for model '{n}' "
                              f"whose platform is not {ENSEMBLE}")
        if cfg.instance_group:
            raise invalid_arg(f"instance group should not be specified for ensemble '{n}'")
        if not cfg.ensemble_scheduling.step:
            raise invalid_arg(f"must specify 'step' for ensemble '{n}'")
    elif cfg.platform == ENSEMBLE:
        raise invalid_arg(f"ensemble scheduling must be set for ensemble {n} whose platform is {ENSEMBLE}")
    if cfg.model_transaction_policy.decoupled and cfg.response_cache.enable:
        raise invalid_arg(f"Response Cache does not currently support model {n} with 'decoupled' "
                         "transaction policy. Please disable the response cache.")
    need_io = require_io and (cfg.backend in _IO_BACKENDS or cfg.platform == ENSEMBLE)
    for kind, ios in (("input", cfg.input), ("output", cfg.output)):
        if need_io and not ios:
            raise invalid_arg(f"model configuration for '{n}' must specify at least one {kind}")
        seen: set[str] = set()
        for io in ios:
            _validate_io(io, kind, cfg)
            if io.name in seen:
                raise invalid_arg(f"duplicate {kind} name '{io.name}' for {n}")
            seen.add(io.name)
    if require_io and (cfg.batch_input or cfg.batch_output):
        validate_batch_io(cfg)
    version_split(cfg)   # (a canary split that cannot be read fails the load)


# ------------------------------------------------------------------------------- JSON
_INT64_TYPES = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _fix(value, field):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        _fix_int64(value, field.message_type)
        return value
    return int(value) if field.type in _INT64_TYPES else value


def _fix_int64(obj: dict, desc) -> None:
    """Turn protobuf's int64-as-string back into JSON numbers, guided by the descriptor
    (map keys stay strings: JSON keys must be)."""
    for key, value in obj.items():
        field = desc.fields_by_name.get(key)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vf = field.message_type.fields_by_name["value"]
            for k in value:
                value[k] = _fix(value[k], vf)
        elif isinstance(value, list):
            obj[key] = [_fix(v, field) for v in value]
        else:
            obj[key] = _fix(value, field)


def config_to_json(cfg: mc.ModelConfig) -> dict:
    """What GET /v2/models/{m}/config returns (Triton's ModelConfigToJson, config_version 1)."""
    if cfg.ByteSize() == 0:
        return {}
    obj = json_format.MessageToDict(cfg, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
    _fix_int64(obj, mc.ModelConfig.DESCRIPTOR)
    return obj


def config_from_json(obj: dict | str | bytes) -> mc.ModelConfig:
    """Parse a JSON ModelConfig (a load request's "config" parameter)."""
    try:
        if isinstance(obj, (str, bytes)):
            obj = json.loads(obj)
        if not isinstance(obj, dict):
            raise TypeError("expected a JSON object")
        return json_format.ParseDict(obj, mc.ModelConfig())
    except (TypeError, ValueError, json_format.ParseError) as e:
        raise invalid_arg(f"failed to parse model configuration JSON: {e}") from None


def input_shape(inp, max_batch_size: int) -> list[int]:
    """The full shape clients see: [-1] + dims when the model batches (reshape ignored)."""
    dims = [int(d) for d in inp.dims]
    return [-1, *dims] if max_batch_size > 0 else dims
