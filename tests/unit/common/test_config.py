"""services.common.config: parsing, auto-complete, complete_io, validate, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protos import model_config_pb2 as mc
from services.common import config as C
from services.common.errors import Code, TriremeError

G = mc.ModelInstanceGroup


def make_model(repo: Path, name: str, pbtxt: str | None = None,
               files: dict[str, str] | None = None) -> Path:
    """A model folder; files maps 'relpath' -> '' for a file or 'dir' for a directory."""
    d = repo / name
    d.mkdir(parents=True)
    if pbtxt is not None:
        (d / "config.pbtxt").write_text(pbtxt)
    for rel, kind in (files or {}).items():
        p = d / rel
        if kind == "dir":
            p.mkdir(parents=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x")
    return d


def complete(tmp_path, name, pbtxt=None, files=None, **kw) -> mc.ModelConfig:
    d = make_model(tmp_path, name, pbtxt, files)
    return C.autocomplete(C.load_config(d), d, name, **kw)


def expect_error(fn, *args, code=Code.INVALID_ARG, **kw) -> str:
    with pytest.raises(TriremeError) as ei:
        fn(*args, **kw)
    assert ei.value.code == code
    return str(ei.value)


# ------------------------------------------------------------------------ load_config
def test_load_parses_text_format(tmp_path):
    d = make_model(tmp_path, "m", """
        name: "m"
        backend: "onnxruntime"
        max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]
        output [ { name: "y" data_type: TYPE_STRING dims: [ 1 ] label_filename: "l.txt" } ]
        dynamic_batching { max_queue_delay_microseconds: 100 }
        instance_group [ { kind: KIND_CPU count: 3 } ]
        parameters { key: "k" value { string_value: "v" } }
    """)
    cfg = C.load_config(d)
    assert cfg.max_batch_size == 8
    assert list(cfg.input[0].dims) == [-1, 3]
    assert cfg.output[0].data_type == mc.TYPE_STRING
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100
    assert cfg.instance_group[0].count == 3
    assert cfg.parameters["k"].string_value == "v"


def test_load_missing_file_gives_empty_config(tmp_path):
    d = make_model(tmp_path, "m")
    assert C.load_config(d) == mc.ModelConfig()


def test_load_parse_error_names_file_and_reason(tmp_path):
    d = make_model(tmp_path, "m", 'name: "m"\nmax_batch_size: "eight"\n')
    msg = expect_error(C.load_config, d)
    assert str(d / "config.pbtxt") in msg
    assert "max_batch_size" in msg and "2:" in msg  # protobuf's line:col message


def test_load_unknown_field_is_an_error(tmp_path):
    d = make_model(tmp_path, "m", 'name: "m"\nbogus_field: 1\n')
    assert "bogus_field" in expect_error(C.load_config, d)


def test_load_custom_config_name_with_fallback(tmp_path):
    d = make_model(tmp_path, "m", "max_batch_size: 1")
    (d / "configs").mkdir()
    (d / "configs" / "big.pbtxt").write_text("max_batch_size: 64")
    assert C.load_config(d, "big").max_batch_size == 64
    assert C.load_config(d, "absent").max_batch_size == 1
    assert C.load_config(d).max_batch_size == 1


# ----------------------------------------------------------------------- autocomplete
def test_name_from_folder_and_mismatch(tmp_path):
    cfg = complete(tmp_path, "resnet", files={"1/model.onnx": ""})
    assert cfg.name == "resnet"
    d = make_model(tmp_path, "folder", 'name: "other"\nbackend: "onnxruntime"')
    msg = expect_error(C.autocomplete, C.load_config(d), d, "folder")
    assert msg == ("unexpected directory name 'folder' for model 'other', "
                   "directory name must equal model name")


@pytest.mark.parametrize("rel,kind,platform,backend,filename", [
    ("1/model.onnx", "", "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ("1/model.onnx", "dir", "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ("1/model.pt", "", "pytorch_libtorch", "pytorch", "model.pt"),
    ("1/model.pt2", "", "torch_aoti", "pytorch", "model.pt2"),
    ("1/model.savedmodel", "dir", "tensorflow_savedmodel", "tensorflow", "model.savedmodel"),
    ("1/model.graphdef", "", "tensorflow_graphdef", "tensorflow", "model.graphdef"),
    ("1/model.plan", "", "tensorrt_plan", "tensorrt", "model.plan"),
    ("1/model.xml", "", "", "openvino", "model.xml"),
    ("1/model.py", "", "", "python", "model.py"),
])
def test_infer_from_files(tmp_path, rel, kind, platform, backend, filename):
    cfg = complete(tmp_path, "m", files={rel: kind})
    assert (cfg.platform, cfg.backend, cfg.default_model_filename) == (platform, backend, filename)


@pytest.mark.parametrize("given,platform,backend,filename", [
    ('platform: "onnxruntime_onnx"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ('backend: "onnxruntime"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ('platform: "pytorch_libtorch"', "pytorch_libtorch", "pytorch", "model.pt"),
    ('backend: "pytorch"', "pytorch_libtorch", "pytorch", "model.pt"),
    ('platform: "torch_aoti"', "torch_aoti", "pytorch", "model.pt2"),
    ('platform: "tensorflow_savedmodel"', "tensorflow_savedmodel", "tensorflow", "model.savedmodel"),
    ('platform: "tensorflow_graphdef"', "tensorflow_graphdef", "tensorflow", "model.graphdef"),
    ('platform: "tensorrt_plan"', "tensorrt_plan", "tensorrt", "model.plan"),
    ('backend: "tensorrt"', "tensorrt_plan", "tensorrt", "model.plan"),
    ('backend: "openvino"', "", "openvino", "model.xml"),
    ('backend: "python"', "", "python", "model.py"),
    ('default_model_filename: "model.onnx"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ('default_model_filename: "model.savedmodel"', "tensorflow_savedmodel", "tensorflow",
     "model.savedmodel"),
    ('backend: "identity"', "", "identity", "model.identity"),
])
def test_infer_from_each_other(tmp_path, given, platform, backend, filename):
    cfg = complete(tmp_path, "m", given)  # no version folders at all
    assert (cfg.platform, cfg.backend, cfg.default_model_filename) == (platform, backend, filename)


def test_config_wins_over_files(tmp_path):
    cfg = complete(tmp_path, "m", 'backend: "python"', files={"1/model.onnx": ""})
    assert (cfg.backend, cfg.default_model_filename) == ("python", "model.py")


def test_ensemble_has_no_backend_or_instances(tmp_path):
    cfg = complete(tmp_path, "ens", 'platform: "ensemble"\nensemble_scheduling { step [ '
                   '{ model_name: "a" model_version: -1 input_map { key: "i" value: "x" } '
                   'output_map { key: "o" value: "y" } } ] }', files={"1": "dir"})
    assert (cfg.platform, cfg.backend, cfg.default_model_filename) == ("ensemble", "", "")
    assert len(cfg.instance_group) == 0
    assert not cfg.HasField("optimization")


def test_unknown_backend_without_files_errors(tmp_path):
    msg = expect_error(complete, tmp_path, "mystery", files={"1/weights.bin": ""})
    assert "'mystery'" in msg and "Could not determine backend" in msg


def test_custom_backend_from_model_name(tmp_path):
    cfg = complete(tmp_path, "m.identity")
    assert (cfg.backend, cfg.default_model_filename) == ("identity", "model.identity")


def test_defaults_version_policy_and_pinned_memory(tmp_path):
    cfg = complete(tmp_path, "m", files={"1/model.onnx": ""})
    assert cfg.version_policy.WhichOneof("policy_choice") == "latest"
    assert cfg.version_policy.latest.num_versions == 1
    assert cfg.optimization.input_pinned_memory.enable
    assert cfg.optimization.output_pinned_memory.enable
    kept = complete(tmp_path, "n", "version_policy { all {} }", files={"1/model.onnx": ""})
    assert kept.version_policy.WhichOneof("policy_choice") == "all"


@pytest.mark.parametrize("rel,kind,count", [
    ("1/model.onnx", "", 2), ("1/model.savedmodel", "dir", 2),
    ("1/model.pt", "", 1), ("1/model.py", "", 1), ("1/model.xml", "", 1), ("1/model.plan", "", 1),
])
def test_default_instance_group_cpu(tmp_path, rel, kind, count):
    cfg = complete(tmp_path, "m", files={rel: kind})
    assert len(cfg.instance_group) == 1
    g = cfg.instance_group[0]
    assert (g.name, g.kind, g.count, list(g.gpus)) == ("m", G.KIND_CPU, count, [])


def test_instance_group_gpu_when_available(tmp_path):
    cfg = complete(tmp_path, "m", files={"1/model.onnx": ""}, has_gpu=True)
    g = cfg.instance_group[0]
    assert (g.kind, g.count, list(g.gpus)) == (G.KIND_GPU, 1, [0])
    cfg = complete(tmp_path, "two", files={"1/model.pt": ""}, gpu_ids=[0, 1])
    assert list(cfg.instance_group[0].gpus) == [0, 1]
    # OpenVINO is CPU-only: KIND_AUTO stays on the CPU even with a GPU
    cfg = complete(tmp_path, "ov", files={"1/model.xml": ""}, has_gpu=True)
    assert cfg.instance_group[0].kind == G.KIND_CPU


def test_explicit_groups_named_and_counted(tmp_path):
    cfg = complete(tmp_path, "m", 'backend: "onnxruntime"\ninstance_group [ { kind: KIND_CPU }, '
                   '{ name: "mine" count: 4 kind: KIND_CPU }, { } ]')
    names = [(g.name, g.kind, g.count) for g in cfg.instance_group]
    assert names == [("m_0", G.KIND_CPU, 2), ("mine", G.KIND_CPU, 4), ("m_2", G.KIND_CPU, 2)]


def test_kind_gpu_without_gpu_errors(tmp_path):
    msg = expect_error(complete, tmp_path, "m", 'backend: "onnxruntime"\n'
                       'instance_group [ { kind: KIND_GPU } ]')
    assert msg == "instance group m_0 of model m has kind KIND_GPU but no GPUs are available"


def test_dynamic_batching_preferred_defaults_to_max_batch(tmp_path):
    cfg = complete(tmp_path, "m", 'backend: "onnxruntime"\nmax_batch_size: 8\ndynamic_batching {}')
    assert list(cfg.dynamic_batching.preferred_batch_size) == [8]
    cfg = complete(tmp_path, "n", 'backend: "onnxruntime"\nmax_batch_size: 8\n'
                   'dynamic_batching { preferred_batch_size: [2, 4] }')
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2, 4]


def test_sequence_idle_default(tmp_path):
    cfg = complete(tmp_path, "m", 'backend: "python"\nsequence_batching {}')
    assert cfg.sequence_batching.max_sequence_idle_microseconds == 1_000_000


def test_autocomplete_returns_a_copy(tmp_path):
    d = make_model(tmp_path, "m", None, {"1/model.onnx": ""})
    cfg = C.load_config(d)
    C.autocomplete(cfg, d, "m")
    assert cfg == mc.ModelConfig()


# ------------------------------------------------------------------------ complete_io
def onnx_cfg(text: str = "") -> mc.ModelConfig:
    cfg = C.parse_pbtxt('name: "m"\nbackend: "onnxruntime"\nplatform: "onnxruntime_onnx"\n' + text)
    return cfg


def test_complete_io_dynamic_batch_dim():
    cfg = C.complete_io(onnx_cfg(), [("x", "FP32", [-1, 3, 224, 224])], [("y", "BYTES", [-1])])
    assert cfg.max_batch_size == 4
    assert cfg.HasField("dynamic_batching")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4]
    x, y = cfg.input[0], cfg.output[0]
    assert (x.name, x.data_type, list(x.dims)) == ("x", mc.TYPE_FP32, [3, 224, 224])
    # a per-item scalar becomes dims [1] with an empty reshape
    assert (y.data_type, list(y.dims), y.HasField("reshape"), list(y.reshape.shape)) == \
        (mc.TYPE_STRING, [1], True, [])
    C.validate(cfg)


def test_complete_io_default_max_batch_and_existing_scheduler():
    cfg = C.complete_io(onnx_cfg("sequence_batching {}"), [("x", "FP32", [-1, 2])],
                        [("y", "FP32", [-1, 2])], default_max_batch_size=16)
    assert cfg.max_batch_size == 16
    assert cfg.WhichOneof("scheduling_choice") == "sequence_batching"
    one = C.complete_io(onnx_cfg(), [("x", "FP32", [-1])], [("y", "FP32", [-1])],
                        default_max_batch_size=1)
    assert one.max_batch_size == 1 and not one.HasField("dynamic_batching")


def test_complete_io_fixed_batch_dim():
    cfg = C.complete_io(onnx_cfg(), [("x", "INT64", [1, 5])], [("y", "FP32", [-1, 5])])
    assert cfg.max_batch_size == 0
    assert not cfg.HasField("dynamic_batching")
    assert list(cfg.input[0].dims) == [1, 5] and list(cfg.output[0].dims) == [-1, 5]


def test_complete_io_explicit_max_batch_strips_first_dim():
    cfg = C.complete_io(onnx_cfg("max_batch_size: 2"), [("x", "FP32", [-1, 7])], [("y", "FP32", [-1])])
    assert cfg.max_batch_size == 2
    assert list(cfg.input[0].dims) == [7]
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2]


def test_complete_io_nonbatchable_with_max_batch_errors():
    msg = expect_error(C.complete_io, onnx_cfg("max_batch_size: 8"), [("x", "FP32", [3])],
                       [("y", "FP32", [3])])
    assert msg == ("autofill failed for model 'm': model does not support batching while "
                   "non-zero max_batch_size is specified")


def test_complete_io_partial_config_filled():
    cfg = C.complete_io(onnx_cfg('input [ { name: "b" }, { name: "a" data_type: TYPE_INT32 } ]'),
                        [("a", "INT32", [-1, 2]), ("b", "FP16", [-1, 4, 4])],
                        [("out", "FP32", [-1, 1])])
    assert cfg.max_batch_size == 4
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == \
        [("b", mc.TYPE_FP16, [4, 4]), ("a", mc.TYPE_INT32, [2])]
    assert [o.name for o in cfg.output] == ["out"]


def test_complete_io_full_config_left_alone():
    text = ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]\n'
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]')
    cfg = C.complete_io(onnx_cfg(text), [("x", "FP32", [-1, 3])], [("y", "FP32", [-1, 3])])
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")


def test_complete_io_unknown_input_errors():
    msg = expect_error(C.complete_io, onnx_cfg('input [ { name: "nope" } ]'),
                       [("x", "FP32", [-1]), ("z", "FP32", [-1])], [("y", "FP32", [-1])])
    assert msg == "unexpected inference input 'nope', allowed inputs are: x, z"
    msg = expect_error(C.complete_io, onnx_cfg('output [ { name: "o2" } ]'),
                       [("x", "FP32", [-1])], [("y", "FP32", [-1])])
    assert "unexpected inference output 'o2'" in msg


def test_complete_io_datatype_mismatch_errors():
    msg = expect_error(C.complete_io,
                       onnx_cfg('input [ { name: "x" data_type: TYPE_INT32 dims: [ 3 ] } ]'),
                       [("x", "FP32", [3])], [("y", "FP32", [3])])
    assert msg == ("unable to load model 'm', configuration expects datatype TYPE_INT32 for "
                   "input 'x', model provides TYPE_FP32")


def test_complete_io_shape_mismatch_errors():
    msg = expect_error(C.complete_io, onnx_cfg(
        'max_batch_size: 4\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 5 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]'),
        [("x", "FP32", [-1, 3])], [("y", "FP32", [-1, 3])])
    assert "tensor 'x'" in msg and "[-1,3]" in msg and "[-1,5]" in msg


def test_complete_io_missing_model_input_errors():
    text = ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]')
    msg = expect_error(C.complete_io, onnx_cfg(text), [("x", "FP32", [3]), ("w", "FP32", [3])],
                       [("y", "FP32", [3])])
    assert msg == "unable to load model 'm', configuration expects 1 inputs, model provides 2"


# ---------------------------------------------------------------------------- validate
def valid_cfg(text: str = "") -> mc.ModelConfig:
    base = ('name: "m"\nbackend: "onnxruntime"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
            'version_policy { latest { num_versions: 1 } }\n'
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n')
    return C.parse_pbtxt(base + text)


def test_validate_ok():
    C.validate(valid_cfg("dynamic_batching { preferred_batch_size: [ 2, 4 ] }"))


@pytest.mark.parametrize("mutate,expected", [
    (lambda c: setattr(c, "max_batch_size", -1), "'max_batch_size' must be non-negative value for m"),
    (lambda c: c.dynamic_batching.preferred_batch_size.append(8),
     "dynamic batching preferred size must be <= max batch size for m"),
    (lambda c: c.input[0].ClearField("dims"), "model input 'x' must specify 'dims' for m"),
    (lambda c: setattr(c.output[0], "data_type", mc.TYPE_INVALID),
     "model output 'y' must specify 'data_type' for m"),
    (lambda c: c.input[0].dims.append(0),
     "model input 'x' dimension must be integer >= 1, or -1 to indicate a variable-size "
     "dimension for m"),
    (lambda c: c.input.add().CopyFrom(c.input[0]), "duplicate input name 'x' for m"),
    (lambda c: setattr(c, "platform", "tensorrt_plan"),
     "unexpected 'platform' and 'backend' pair, got:tensorrt_plan, onnxruntime"),
    (lambda c: c.ClearField("version_policy"), "must specify 'version policy' for m"),
    (lambda c: c.ClearField("output"), "model configuration for 'm' must specify at least one output"),
])
def test_validate_errors(mutate, expected):
    cfg = valid_cfg()
    mutate(cfg)
    assert expect_error(C.validate, cfg) == expected


def test_validate_allows_missing_io_before_worker_and_for_python():
    cfg = valid_cfg()
    cfg.ClearField("input")
    C.validate(cfg, require_io=False)
    py = C.parse_pbtxt('name: "p"\nbackend: "python"\nversion_policy { all {} }')
    C.validate(py)


def test_validate_ensemble_rules():
    cfg = C.parse_pbtxt('name: "e"\nplatform: "ensemble"\nversion_policy { all {} }\n'
                        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    assert expect_error(C.validate, cfg) == \
        "ensemble scheduling must be set for ensemble e whose platform is ensemble"


# -------------------------------------------------------------------------------- JSON
def test_config_to_json_int64_numbers_and_enum_names():
    cfg = valid_cfg('dynamic_batching { max_queue_delay_microseconds: 100 '
                    'default_queue_policy { default_timeout_microseconds: 7 } '
                    'priority_levels: 2 default_priority_level: 1 '
                    'priority_queue_policy { key: 2 value { default_timeout_microseconds: 9 } } }\n'
                    'model_warmup [ { name: "w" batch_size: 1 inputs { key: "x" value { '
                    'data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]')
    cfg.input[0].dims[:] = [-1, 3]
    cfg.version_policy.specific.versions[:] = [1, 3]
    j = C.config_to_json(cfg)
    json.dumps(j)  # plain JSON
    assert j["input"][0]["dims"] == [-1, 3]
    assert j["input"][0]["data_type"] == "TYPE_FP32"
    assert j["version_policy"]["specific"]["versions"] == [1, 3]
    db = j["dynamic_batching"]
    assert db["max_queue_delay_microseconds"] == 100
    assert db["priority_levels"] == 2 and db["default_priority_level"] == 1
    assert db["default_queue_policy"]["default_timeout_microseconds"] == 7
    assert db["default_queue_policy"]["timeout_action"] == "REJECT"
    assert db["priority_queue_policy"]["2"]["default_timeout_microseconds"] == 9
    assert j["model_warmup"][0]["inputs"]["x"]["dims"] == [3]
    # defaults are printed, with the proto field names
    assert j["max_batch_size"] == 4 and j["default_model_filename"] == ""
    assert j["input"][0]["is_shape_tensor"] is False and j["output"][0]["label_filename"] == ""
    assert j["batch_input"] == [] and j["instance_group"] == []


def test_config_to_json_instance_groups_and_sequence(tmp_path):
    cfg = complete(tmp_path, "m", 'backend: "onnxruntime"\nsequence_batching { }')
    j = C.config_to_json(cfg)
    assert j["instance_group"][0]["kind"] == "KIND_CPU"
    assert j["instance_group"][0]["count"] == 2
    assert j["sequence_batching"]["max_sequence_idle_microseconds"] == 1_000_000
    assert j["optimization"]["input_pinned_memory"] == {"enable": True}


def test_config_json_roundtrip_and_errors():
    cfg = valid_cfg("dynamic_batching { max_queue_delay_microseconds: 5 }")
    j = C.config_to_json(cfg)
    assert C.config_from_json(j) == cfg
    assert C.config_from_json(json.dumps(j)) == cfg
    assert C.config_from_json('{"max_batch_size": 3, "input": [{"dims": ["2", 4]}]}').input[0].dims == [2, 4]
    assert "failed to parse" in expect_error(C.config_from_json, '{"no_such_field": 1}')
    expect_error(C.config_from_json, "{not json")
    expect_error(C.config_from_json, "[]")


def test_empty_config_json_is_empty():
    assert C.config_to_json(mc.ModelConfig()) == {}


def test_input_shape():
    inp = C.parse_pbtxt('input [ { name: "x" dims: [ 3, 4 ] reshape { shape: [ 12 ] } } ]').input[0]
    assert C.input_shape(inp, 8) == [-1, 3, 4]
    assert C.input_shape(inp, 0) == [3, 4]
