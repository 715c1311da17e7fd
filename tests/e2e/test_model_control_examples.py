"""Triton's example clients simple_http_model_control.py and simple_grpc_model_control.py:
the requests they send and the answers they check, step for step, against a repository
like Triton's docs/examples/model_repository in explicit mode ('simple' and other models,
none loaded at start)."""
from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server
from models import add_sub, identity, write_config
from tritonclient.utils import InferenceServerException

BAD_CONFIG = '"parameters": {"config": {{"max_batch_size": "16"}}}'


def _repository(root, models: int):
    """'simple' and models - 1 others: the example counts the repository's models."""
    add_sub(root / "simple", dtype="int32")
    write_config(root / "simple", 'name: "simple"\nplatform: "onnxruntime_onnx"\n'
                 'max_batch_size: 8\n')
    for i in range(models - 1):
        identity(root / f"other_{i}", "fp32")
    return root


def _failed(fn, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn(*args, **kwargs)
    return e.value


@pytest.mark.parametrize("mod,models", [(httpclient, 7), (grpcclient, 8)])
def test_model_control_example(tmp_path, mod, models):
    repo = _repository(tmp_path / "models", models)
    with start_server(repo, "--model-control-mode", "explicit") as srv:
        c = mod.InferenceServerClient(srv.http_url if mod is httpclient else srv.grpc_url)
        index = c.get_model_repository_index()
        assert len(index if mod is httpclient else index.models) == models

        c.load_model("simple")
        assert c.is_model_ready("simple")

        # the config override sent in the wrong format
        assert "failed to load" in _failed(c.load_model, "simple", config=BAD_CONFIG).message()

        c.load_model("simple", config='{"max_batch_size":"16"}')
        cfg = c.get_model_config("simple")
        assert (cfg["max_batch_size"] if mod is httpclient else cfg.config.max_batch_size) == 16

        c.unload_model("simple")
        assert not c.is_model_ready("simple")

        if mod is grpcclient:   # a path component longer than NAME_MAX: refused, server lives
            e = _failed(c.load_model, "simple", config="{}", files={"file:" + "A" * 256: b"a"})
            assert e.status() == "StatusCode.INTERNAL"
            assert "failed to poll from model repository" in e.message()
            assert c.is_server_live()

        assert "failed to load" in _failed(c.load_model, "wrong_model_name").message()
        c.close()
