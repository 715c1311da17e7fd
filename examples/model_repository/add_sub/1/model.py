"""Triton's python_backend examples/add_sub: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1.

A Python model is a class TritonPythonModel in <model>/<version>/model.py; its
config.pbtxt says backend: "python". It runs unmodified on Triton and on Trireme.
"""
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        """Called once per instance; args["model_config"] is the config as JSON."""
        model_config = json.loads(args["model_config"])
        self.output_dtypes = [
            pb_utils.triton_string_to_numpy(
                pb_utils.get_output_config_by_name(model_config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")]

    def execute(self, requests):
        """One response per request, in order."""
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out_0 = pb_utils.Tensor("OUTPUT0", (in_0 + in_1).astype(self.output_dtypes[0]))
            out_1 = pb_utils.Tensor("OUTPUT1", (in_0 - in_1).astype(self.output_dtypes[1]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses

    def finalize(self):
        """Called once when the model is unloaded."""
