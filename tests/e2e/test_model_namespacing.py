"""--model-namespacing: the same model name in two repositories, answered as Triton answers
(core model_repository_manager.cc; qa/L0_model_namespacing): both are served, the index
lists both, an ensemble's step uses its own repository's model, and a name that more than
one repository's loaded model has is ambiguous."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from models import write_config
from models_python import io_config, python_model
from tritonclient.utils import InferenceServerException

# Y = X + offset: which repository's model answered
OFFSET = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + {offset})])
            for r in requests]
'''
X = np.arange(4, dtype=np.float32)
AMBIGUOUS = ("There are 2 identifiers of model '{}' in global map, model namespace must be "
             "provided to resolve ambiguity.")
CLIENTS = {"http": httpclient, "grpc": grpcclient}


def offset_model(root, name: str, offset: int) -> None:
    python_model(root, name, OFFSET.format(offset=offset), io_config(
        name, [("X", "TYPE_FP32", "[ 4 ]")], [("Y", "TYPE_FP32", "[ 4 ]")]))


def ensemble_of(root, name: str, step: str) -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    write_config(root / name, f'''name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1
  input_map {{ key: "X" value: "X" }} output_map {{ key: "Y" value: "Y" }} }} ] }}
''')


def repositories(root):
    """a/: shared (+1), ens_a and ens (step: shared); b/: shared (+2), ens_b and ens."""
    a, b = root / "a", root / "b"
    for repo, offset in ((a, 1), (b, 2)):
        offset_model(repo, "shared", offset)
        ensemble_of(repo, "ens", "shared")
    ensemble_of(a, "ens_a", "shared")
    ensemble_of(b, "ens_b", "shared")
    return a, b


def client(srv, protocol: str):
    return CLIENTS[protocol].InferenceServerClient(
        srv.http_url if protocol == "http" else srv.grpc_url)


def infer(c, protocol: str, model: str) -> np.ndarray:
    inp = CLIENTS[protocol].InferInput("X", [4], "FP32")
    inp.set_data_from_numpy(X)
    return c.infer(model, [inp]).as_numpy("Y")


def index(c, protocol: str) -> list[tuple[str, str, str, str]]:
    rows = c.get_model_repository_index() if protocol == "http" else \
        c.get_model_repository_index(as_json=True).get("models", [])
    return [(r["name"], r.get("version", ""), r.get("state", ""), r.get("reason", ""))
            for r in rows]


def assert_error(protocol: str, e: InferenceServerException, text: str) -> None:
    assert e.message().removeprefix("[StatusCode.INVALID_ARGUMENT] ") == text
    assert e.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")


def start(tmp_path, *extra: str, ready: bool = True):
    a, b = repositories(tmp_path)
    return start_server(a, "--model-repository", str(b), "--model-namespacing=true", *extra,
                        ready=ready)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start(tmp_path_factory.mktemp("namespacing")) as srv:
        yield srv


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_both_served_and_listed(server, protocol):
    c = client(server, protocol)
    # Triton's order: by repository, then name; the same name once per repository
    assert index(c, protocol) == [(n, "1", "READY", "") for n in
                                  ("ens", "ens_a", "shared", "ens", "ens_b", "shared")]
    # each ensemble runs its own repository's `shared`
    assert infer(c, protocol, "ens_a").tolist() == (X + 1).tolist()
    assert infer(c, protocol, "ens_b").tolist() == (X + 2).tolist()
    assert c.is_model_ready("ens_a")
    if protocol == "http":   # Triton's config says where the step was found
        a = server.repo.resolve()
        step = c.get_model_config("ens_a")["ensemble_scheduling"]["step"][0]
        assert (step["model_name"], step["model_namespace"]) == ("shared", str(a))
    c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("name", ["shared", "ens"])
def test_a_name_in_two_repositories_is_ambiguous(server, protocol, name):
    c = client(server, protocol)
    for call in (lambda: infer(c, protocol, name), lambda: c.get_model_metadata(name),
                 lambda: c.get_model_config(name)):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert_error(protocol, e.value, AMBIGUOUS.format(name))
    assert not c.is_model_ready(name)
    with pytest.raises(InferenceServerException) as e:
        c.get_inference_statistics(name)
    assert_error(protocol, e.value, f"requested model '{name}' is not available")
    c.close()


def test_statistics_and_metrics_keep_the_two_apart(server):
    import urllib.request
    c = client(server, "http")

    def successes():
        """By repository, then name: a's ens, ens_a, shared, then b's ens, ens_b, shared."""
        return [(s["name"], s["inference_stats"]["success"]["count"])
                for s in c.get_inference_statistics()["model_stats"]]

    def metric(repo):   # Triton's namespace label: the repository
        text = urllib.request.urlopen(server.metrics_url).read().decode()
        series = f'nv_inference_request_success{{model="shared",namespace="{repo}",version="1"}} '
        return int(next(ln for ln in text.splitlines() if ln.startswith(series)).split()[-1])

    a, b = (server.repo.parent.resolve() / r for r in ("a", "b"))
    before, metrics_before = successes(), (metric(a), metric(b))
    for _ in range(2):
        infer(c, "http", "ens_a")
    infer(c, "http", "ens_b")
    after = successes()
    assert [n for n, _ in after] == ["ens", "ens_a", "shared", "ens", "ens_b", "shared"]
    assert [y - x for (_, x), (_, y) in zip(before, after)] == [0, 2, 2, 0, 1, 1]
    assert (metric(a), metric(b)) == (metrics_before[0] + 2, metrics_before[1] + 1)
    assert c.get_inference_statistics("ens_a")["model_stats"][0]["name"] == "ens_a"
    c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_explicit_load_and_unload(tmp_path, protocol):
    """Triton's explicit-mode test_dynamic_resolution, plus unload."""
    with start(tmp_path, "--model-control-mode=explicit") as srv:
        c = client(srv, protocol)
        with pytest.raises(InferenceServerException) as e:   # (Triton: INVALID_ARG here)
            infer(c, protocol, "shared")
        assert_error(protocol, e.value, "Request for unknown model: 'shared' is not found")
        # with a's `shared` away, ens_a's step finds b's, the only one: the name resolves
        moved = tmp_path / "shared_moved"
        shutil.move(tmp_path / "a" / "shared", moved)
        c.load_model("ens_a")
        assert infer(c, protocol, "ens_a").tolist() == (X + 2).tolist()
        assert infer(c, protocol, "shared").tolist() == (X + 2).tolist()
        # back again, a reload of ens_a loads a's and uses it; `shared` is now ambiguous
        shutil.move(moved, tmp_path / "a" / "shared")
        c.load_model("ens_a")
        assert infer(c, protocol, "ens_a").tolist() == (X + 1).tolist()
        assert [r for r in index(c, protocol) if r[0] == "shared"] == [("shared", "1", "READY", "")] * 2
        with pytest.raises(InferenceServerException) as e:
            infer(c, protocol, "shared")
        assert_error(protocol, e.value, AMBIGUOUS.format("shared"))
        # a load by name loads it from every repository (and an ensemble its step's name)
        c.load_model("ens")
        assert [r[:3] for r in index(c, protocol) if r[0] == "ens"] == [("ens", "1", "READY")] * 2
        with pytest.raises(InferenceServerException) as e:
            infer(c, protocol, "ens")
        assert_error(protocol, e.value, AMBIGUOUS.format("ens"))
        # an unload by name unloads it from every repository
        c.unload_model("shared")
        wait_until(lambda: [r for r in index(c, protocol) if r[0] == "shared"] ==
                   [("shared", "1", "UNAVAILABLE", "unloaded")] * 2, 30, "both to unload")
        assert not c.is_model_ready("shared")
        c.close()


def test_poll_follows_a_model_that_moves(tmp_path):
    """Triton's test_dynamic_resolution: with a's `shared` gone, ens_a runs b's and the name
    resolves; back again, ens_a runs a's and the name is ambiguous again."""
    with start(tmp_path, "--model-control-mode=poll", "--repository-poll-secs=0.3") as srv:
        c = client(srv, "http")
        moved = tmp_path / "shared_moved"
        shutil.move(tmp_path / "a" / "shared", moved)
        wait_until(lambda: [r[0] for r in index(c, "http")].count("shared") == 1, 30,
                   "a's shared to go")
        assert infer(c, "http", "ens_a").tolist() == (X + 2).tolist()
        assert infer(c, "http", "shared").tolist() == (X + 2).tolist()
        shutil.move(moved, tmp_path / "a" / "shared")
        wait_until(lambda: [r for r in index(c, "http") if r[0] == "shared"] ==
                   [("shared", "1", "READY", "")] * 2, 30, "a's shared to come back")
        assert infer(c, "http", "ens_a").tolist() == (X + 1).tolist()
        with pytest.raises(InferenceServerException) as e:
            infer(c, "http", "shared")
        assert_error("http", e.value, AMBIGUOUS.format("shared"))
        c.close()
