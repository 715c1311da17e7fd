"""A canary split over a model's loaded versions (services/common/canary.py): requests that
name no version go to versions 1 and 2 by the config's weights, sticky by a request parameter
when the config names one (a forwarded header arrives as one), and each answer says which
version gave it; a request naming a version gets it; a split that cannot be read fails the
load with its reason.

Model `split` (Python, FP32 [1]): two versions whose model.py answer OUT = their version;
version_policy all; weights 1:1, 2:3; sticky parameter "user". Model `badsplit`: weights
that are not numbers.
"""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from tritonclient.utils import InferenceServerException

from tests.models_python import io_config

SOURCE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([{v}.0], np.float32))])
                for r in requests]
'''
IO = [("IN", "TYPE_FP32", "[ 1 ]")], [("OUT", "TYPE_FP32", "[ 1 ]")]


def _model(root: Path, name: str, split: str, sticky: str = "") -> None:
    params = f'parameters {{ key: "trireme.version_split" value {{ string_value: "{split}" }} }}\n'
    if sticky:
        params += f'parameters {{ key: "trireme.sticky_parameter" value {{ string_value: "{sticky}" }} }}\n'
    (root / name).mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        io_config(name, *IO, extra="version_policy: { all { } }\n" + params))
    for v in (1, 2):
        (root / name / str(v)).mkdir()
        (root / name / str(v) / "model.py").write_text(SOURCE.format(v=v))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("canary") / "models"
    _model(root, "split", "1:1,2:3", sticky="user")
    _model(root, "badsplit", "1:one,2:two")
    with start_server(root, "--exit-on-error", "false", ready=False) as srv:
        c = httpclient.InferenceServerClient(srv.http_url)
        try:   # (badsplit keeps strict readiness false: wait for the models themselves)
            wait_until(lambda: c.is_model_ready("split") and {
                e["name"]: e.get("state") for e in c.get_model_repository_index()
            }.get("badsplit") == "UNAVAILABLE", 60, "the models to load or fail")
        finally:
            c.close()
        yield srv


def ask(c, module, version: str = "", user: str | None = None) -> tuple[float, str]:
    """(the answer's OUT, the response's model_version)."""
    inp = module.InferInput("IN", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, np.float32))
    params = {"user": user} if user is not None else None
    res = c.infer("split", [inp], model_version=version, parameters=params)
    version_said = res.get_response()["model_version"] if module is httpclient else \
        res.get_response().model_version
    return float(res.as_numpy("OUT")[0]), version_said


def test_requests_naming_no_version_follow_the_weights(server):
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        got = collections.Counter()
        for _ in range(400):
            out, said = ask(c, httpclient)
            assert said == str(int(out)), (out, said)   # the answer says who gave it
            got[said] += 1
        # 1:3 of 400: 100 and 300 expected, 5 standard deviations (~43) allowed
        assert set(got) == {"1", "2"} and abs(got["1"] - 100) < 45, got
        for version in ("1", "2"):   # named: that version, every time
            assert {ask(c, httpclient, version)[1] for _ in range(20)} == {version}
    finally:
        c.close()


def test_a_sticky_parameter_keeps_each_user_on_one_version(server):
    h = httpclient.InferenceServerClient(server.http_url)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        where = {}
        for i in range(40):
            user = f"user-{i}"
            seen = {ask(h, httpclient, user=user)[1] for _ in range(5)}
            seen |= {ask(g, grpcclient, user=user)[1] for _ in range(5)}
            assert len(seen) == 1, (user, seen)   # the same version over both protocols
            where[user] = seen.pop()
        assert set(where.values()) == {"1", "2"}, where
    finally:
        h.close()
        g.close()


def test_a_split_that_cannot_be_read_fails_the_load(server):
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        (entry,) = [e for e in c.get_model_repository_index() if e["name"] == "badsplit"]
        assert entry["state"] == "UNAVAILABLE"
        assert "parameter 'trireme.version_split' of badsplit must be '<version>:<weight>,...'" \
            in entry["reason"] and "got '1:one,2:two'" in entry["reason"], entry
        with pytest.raises(InferenceServerException):
            c.infer("badsplit", [])
    finally:
        c.close()
