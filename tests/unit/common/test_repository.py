"""services.common.repository: scan, versions, policies, files, labels, fingerprint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protos import model_config_pb2 as mc
from services.common import repository as R
from services.common.config import parse_pbtxt
from services.common.errors import Code, TriremeError


def mkdirs(root: Path, *rels: str) -> None:
    for rel in rels:
        (root / rel).mkdir(parents=True, exist_ok=True)


def cfg(text: str = "") -> mc.ModelConfig:
    return parse_pbtxt('name: "m"\n' + text)


def expect_error(fn, *args, **kw) -> str:
    with pytest.raises(TriremeError) as ei:
        fn(*args, **kw)
    assert ei.value.code == Code.INVALID_ARG
    return str(ei.value)


# ------------------------------------------------------------------------------- scan
def test_scan_models_skips_hidden_and_files(tmp_path):
    repo = tmp_path / "repo"
    mkdirs(repo, "a/1", "b", ".git", ".ipynb_checkpoints")
    (repo / "README.md").write_text("not a model")
    models, dups = R.scan([repo])
    assert sorted(models) == ["a", "b"]
    assert models["a"] == R.ModelSource("a", repo / "a")
    assert dups == {}


def test_scan_duplicate_across_repositories(tmp_path):
    r1, r2, r3 = tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"
    mkdirs(r1, "shared", "only1")
    mkdirs(r2, "shared", "only2")
    mkdirs(r3, "shared")
    models, dups = R.scan([r1, r2, r3])
    assert sorted(models) == ["only1", "only2"]
    assert dups == {"shared": "model appears in two or more repositories"}
    assert R.scan([r1, r1])[1] == {}   # the same repository twice is one (Triton: a set)


def test_scan_namespacing_keys_each_repository_apart(tmp_path):
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    mkdirs(r1, "shared", "only1")
    mkdirs(r2, "shared")
    models, dups = R.scan([r1, r2], namespacing=True)
    assert dups == {}
    assert sorted(models) == [f"{r1}::only1", f"{r1}::shared", f"{r2}::shared"]
    src = models[f"{r2}::shared"]
    assert (src.name, src.namespace, src.path, src.key) == ("shared", str(r2), r2 / "shared",
                                                            f"{r2}::shared")


def test_scan_missing_repository(tmp_path):
    missing = tmp_path / "nope"
    assert expect_error(R.scan, [missing]) == f"failed to stat file {missing}"
    f = tmp_path / "file"
    f.write_text("")
    assert expect_error(R.scan, [f]) == f"failed to open directory {f}"


# --------------------------------------------------------------------------- versions
def test_available_versions_rules(tmp_path):
    m = tmp_path / "m"
    mkdirs(m, "1", "2", "10", "0", "007", "01", "abc", "1a", "-3", "warmup", "initial_state",
           "configs")
    (m / "3").write_text("a file, not a folder")
    assert R.available_versions(m) == [0, 1, 2, 10]
    assert R.available_versions(tmp_path / "absent") == []


def test_select_latest_default_and_n():
    have = [1, 2, 3, 10]
    assert R.select_versions(cfg(), have) == [10]
    assert R.select_versions(cfg("version_policy { latest { num_versions: 2 } }"), have) == [3, 10]
    assert R.select_versions(cfg("version_policy { latest { num_versions: 9 } }"), have) == have


def test_select_all_and_specific():
    have = [1, 2, 3]
    assert R.select_versions(cfg("version_policy { all { } }"), have) == [1, 2, 3]
    spec = cfg("version_policy { specific { versions: [ 3, 1, 7 ] } }")
    assert R.select_versions(spec, have) == [1, 3]  # 7 has no folder: skipped


@pytest.mark.parametrize("policy,have", [
    ("", []),
    ("version_policy { all { } }", []),
    ("version_policy { specific { versions: [ 4 ] } }", [1, 2]),
    ("version_policy { latest { num_versions: 0 } }", [1]),
])
def test_select_nothing_left_errors(policy, have):
    msg = expect_error(R.select_versions, cfg(policy), have)
    assert msg == "at least one version must be available under the version policy of model 'm'"


# ------------------------------------------------------------------------- model_file
def test_model_file(tmp_path):
    m = tmp_path / "m"
    mkdirs(m, "1", "2/model.onnx")
    (m / "1" / "model.onnx").write_bytes(b"x")
    (m / "2" / "model.onnx" / "model.onnx").write_bytes(b"x")
    c = cfg('backend: "onnxruntime"\ndefault_model_filename: "model.onnx"')
    assert R.model_file(c, m, 1) == m / "1" / "model.onnx"
    assert R.model_file(c, m, 2) == m / "2" / "model.onnx" / "model.onnx"
    msg = expect_error(R.model_file, c, m, 3)
    assert msg == f"unable to find '{m / '3' / 'model.onnx'}' for model 'm'"


def test_model_file_cc_and_custom_default(tmp_path):
    m = tmp_path / "m"
    mkdirs(m, "1")
    (m / "1" / "model.plan").write_bytes(b"x")
    (m / "1" / "model_sm90.plan").write_bytes(b"x")
    c = cfg('backend: "tensorrt"\ndefault_model_filename: "model.plan"\n'
            'cc_model_filenames { key: "9.0" value: "model_sm90.plan" }')
    assert R.model_file(c, m, 1, cc="9.0").name == "model_sm90.plan"
    assert R.model_file(c, m, 1, cc="8.0").name == "model.plan"
    (m / "1" / "model.identity").write_bytes(b"x")
    assert R.model_file(cfg('backend: "identity"'), m, 1).name == "model.identity"


# ----------------------------------------------------------------------------- labels
def test_read_labels(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "labels.txt").write_text("cat\r\ndog\n\nbird\n")
    c = cfg('output [ { name: "prob" label_filename: "labels.txt" }, { name: "other" } ]')
    assert R.read_labels(m, c) == {"prob": ["cat", "dog", "", "bird"]}
    bad = cfg('output [ { name: "p" label_filename: "missing.txt" } ]')
    with pytest.raises(TriremeError) as ei:   # Triton's code: "Internal: failed to open ..."
        R.read_labels(m, bad)
    assert ei.value.code == Code.INTERNAL and "missing.txt" in ei.value.message


# ------------------------------------------------------------------------ fingerprint
def test_fingerprint_detects_changes(tmp_path):
    m = tmp_path / "m"
    mkdirs(m, "1")
    f = m / "1" / "model.onnx"
    f.write_bytes(b"abc")
    (m / "config.pbtxt").write_text('backend: "onnxruntime"')
    fp = R.fingerprint(m)
    assert fp and fp == R.fingerprint(m)
    f.write_bytes(b"abcd")  # size change
    fp2 = R.fingerprint(m)
    assert fp2 != fp
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # mtime only
    fp3 = R.fingerprint(m)
    assert fp3 != fp2
    mkdirs(m, "2")  # new version folder
    assert R.fingerprint(m) != fp3
    assert R.fingerprint(tmp_path / "gone") == ""
