"""--model-control-mode poll: the repository is rescanned and the served set follows it."""
from __future__ import annotations

import shutil

import models
import numpy as np
import pytest
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from tritonclient.utils import InferenceServerException

CONFIG = 'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'


def _infer_offset(client, model: str) -> float:
    a = np.zeros((1, 16), np.float32)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"),
              httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    return float(client.infer(model, inputs).as_numpy("OUTPUT0")[0, 0])


def test_poll_adds_updates_and_removes_models(tmp_path):
    repo = tmp_path / "models"
    models.add_sub(repo / "first", versions=(1,), offset_per_version=True)
    models.write_config(repo / "first", CONFIG)
    with start_server(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3") as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        assert client.is_model_ready("first")

        # A new model folder is picked up.
        models.add_sub(repo / "second")
        models.write_config(repo / "second", CONFIG)
        wait_until(lambda: client.is_model_ready("second"), 30, "the new model to load")

        # A new version replaces the old one under latest{1}.
        models.add_sub(repo / "first", versions=(2,), offset_per_version=True)
        wait_until(lambda: client.is_model_ready("first", "2"), 30, "version 2 to load")
        assert _infer_offset(client, "first") == 1.0

        # A broken update keeps the old model serving.
        (repo / "first" / "config.pbtxt").write_text("max_batch_size: [not valid")
        wait_until(lambda: "poll: 'first' failed to load" in srv.log(), 30, "the reload to fail")
        assert client.is_model_ready("first", "2")
        assert _infer_offset(client, "first") == 1.0

        # A removed folder is unloaded.
        shutil.rmtree(repo / "second")
        wait_until(lambda: not client.is_model_ready("second"), 30, "the removed model to unload")
        with pytest.raises(InferenceServerException) as e:
            _infer_offset(client, "second")
        assert "second" in str(e.value)

        # Explicit load/unload is refused while polling.
        with pytest.raises(InferenceServerException) as e:
            client.load_model("first")
        assert "explicit model load / unload is not allowed if polling is enabled" in str(e.value)
