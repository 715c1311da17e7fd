"""A running sum per sequence: OUTPUT is the sum of INPUT over the sequence so far.

The control inputs come from the sequence batcher, not from the client: START is 1 on a
sequence's first request, END on its last, READY on every request that carries data, and
CORRID is the client's sequence_id, the key of the state kept here. Each request holds one
row of the batch: its tensors are [1, 1] (batch dimension first).
"""
import numpy as np

import triton_python_backend_utils as pb_utils


def _value(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().item()


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}   # CORRID -> running sum

    def execute(self, requests):
        responses = []
        for request in requests:
            total = 0
            if _value(request, "READY"):
                corrid = _value(request, "CORRID")
                previous = 0 if _value(request, "START") else self.sums.get(corrid, 0)
                total = previous + _value(request, "INPUT")
                if _value(request, "END"):
                    self.sums.pop(corrid, None)   # the sequence is over: drop its state
                else:
                    self.sums[corrid] = total
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", np.array([[total]], dtype=np.int32))]))
        return responses
