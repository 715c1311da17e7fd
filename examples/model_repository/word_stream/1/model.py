"""A stand-in for a text generator: it answers a prompt with the prompt's first
max_tokens words (a request parameter, default 16). With the input stream true it sends
one response per word, else one response with all of them; then the final flag.
"""
import json

import numpy as np

import triton_python_backend_utils as pb_utils


def _text(value):
    return pb_utils.Tensor("text_output", np.array([value.encode()], dtype=np.object_))


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().item()
            stream = pb_utils.get_input_tensor_by_name(request, "stream")   # optional
            max_tokens = int(json.loads(request.parameters()).get("max_tokens", 16))
            words = prompt.decode().split()[:max_tokens]
            if stream is not None and stream.as_numpy().item():
                for word in words:
                    sender.send(pb_utils.InferenceResponse([_text(word)]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(pb_utils.InferenceResponse([_text(" ".join(words))]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None   # a decoupled model answers through its senders only
