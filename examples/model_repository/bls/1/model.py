"""Business logic scripting (BLS): a Python model that calls another model of the server.

It asks `simple` (the ONNX add/sub model) for a + b and a - b, then multiplies the two in
Python: OUTPUT = (a + b) * (a - b) = a^2 - b^2. Unlike an ensemble, the code decides at run
time which models to call, how often, and what to do with their answers.
"""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            infer_request = pb_utils.InferenceRequest(
                model_name="simple",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            infer_response = infer_request.exec()   # blocks until `simple` answers
            if infer_response.has_error():
                responses.append(pb_utils.InferenceResponse(error=infer_response.error()))
                continue
            total = pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT0").as_numpy()
            difference = pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT", total * difference)]))
        return responses
