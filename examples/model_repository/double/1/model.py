"""OUT = 2 * IN: the second step of the add_then_double ensemble."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", 2 * pb_utils.get_input_tensor_by_name(request, "IN").as_numpy())])
            for request in requests]
