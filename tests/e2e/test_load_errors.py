"""Failed explicit loads answer in Triton's words (core ModelRepositoryManager::
LoadUnloadModels over ModelLifeCycle::OnLoadComplete), checked against Triton 2.51:

    load failed for model '<m>': version <v> is at UNAVAILABLE state: <Code>: <why>;\\n

for a version that failed (its instances, its label file), `load failed for model '<m>':
<why>\\n` for the model as a whole (no version under its policy, an ensemble's steps); 400 /
INVALID_ARGUMENT. The repository index keeps the bare reason."""
from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server
from tests.models_python import io_config, python_model

IO = ([("IN", "TYPE_INT32", "[ 1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")])
PASS = '''
class TritonPythonModel:
    def execute(self, requests):
        return []
'''
RAISES = '''
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("boom at init")

    def execute(self, requests):
        return []
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_errors") / "models"
    python_model(root, "bad_label", PASS, io_config("bad_label", *IO).replace(
        "dims: [ 1 ] }\n]\ninstance", 'dims: [ 1 ] label_filename: "missing.txt" }\n]\ninstance'))
    python_model(root, "init_raises", RAISES, io_config("init_raises", *IO))
    models.write_config(root / "no_version", io_config("no_version", *IO))
    models.write_config(root / "ens_missing", (
        'name: "ens_missing"\nplatform: "ensemble"\nmax_batch_size: 0\n'
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "ghost" model_version: -1 '
        'input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }\n'))
    (root / "ens_missing" / "1").mkdir()
    return root


def test_failed_explicit_loads_answer_in_tritons_words(repo):
    labels = f"failed to open text file for read {repo / 'bad_label' / 'missing.txt'}: " \
             "No such file or directory"
    init = ("initialize of model 'init_raises' failed: ValueError: boom at init\n\nAt:\n"
            f"  {repo / 'init_raises' / '1' / 'model.py'}(3): initialize\n")
    no_version = "at least one version must be available under the version policy of model " \
                 "'no_version'"
    ensemble = "ensemble ens_missing contains models that are not available or ambiguous: ghost"
    want = {   # model -> (the load's answer, the index's reason)
        "bad_label": ("load failed for model 'bad_label': version 1 is at UNAVAILABLE state: "
                      f"Internal: {labels};\n", labels),
        "init_raises": ("load failed for model 'init_raises': version 1 is at UNAVAILABLE "
                        f"state: Invalid argument: {init};\n", init),
        "no_version": (f"load failed for model 'no_version': {no_version}\n", no_version),
        "ens_missing": (f"load failed for model 'ens_missing': {ensemble}\n", ensemble),
    }
    with start_server(repo, "--model-control-mode", "explicit") as srv:
        http = httpclient.InferenceServerClient(srv.http_url)
        grpc = grpcclient.InferenceServerClient(srv.grpc_url)
        try:
            for client, status in ((http, "400"), (grpc, "StatusCode.INVALID_ARGUMENT")):
                for name, (text, _) in want.items():
                    with pytest.raises(InferenceServerException) as e:
                        client.load_model(name)
                    assert (e.value.status(), e.value.message()) == (status, text), name
            reasons = {m["name"]: m.get("reason") for m in http.get_model_repository_index()}
            assert reasons == {name: reason for name, (_, reason) in want.items()}
            # the poll failures keep their own words (Triton 2.51: 500, not wrapped)
            with pytest.raises(InferenceServerException) as e:
                http.load_model("nope")
            assert (e.value.status(), e.value.message()) == (
                "500", "failed to load 'nope', failed to poll from model repository")
        finally:
            http.close()
            grpc.close()
