"""BYTES elements that are not UTF-8 (some ending in NULs) through a Python identity model:
the 8 elements of Triton's qa/L0_string_io/string_client_test.py (test_unicode_bytes),
with the official tritonclient.

gRPC and HTTP binary data carry them unchanged, whatever numpy dtype the client started
from. Asked for as JSON, such an output cannot be carried: Triton 2.51 writes the bytes
into the JSON string as they are (a body the client then fails to read, "Failed to encode
using UTF-8"), Trireme answers 400 naming the output (docs/compat.md). Before, Trireme
answered 200 with U+FFFD in place of the bad bytes, and the QA test failed: it expects an
error there.
"""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server
from models_python import io_config, python_model
from tritonclient.utils import InferenceServerException

# qa/python_models/string_identity/model.py
STRING_IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", in_0.as_numpy())
            responses.append(pb_utils.InferenceResponse([out_tensor_0]))
        return responses
'''

ELEMENTS = [
    b"\nF\n'\n\x01a\x12\"\x1a \n\x1e\xfa\x03\x94\x01\x0f\xd7\x02\xf1\x05\xdf\x01\x82\x03\xb5\x05\xc1\x07\xba\x06\xff\x06\xc7\x07L\xf5\x03\xe2\x07\xa9\x03\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x89\xcc=\n\r\n\x01c\x12\x08\x12\x06\n\x04\xdf\\\xcb\xbf",  # noqa: E501
    b"\n:\n\x1a\n\x01a\x12\x15\x1a\x13\n\x11*\xe3\x05\xc5\x06\xda\x07\xcb\x06~\xb1\x05\xb3\x01\xa9\x02\x15\n\r\n\x01b\x12\x08\x1a\x06\n\x04\xf6\xa2\xc5\x01\n\r\n\x01c\x12\x08\x12\x06\n\x04\xbb[\n\xbf",
    b"\nL\n-\n\x01a\x12(\x1a&\n$\x87\x07\xce\x01\xe7\x06\xee\x04\xe1\x03\xf1\x03\xd7\x07\xbe\x02\xb8\x05\xe0\x05\xe4\x01\x88\x06\xb6\x03\xb9\x05\x83\x06\xf8\x04\xe2\x04\xf4\x06\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x89\xcc=\n\r\n\x01c\x12\x08\x12\x06\n\x04\xbc\x99+@",
    b"\n2\n\x12\n\x01a\x12\r\x1a\x0b\n\t\x99\x02\xde\x04\x9f\x04\xc5\x053\n\r\n\x01b\x12\x08\x1a\x06\n\x04\xf6\xa2\xc5\x01\n\r\n\x01c\x12\x08\x12\x06\n\x04\x12\x07\x83\xbe",
    b"\nJ\n\r\n\x01b\x12\x08\x1a\x06\n\x04\x9b\x94\xad\x04\n\r\n\x01c\x12\x08\x12\x06\n\x04\xc3\x8a\x08\xbf\n*\n\x01a\x12%\x1a#\n!\x9c\x02\xb2\x02\xcd\x02\x9d\x07\x8d\x01\xb6\x05a\xf1\x01\xf0\x05\xdb\x02\xac\x04\xbd\x05\xe0\x04\xd2\x06\xaf\x02\xa8\x01\x8b\x04",
    b"\n3\n\x13\n\x01a\x12\x0e\x1a\x0c\n\n<\xe2\x05\x8a\x01\xb3\x07?\xfd\x01\n\r\n\x01b\x12\x08\x1a\x06\n\x04\xf6\xa2\xc5\x01\n\r\n\x01c\x12\x08\x12\x06\n\x04\x1b\x931\xbf\x00\x00",
    b"\n&\n\x07\n\x01a\x12\x02\x1a\x00\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x89\xcc=\n\r\n\x01c\x12\x08\x12\x06\n\x04{\xbc\x0e>\x00\x00\x00",
    b"\nF\n'\n\x01a\x12\"\x1a \n\x1e\x97\x01\x93\x02\x9e\x01\xac\x06\xff\x01\xd8\x05\xe1\x07\xd8\x04g]\x9a\x05\xff\x06\xde\x07\x8f\x04\x97\x04\xda\x03\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x9a\xb7I\n\r\n\x01c\x12\x08\x12\x06\n\x04\xfb\x87\x83\xbf",  # noqa: E501
]
NOT_JSON = ("output 'OUTPUT0': element 0 is not valid UTF-8, which JSON cannot carry. Please "
            "use the binary data format for output")
DTYPES = ["|S78", np.object_, np.bytes_]   # (|S and bytes_ drop the trailing NULs)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("strings") / "models"
    python_model(repo, "string_identity", STRING_IDENTITY, io_config(
        "string_identity", [("INPUT0", "TYPE_STRING", "[ 8 ]")],
        [("OUTPUT0", "TYPE_STRING", "[ 8 ]")]))
    with start_server(repo) as srv:
        yield srv


def _input(module, data, binary=None):
    i = module.InferInput("INPUT0", list(data.shape), "BYTES")
    if binary is None:
        i.set_data_from_numpy(data)
    else:
        i.set_data_from_numpy(data, binary_data=binary)
    return [i]


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpc_round_trip(server, dtype):
    data = np.array(ELEMENTS, dtype=dtype)
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        out = c.infer("string_identity", _input(grpcclient, data)).as_numpy("OUTPUT0")
    assert np.array_equal(data, out)
    assert out.tolist() == [bytes(x) for x in data.tolist()]   # trailing NULs as sent


@pytest.mark.parametrize("dtype", DTYPES)
def test_http_binary_round_trip(server, dtype):
    data = np.array(ELEMENTS, dtype=dtype)
    with httpclient.InferenceServerClient(server.http_url) as c:
        out = c.infer("string_identity", _input(httpclient, data, True), outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]).as_numpy("OUTPUT0")
    assert np.array_equal(data, out)
    assert out.tolist() == [bytes(x) for x in data.tolist()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_http_json_output_refuses_bytes_json_cannot_carry(server, dtype):
    data = np.array(ELEMENTS, dtype=dtype)
    with httpclient.InferenceServerClient(server.http_url) as c:
        with pytest.raises(InferenceServerException) as e:
            c.infer("string_identity", _input(httpclient, data, True), outputs=[
                httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    assert (e.value.status(), e.value.message()) == ("400", NOT_JSON)


def test_http_json_output_of_utf8_text_still_works(server):
    data = np.array([f"é{i}\x00".encode() for i in range(8)], dtype=np.object_)
    with httpclient.InferenceServerClient(server.http_url) as c:
        out = c.infer("string_identity", _input(httpclient, data, False), outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]).as_numpy("OUTPUT0")
    assert out.tolist() == [x.decode() for x in data.tolist()]   # (JSON: the client's str)
