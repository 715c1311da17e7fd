"""--rate-limit execution_count end to end: a model whose instances need more of a resource
than --rate-limit-resource gives fails to load with Triton's text (rate_limiter.cc
ParseAndValidateExplicitResources), through the load API and in the repository index;
the limiter off, the same model loads. `R:n:-1` gives n on every device, like `R:n`."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server, wait_until

LIMITED = ('failed to load \'{}\' version 1: Resource count for "{}" is limited to {} which '
           'will prevent scheduling of one or more model instances, the minimum required '
           'count is {}')


def needing(root, name: str, resources: str) -> None:
    models.add_sub(root / name)
    models.write_config(root / name, (
        "max_batch_size: 8\n"
        f"instance_group [{{ kind: KIND_CPU, count: 1, rate_limiter {{ resources [{resources}] }} }}]\n"
        'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("rate_limit") / "models"
    needing(root, "fits", '{ name: "R", count: 1 }')
    needing(root, "too_many", '{ name: "R", count: 2 }')
    needing(root, "unnamed", '{ name: "T", count: 1 }')
    needing(root, "every_device", '{ name: "S", count: 2 }')
    return root


def infer(client, model: str) -> np.ndarray:
    lib = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    x = np.ones((1, 16), np.float32)
    ins = [lib.InferInput("INPUT0", [1, 16], "FP32"), lib.InferInput("INPUT1", [1, 16], "FP32")]
    for i in ins:
        i.set_data_from_numpy(x)
    return client.infer(model, ins).as_numpy("OUTPUT0")


def index(client) -> dict[str, dict]:
    return {e["name"]: e for e in client.get_model_repository_index()}


def test_load_fails_when_an_instance_needs_more_than_the_server_has(repo):
    with start_server(repo, "--model-control-mode", "explicit", "--load-model", "fits",
                      "--load-model", "every_device", "--rate-limit", "execution_count",
                      "--rate-limit-resource", "R:1", "--rate-limit-resource", "S:2:-1") as srv:
        http = httpclient.InferenceServerClient(srv.http_url)
        grpc = grpcclient.InferenceServerClient(srv.grpc_url)
        assert http.is_model_ready("fits") and http.is_model_ready("every_device")
        np.testing.assert_array_equal(infer(http, "every_device"), np.full((1, 16), 2.0))
        for client, name, want in ((http, "too_many", LIMITED.format("too_many", "R", 1, 2)),
                                   (grpc, "unnamed", LIMITED.format("unnamed", "T", 0, 1))):
            with pytest.raises(InferenceServerException) as e:
                client.load_model(name)
            assert e.value.message() == (f"load failed for model '{name}': version 1 is at "
                                         f"UNAVAILABLE state: Invalid argument: "
                                         f"{want.split(': ', 1)[1]};\n")   # Triton 2.51's words
            assert index(http)[name]["state"] == "UNAVAILABLE"
            assert index(http)[name]["reason"] == want
            assert not http.is_model_ready(name)
        # The models that fit still serve.
        np.testing.assert_array_equal(infer(grpc, "fits"), np.full((1, 16), 2.0))
        http.close()
        grpc.close()


def test_without_the_limiter_resources_do_not_stop_a_load(repo):
    with start_server(repo, "--model-control-mode", "explicit", "--load-model", "too_many",
                      "--rate-limit-resource", "R:1") as srv:
        http = httpclient.InferenceServerClient(srv.http_url)
        wait_until(lambda: http.is_model_ready("too_many"), 30, "too_many to load")
        np.testing.assert_array_equal(infer(http, "too_many"), np.full((1, 16), 2.0))
        http.close()
